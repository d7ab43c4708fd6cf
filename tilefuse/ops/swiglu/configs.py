"""Kernel configurations of the fused SwiGLU GEMM: the tuned table and the fallback heuristic.

``choose(M, H, I)`` returns the (variant, config) the op runs. Lookup order: the table measured on
the H200 by ``tools/tune_swiglu.py`` (keyed by the model shape ``(H, I)`` and the tuned M nearest
above), else a heuristic from the tile counts. Results are cached per ``(M bucket, H, I)``, so after
the first call of a shape the hot path is one dict lookup (no autotuning, ever).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tilefuse import _env

NUM_SMS_H200 = 132
# Rows per gate (and per up) run in the packed layout. 64 lets the large-M kernel's BLOCK_N be 64 or
# 128 (one or two packed blocks per TMA box) and keeps every Qwen/Llama intermediate size whole.
PACK = 64
# M at and below which the split-K pointer kernel runs when no tuned entry says otherwise.
SMALL_M_MAX = 256
TUNED_M = (1, 16, 128, 1024, 4096, 16384)


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4
    promote: bool = False  # per-K-step fp32 adds outside the tensor core (accuracy; docs/swiglu.md)


@dataclass(frozen=True)
class LargeMConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    warp_specialize: bool = True
    # Waves handed to the stream-K tail (0: off). 1: the tiles of the last, partial wave are shared
    # out by K steps over all SMs; 2: those plus one whole wave (fewer, larger pieces per tile).
    stream_k: int = 0
    promote: bool = False  # per-K-step fp32 adds (accuracy): measured 1.4-2.1x slower here (docs/swiglu.md)


@dataclass(frozen=True)
class PingPongConfig:
    """Tiles of the Gluon ping-pong kernel (``kernels_gluon.py``). Each consumer warpgroup holds
    two ``[block_m, block_n]`` fp32 accumulators, so ``block_m * block_n <= 8192`` (128 registers
    per thread; 128 x 128 spills); ``stages`` ring slots of ``(block_m + 2 block_n) x block_k``."""
    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    stages: int = 4

    def __post_init__(self):
        if self.block_m not in (64, 128) or self.block_m * self.block_n > 8192 or self.block_n % 16:
            raise ValueError(f"PingPongConfig: block_m must be 64 or 128 and block_m * block_n <= 8192 (a multiple "
                             f"of 16 wide), got {self.block_m} x {self.block_n}")


def stream_k_split(m: int, h: int, i: int, cfg: LargeMConfig, num_sms: int) -> tuple[int, int]:
    """(sk_tiles, sk_iters) of the large-M kernel: how many of the last tiles go to stream-K and
    how many K steps each program takes of them; (0, 0) when stream-K is off or the tiles fill
    whole waves."""
    tiles = -(-m // cfg.block_m) * -(-i // cfg.block_n)
    tail = tiles % num_sms
    if cfg.stream_k <= 0 or tail == 0:
        return 0, 0
    sk_tiles = min(tiles, tail + (cfg.stream_k - 1) * num_sms)
    k_steps = -(-h // cfg.block_k)
    return sk_tiles, -(-sk_tiles * k_steps // num_sms)


def wave_efficiency(m: int, h: int, i: int, cfg: LargeMConfig, num_sms: int = 132) -> float:
    """Busy fraction of the SMs over the kernel, counting K steps (no fix-up cost): tiles / (waves
    * num_sms) without stream-K; with it the tail's K steps are spread evenly."""
    tiles = -(-m // cfg.block_m) * -(-i // cfg.block_n)
    k_steps = -(-h // cfg.block_k)
    sk_tiles, sk_iters = stream_k_split(m, h, i, cfg, num_sms)
    per_sm = (tiles - sk_tiles) // num_sms * k_steps + sk_iters if sk_tiles else -(-tiles // num_sms) * k_steps
    return tiles * k_steps / (per_sm * num_sms)


S, L, P = SmallMConfig, LargeMConfig, PingPongConfig

# The ping-pong kernel (P entries): swept against the picks below at M = 128 .. 16384 with
# tools/tune_swiglu.py --mode pingpong on the H200 ("sweep 1", its timings not in the committed
# results; "sweep 2" after the ring hand-off moved ahead of the last WGMMA wait,
# bench/results/sweeps/swiglu-pingpong-sweep-h200.json). In sweep 2 its best tiles take 0.99-1.32x
# cuBLAS's time where the picks take 0.91-1.30x; it wins the three entries marked "sweep 2" below
# by 4-7 %, the one marked "sweep 1" by 4 % in that sweep. Elsewhere it runs when forced
# (``tilefuse.force(variant="pingpong")``).

# Measured winners per (H, I) and tuned M: tools/tune_swiglu.py on the H200, bf16, merged layout
# (entries marked "tail sweep" / "tiles sweep" come from the CUDA-graph-timed `tune_swiglu.py
# tail|tiles` runs; the timings of these sweeps are not in the committed results, and
# bench/results/swiglu-h200.json has every entry's time in the full bench).
# _M64_NOTE: where the new M = 128 entry has 128-row tiles, an M = 64 entry keeps the former
# M = 128 config for M = 17..64 (the 128-row tile would do 2-8x padded MMA work there; neither was
# timed at those M). Fields in order:
# S(block_m, block_n, block_k, split_k, num_stages, num_warps),
# L(block_m, block_n, block_k, group_m, num_stages, num_warps, warp_specialize, stream_k).
TUNED: dict[tuple[int, int], dict[int, SmallMConfig | LargeMConfig | PingPongConfig]] = {
    (896, 4864): {
        1: S(16, 64, 128, 1, 4, 4),
        16: S(16, 64, 128, 1, 4, 4),
        64: S(64, 64, 64, 1, 4, 4),  # M = 17..64 keep the pre-2026-11-29-tail entry (see _M64_NOTE)
        128: L(128, 64, 64, 8, 4, 4, False),  # tiles sweep: 14.8 vs 15.6 us (S(64, 64, 64))
        1024: P(64, 128, 64, 8, 4),            # ping-pong sweep 2: 36.1 vs 37.5 us
        4096: P(64, 128, 64, 8, 4),            # ping-pong sweep 2: 110.1 vs 114.9 us
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (1536, 8960): {
        1: S(16, 128, 128, 1, 4, 8),  # tail sweep: 24.9 vs 27.1 us (S(16, 64, 256): 140 tiles)
        16: S(16, 32, 128, 1, 4, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 64, 64, 8, 4, 4, False),  # tiles sweep: 33.9 vs 35.5 us (S(64, 64, 64))
        1024: L(128, 128, 64, 8, 4, 8, True),
        4096: L(128, 128, 64, 8, 3, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (2048, 11008): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 128, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True),
        1024: L(128, 128, 64, 8, 4, 8, True),
        4096: L(128, 128, 64, 8, 3, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (3584, 18944): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 128, 1, 4, 4),
        64: L(64, 128, 64, 8, 4, 4, False),
        128: L(128, 64, 64, 8, 4, 4, False, 1),  # stream-K tail: 90.8 vs 97.4 us (tail sweep)
        1024: L(128, 128, 64, 8, 3, 8, False),
        4096: L(128, 128, 64, 8, 3, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (5120, 13824): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 256, 1, 3, 4),
        128: L(128, 128, 64, 8, 4, 8, True),
        1024: L(128, 128, 64, 8, 3, 8, False),
        4096: L(128, 128, 64, 8, 3, 8, True),
        16384: P(64, 128, 64, 8, 4),           # ping-pong sweep 2: 6405.9 vs 6856.0 us
    },
    (5120, 27648): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 128, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True),
        1024: P(64, 128, 64, 8, 4),            # ping-pong sweep 1: 856.2 vs 889.7 us
        4096: L(128, 128, 64, 8, 3, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (8192, 29568): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 256, 1, 3, 4),
        128: L(128, 128, 64, 8, 4, 8, True),
        1024: L(128, 128, 64, 8, 3, 8, False),
        4096: L(128, 128, 64, 4, 3, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, False),
    },
}


CONFIG_CLASSES = {"small_m": SmallMConfig, "large_m": LargeMConfig, "pingpong": PingPongConfig}


def variant_of(config) -> str:
    """The kernel a config belongs to."""
    return next(name for name, cls in CONFIG_CLASSES.items() if isinstance(config, cls))


def apply_overrides(entries: list[dict]) -> None:
    """Merge a sweep's winners into ``TUNED`` (the ``"swiglu"`` section of ``TILEFUSE_CONFIGS``):
    ``[{"H", "I", "M", "variant", "config": {field: value}}]``, so a benchmark in the same run
    measures them before they are copied into the table by hand."""
    for entry in entries:
        cls = CONFIG_CLASSES[entry["variant"]]
        TUNED.setdefault((entry["H"], entry["I"]), {})[entry["M"]] = cls(**entry["config"])
    _choose_bucketed.cache_clear()


def _bucket(m: int) -> int:
    return next((t for t in TUNED_M if m <= t), TUNED_M[-1])


def _small_m_heuristic(m: int, h: int, i: int, num_sms: int) -> SmallMConfig:
    # From the sweep: at M <= 16, 64-wide N tiles with long K steps won on every Qwen shape and
    # split-K never did (I / 64 >= 76 tiles already); it is kept for narrow layers (few tiles).
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = 256 if (block_m == 16 and h >= 2048) else 128 if block_m <= 32 else 64
    m_tiles = -(-m // block_m)
    block_n = 64 if m_tiles * -(-i // 64) >= num_sms // 2 else 32 if m_tiles * -(-i // 32) >= num_sms // 2 else 16
    tiles = m_tiles * -(-i // block_n)
    k_steps = -(-h // block_k)
    split_k = 1
    while tiles * split_k < num_sms // 2 and split_k * 2 <= min(8, k_steps):
        split_k *= 2
    return SmallMConfig(block_m, block_n, block_k, split_k, num_stages=3 if block_k == 256 else 4)


def heuristic(m: int, h: int, i: int, num_sms: int = NUM_SMS_H200):
    """(variant, config) from tile counts alone, for shapes the sweep did not cover."""
    if m <= 64 or (m <= SMALL_M_MAX and i * h < 32 * 2 ** 20):
        return "small_m", _small_m_heuristic(m, h, i, num_sms)
    if m <= SMALL_M_MAX:
        return "large_m", LargeMConfig(num_stages=4)
    return "large_m", LargeMConfig()


@functools.lru_cache(maxsize=4096)
def _choose_bucketed(bucket: int, m_small: int, h: int, i: int, num_sms: int):
    entry = TUNED.get((h, i), {}).get(bucket)
    if entry is not None:
        return variant_of(entry), entry
    return heuristic(m_small, h, i, num_sms)


def choose(m: int, h: int, i: int, variant: str | None = None, num_sms: int = NUM_SMS_H200):
    """(variant, config) for an ``[m, h] x [2i, h]`` problem; ``variant`` pins the kernel."""
    bucket = _bucket(m)
    if 16 < m <= 64 and 64 in TUNED.get((h, i), {}):
        bucket = 64  # an explicit entry for M = 17..64 (else the M = 128 entry serves them)
    # The heuristic's small-M tiles depend on M itself below 64, on its bucket above.
    m_key = m if m <= 64 else bucket
    chosen, config = _choose_bucketed(bucket, m_key, h, i, num_sms)
    if variant is None or variant == chosen:
        return chosen, config
    if variant == "small_m":
        return variant, _small_m_heuristic(min(m, SMALL_M_MAX), h, i, num_sms)
    if variant == "pingpong":
        return variant, PingPongConfig()
    return variant, LargeMConfig()


apply_overrides(_env.settings.configs.get("swiglu", []))
