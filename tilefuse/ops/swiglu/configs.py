"""Launch settings of the fused SwiGLU GEMM and the choice among the kernels and the unfused path.

``choose(M, H, I)`` returns the (variant, config) the op runs; ``decide`` the whole decision
(``tilefuse.explain`` prints it). Authority, first that applies: a table measured on this GPU model
by ``tilefuse tune``; the table measured on the H200 by ``tilefuse tune`` (``TUNED``, keyed by
the model shape ``(H, I)`` and the measured M; an entry serves the M around it only where the
measurement transfers, :func:`_measured`); else the cost model (:func:`predict_us`: the roofline
of each candidate -- bytes over the bandwidth the kernel can reach with what it keeps in flight,
FLOPs over whole waves of its tiles, padded rows and columns included -- with efficiencies
measured on the H200), which takes a fused kernel over the unfused path (cuBLAS's GEMM on the
merged weight + one SiLU·mul pass, variant ``"unfused"``) only when it predicts it faster by a
margin (:func:`measured_regime`: 3 % where the measurements cover the kernel's regime, 15 %
elsewhere) at both ends of the decision's range of M. Decisions are cached per range (each M up
to 64, then 128 rows up to 4096, then powers of two), so after the first call of a shape the hot
path is one dict lookup (no autotuning, ever).
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
    """Useful fraction of the SMs' work over the kernel, counting K steps (no fix-up cost): the
    padding of the last row and column of tiles (a tile computes ``block_n`` gate and up columns
    whatever I is), times tiles / (waves * num_sms) without stream-K; with it the tail's K steps
    are spread evenly."""
    tiles_m, tiles_n = -(-m // cfg.block_m), -(-i // cfg.block_n)
    padding = (m * i) / (tiles_m * cfg.block_m * tiles_n * cfg.block_n)
    tiles = tiles_m * tiles_n
    k_steps = -(-h // cfg.block_k)
    sk_tiles, sk_iters = stream_k_split(m, h, i, cfg, num_sms)
    per_sm = (tiles - sk_tiles) // num_sms * k_steps + sk_iters if sk_tiles else -(-tiles // num_sms) * k_steps
    return padding * tiles * k_steps / (per_sm * num_sms)


S, L, P = SmallMConfig, LargeMConfig, PingPongConfig
U = "unfused"     # a table entry naming the baseline path (cuBLAS GEMM + SiLU*mul)

# Measured winners per (H, I) and M on the H200, bf16, merged layout: `tilefuse tune` (CUDA-graph
# replay, cold L2), whose candidates are the cost model's picks, tile variants around them, the
# ping-pong kernel, the unfused path (U: cuBLAS GEMM + SiLU*mul) and the entry this table held
# before (the earlier tools/tune_swiglu.py sweeps' picks). Every candidate's time:
# bench/results/sweeps/swiglu-tune-qwen-h200.json (the Qwen2.5 shapes, first block) and
# bench/results/sweeps/swiglu-tune-h200.json (the corpus calibration shapes, second block). An entry
# serves the M around it only where the measurement transfers (:func:`_measured`). Fields in order:
# S(block_m, block_n, block_k, split_k, num_stages, num_warps),
# L(block_m, block_n, block_k, group_m, num_stages, num_warps, warp_specialize, stream_k),
# P(block_m, block_n, block_k, group_m, stages).
TUNED: dict[tuple[int, int], dict[int, SmallMConfig | LargeMConfig | PingPongConfig | str]] = {
    (896, 4864): {
        1: S(16, 32, 128, 1, 4, 4),
        16: S(16, 64, 128, 1, 4, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 64, 64, 8, 4, 4, False, 0),
        1024: P(64, 128, 64, 8, 4),
        4096: P(64, 128, 64, 8, 4),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (1536, 8960): {
        1: S(16, 32, 128, 1, 4, 4),
        16: S(16, 32, 128, 1, 4, 4),
        64: S(64, 32, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 4, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
    },
    (2048, 11008): {
        1: S(16, 32, 256, 1, 3, 4),
        16: S(16, 32, 128, 1, 4, 4),
        64: S(64, 32, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 4, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (3584, 18944): {
        1: S(16, 32, 256, 1, 3, 4),
        16: S(16, 32, 128, 1, 4, 4),
        64: S(64, 32, 64, 1, 4, 4),
        128: U,
        1024: L(128, 128, 64, 8, 3, 8, False, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
    },
    (5120, 13824): {
        1: S(16, 32, 256, 1, 3, 4),
        16: S(16, 32, 256, 1, 3, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 1),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
    },
    (5120, 27648): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 128, 1, 4, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 1),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (8192, 29568): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 256, 1, 3, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 4, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    # the corpus calibration shapes (tools/corpus_gpu.sh tune): dense MLPs, DeepSeek-V3 / V2-Lite /
    # Qwen3 / Llama-4 experts, TP shards
    (2048, 96): {
        1: S(16, 64, 256, 4, 3, 4),
        16: S(16, 32, 256, 2, 3, 4),
        64: S(64, 16, 64, 4, 4, 4),
        128: S(64, 16, 64, 4, 4, 4),
        1024: U,
        4096: U,
        16384: U,
    },
    (2048, 2816): {
        1: U,
        16: S(16, 64, 256, 1, 3, 4),
        64: S(64, 64, 64, 2, 4, 4),
        128: U,
        1024: U,
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (2048, 8192): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 256, 1, 3, 4),
        64: S(64, 32, 64, 1, 4, 4),
        128: L(128, 64, 64, 8, 4, 4, False, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (4096, 1536): {
        1: S(16, 64, 256, 4, 3, 4),
        16: S(16, 32, 256, 4, 3, 4),
        64: U,
        128: U,
        1024: U,
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (4096, 14336): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 256, 1, 3, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 1),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (5120, 1024): {
        1: S(16, 64, 256, 4, 3, 4),
        16: S(16, 32, 256, 4, 3, 4),
        64: U,
        128: U,
        1024: U,
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (6144, 16384): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 256, 1, 3, 4),
        64: S(64, 64, 64, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True, 0),
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 1),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (7168, 2048): {
        1: S(16, 64, 256, 4, 3, 4),
        16: S(16, 32, 256, 2, 3, 4),
        64: U,
        128: U,
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
    },
    (7168, 18432): {
        1: S(16, 64, 256, 2, 3, 4),
        16: S(16, 32, 256, 1, 3, 4),
        64: U,
        128: U,
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 0),
    },
    (8192, 3584): {
        1: S(16, 64, 256, 2, 3, 4),
        16: S(16, 64, 256, 2, 3, 4),
        64: U,
        128: U,
        1024: L(128, 128, 64, 8, 3, 8, True, 0),
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
    },
    (16384, 6656): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 256, 1, 3, 4),
        64: U,
        128: U,
        1024: U,
        4096: L(128, 128, 64, 8, 3, 8, True, 0),
        16384: L(128, 128, 64, 8, 3, 8, True, 1),
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
    decide.cache_clear()


def _small_m_in_flight(cfg: SmallMConfig, programs: int, num_sms: int) -> float:
    """Bytes the small-M kernel keeps in flight: each resident program has ``num_stages - 1``
    K steps of its gate and up tiles (and x's rows) loading (Little's law: the bandwidth it can
    reach is this over the memory latency)."""
    stage = (2 * cfg.block_n + cfg.block_m) * cfg.block_k * 2
    per_sm = max(1, min(4, (227 * 1024) // (cfg.num_stages * stage)))
    return min(programs, per_sm * num_sms) * (cfg.num_stages - 1) * stage


def _small_m_heuristic(m: int, h: int, i: int, num_sms: int) -> SmallMConfig:
    """Tiles for shapes the sweep did not cover. At M <= 16, 64-wide N tiles with long K steps won
    on every Qwen shape. The memory system needs about ``bandwidth x latency`` bytes in flight
    (``_dispatch.Chip.in_flight_bytes``, ~8.5 MB on an H200); where the tiles are few (small I,
    or few SMs' worth of them) split-K multiplies the programs until they keep that much in
    flight, never below one K step per pipeline stage per slice."""
    from tilefuse import _dispatch

    target = _dispatch.CHIPS["H200"].in_flight_bytes * num_sms / NUM_SMS_H200
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = 256 if (block_m == 16 and h >= 2048) else 128 if block_m <= 32 else 64
    stages = 3 if block_k == 256 else 4
    m_tiles = -(-m // block_m)
    k_steps = -(-h // block_k)
    best = None
    for block_n in (64, 32, 16):
        tiles = m_tiles * -(-i // block_n)
        split_k = 1
        while (_small_m_in_flight(SmallMConfig(block_m, block_n, block_k, split_k, stages), tiles * split_k, num_sms)
               < target and split_k * 2 <= 16 and k_steps // (split_k * 2) >= stages):
            split_k *= 2
        cfg = SmallMConfig(block_m, block_n, block_k, split_k, num_stages=stages)
        flight = _small_m_in_flight(cfg, tiles * split_k, num_sms)
        if flight >= target:
            return cfg
        if best is None or flight > best[0]:
            best = (flight, cfg)
    return best[1]


def heuristic(m: int, h: int, i: int, num_sms: int = NUM_SMS_H200):
    """(variant, config) of the fused kernels from tile counts alone, for shapes the sweep did not
    cover (the cost model then weighs it against the unfused path)."""
    if m <= 64 or (m <= SMALL_M_MAX and i * h < 32 * 2 ** 20):
        return "small_m", _small_m_heuristic(m, h, i, num_sms)
    if m <= SMALL_M_MAX:
        return "large_m", LargeMConfig(num_stages=4)
    return "large_m", LargeMConfig()


# ------------------------------------------------------------------------------- cost model
# Efficiencies of the kernels relative to the chip's ceilings, from bench/results/swiglu-h200.json
# (graph replay, the 8 measured shapes x M = 1..16384): the small-M kernel's MMA work at
# block_m <= 64 runs at about 0.3 of the bf16 rate (M = 128 rows: 1.5-1.9x cuBLAS's time where
# memory does not limit); the persistent kernels' waves at cuBLAS's rate (large_m) and 0.92 of it
# (the ping-pong kernel, 5-8 % behind large_m where both ran).
SMALL_M_MMA_EFF = 0.3
LARGE_M_EFF = {"large_m": 1.0, "pingpong": 0.92}
SPLIT_FIXUP_US = 2.0        # the last K slice's wait and sum of the fp32 partials
SILU_MUL_LAUNCH_US = 3.0    # the unfused path's second kernel (graph replay)


def predict_us(variant: str, cfg, m: int, h: int, i: int, chip) -> float:
    """Predicted graph-replay time (us) of ``variant`` with ``cfg`` on an ``[m, h] x [2i, h]``
    problem, bf16/fp16, on ``chip`` (``_dispatch.Chip``). ``"unfused"``: cuBLAS's GEMM on the
    merged weight, then the SiLU·mul pass (reads ``[m, 2i]``, writes ``[m, i]``)."""
    from tilefuse import _dispatch

    weights, acts, out = 2 * i * h * 2, m * h * 2, m * i * 2
    if variant == "unfused":
        silu = SILU_MUL_LAUNCH_US + 3 * out / chip.copy_bytes_per_us
        return _dispatch.gemm_us(chip, m, 2 * i, h) + silu
    flops = 2.0 * m * 2 * i * h
    if variant == "small_m":
        programs = -(-m // cfg.block_m) * -(-i // cfg.block_n) * cfg.split_k
        memory = _dispatch.stream_us(chip, weights + acts + out, _small_m_in_flight(cfg, programs, chip.sms))
        padded = -(-m // cfg.block_m) * cfg.block_m      # the last tile's empty rows are multiplied too
        compute = chip.ramp_us / 2 + flops * padded / m / (chip.bf16_flop_per_us * SMALL_M_MMA_EFF)
        return max(memory, compute) + (SPLIT_FIXUP_US if cfg.split_k > 1 else 0.0)
    fill = wave_efficiency(m, h, i, cfg if isinstance(cfg, LargeMConfig) else LargeMConfig(
        cfg.block_m, cfg.block_n, cfg.block_k), chip.sms)
    compute = chip.ramp_us / 2 + flops / (chip.bf16_flop_per_us * fill * LARGE_M_EFF[variant])
    return max(_dispatch.stream_us(chip, weights + acts + out), compute)


def measured_regime(variant: str, cfg, m: int, h: int, i: int, num_sms: int) -> bool:
    """Whether bench/results/swiglu-h200.json covers the regime of this kernel and config (the
    cost model then needs a small margin over the unfused path): the small-M kernel at M <= 16
    without split-K and with enough bytes in flight (0.92-1.02x cuBLAS's GEMM on all 8 measured
    shapes), the large-M kernel from M = 1024 in whole row tiles (0.95-1.04x). Split-K, M = 17..1023 off the table,
    and the ping-pong kernel (only where the table names it) are not."""
    from tilefuse import _dispatch

    if variant == "small_m":
        target = _dispatch.CHIPS["H200"].in_flight_bytes * num_sms / NUM_SMS_H200
        programs = -(-m // cfg.block_m) * -(-i // cfg.block_n)
        return m <= 16 and cfg.split_k == 1 and _small_m_in_flight(cfg, programs, num_sms) >= target
    # the large-M kernel's measurements are of whole row tiles (M a multiple of 128): a partly
    # empty last row of tiles (M = 1025: 12 % padding) measured 1.2-1.35x its M = 1024 time
    return variant == "large_m" and m >= 1024 and -(-m // cfg.block_m) * cfg.block_m <= 1.04 * m


def candidates(m: int, h: int, i: int, num_sms: int) -> list[tuple[str, object]]:
    """The (variant, config) pairs the cost model weighs for a shape without a measured entry:
    the fused kernels' heuristic pick, the large-M kernel from 65 rows on, and the unfused path."""
    picks = [heuristic(m, h, i, num_sms)]
    if m > 64 and picks[0][0] != "large_m":
        picks.append(("large_m", LargeMConfig(num_stages=4) if m <= SMALL_M_MAX else LargeMConfig()))
    return picks + [("unfused", None)]


def _measured(table: dict, h: int, i: int, m: int, lo: int | None = None, num_sms: int = NUM_SMS_H200):
    """The entry of a ``{(H, I): {M: config or "unfused"}}`` table that rules for every M in
    ``[lo, m]`` (default ``lo = m``), or None (the cost model decides). The entry at the measured
    M nearest above (the last one past the end) rules where it was measured; below that, a kernel
    config where its row tiles are as many at ``lo`` as where it was measured (the last tile just
    has fewer rows: the same work) or where its tiles fill two waves of ``num_sms`` at ``lo`` with
    at most 4 % of padded rows (what changes with M is then a small share), an unfused entry
    where the entry below is unfused too.
    Elsewhere the tile counts, waves and crossovers differ from what was measured (e.g. 333 rows
    between entries at 128 and 1024)."""
    entries = table.get((h, i))
    if not entries:
        return None
    lo = m if lo is None else lo
    measured = sorted(entries)
    above = next((t for t in measured if t >= m), measured[-1])
    entry = entries[above]
    if lo == m == above:
        return entry
    if entry == U:
        below = next((t for t in reversed(measured) if t < lo), None)
        return entry if below is None or entries[below] == U else None
    rows = entry.block_m
    if -(-lo // rows) == -(-above // rows) and m <= above:
        return entry
    # many waves and little padding at both ends: what changes with M is a small share
    tiles_lo = -(-lo // rows) * -(-i // entry.block_n)
    padding_lo = -(-lo // rows) * rows / lo
    return entry if tiles_lo >= 2 * num_sms and padding_lo <= 1.04 and m <= above else None


def _path(entry) -> str:
    return U if entry == U else variant_of(entry)


def _tuned_entries(table: dict) -> dict:
    """A ``tilefuse tune`` table's swiglu section (``{"H,I": {"M": {"variant", "config"}}}``) as
    ``{(H, I): {M: config or "unfused"}}``."""
    out: dict = {}
    for shape, per_m in table.get("swiglu", {}).items():
        h, i = (int(v) for v in shape.split(","))
        for m, entry in per_m.items():
            variant = entry["variant"]
            out.setdefault((h, i), {})[int(m)] = (
                "unfused" if variant == "unfused" else CONFIG_CLASSES[variant](**entry["config"]))
        out[(h, i)] = dict(sorted(out[(h, i)].items()))
    return out


@functools.lru_cache(maxsize=4096)
def decide(m: int, h: int, i: int, num_sms: int = NUM_SMS_H200, chip=None, tuned_name: str | None = None,
           lo: int | None = None):
    """The decision for every M in ``[lo, m]`` (default ``lo = m``), as a ``_dispatch.Choice``: a
    table measured on this GPU by ``tilefuse tune`` (``tuned_name``: the GPU's name), else the
    shipped table (:func:`_measured`: where an entry rules), else the cost model over
    :func:`candidates`: a kernel over the unfused path only where predicted faster by the margin
    of :func:`measured_regime` at both ends of the range. Cached per size."""
    from tilefuse import _dispatch

    chip = chip or _dispatch.CHIPS["H200"]
    lo = m if lo is None else lo
    problem = {"M": m, "H": h, "I": i} if lo == m else {"M": f"{lo}..{m}", "H": h, "I": i}
    picks = candidates(m, h, i, num_sms)
    weighed = tuple(_dispatch.Candidate(v, c, predict_us(v, c, m, h, i, chip),
                                        "cuBLAS GEMM on [2I, H] + one SiLU*mul pass" if v == "unfused" else "")
                    for v, c in picks)
    if tuned_name is not None:
        entry = _measured(_tuned_entries(_dispatch.tuned_table(tuned_name)), h, i, m, lo, num_sms)
        if entry is not None:
            variant = U if entry == U else variant_of(entry)
            return _dispatch.Choice("swiglu", problem, variant, None if entry == U else entry,
                                    f"tuned table ({_dispatch.tuned_path(tuned_name).name})", weighed)
    entry = _measured(TUNED, h, i, m, lo, num_sms)
    if entry is not None:
        if entry == U:
            return _dispatch.Choice("swiglu", problem, U, None, "shipped table (H200 sweep)", weighed)
        return _dispatch.Choice("swiglu", problem, variant_of(entry), entry, "shipped table (H200 sweep)", weighed)
    pick = next(c for c in weighed if c.variant == U)
    ends = {m: pick.predicted_us}                          # the baseline at both ends of the range
    if lo != m:
        ends[lo] = predict_us(U, None, lo, h, i, chip)

    def wins(cand, rows):
        margin = (_dispatch.MARGIN_MEASURED_REGIME if measured_regime(cand.variant, cand.config, rows, h, i, num_sms)
                  else _dispatch.MARGIN_UNMEASURED)
        mine = cand.predicted_us if rows == m else predict_us(cand.variant, cand.config, rows, h, i, chip)
        return mine <= (1 - margin) * ends[rows]

    for cand in sorted((c for c in weighed if c.variant != U), key=lambda c: c.predicted_us):
        if all(wins(cand, rows) for rows in ends):
            pick = cand
            break
    return _dispatch.Choice("swiglu", problem, pick.variant, pick.config, "cost model", weighed)


DECISION_ROWS = 128      # above 64 rows, one decision per this many rows up to DECISION_POW2_FROM
DECISION_POW2_FROM = 4096  # then one per power of two (33+ row tiles: little changes within one)


def decision(m: int, h: int, i: int, num_sms: int = NUM_SMS_H200, chip=None, tuned_name: str | None = None):
    """:func:`decide` for ``m`` tokens: each M up to 64 decided on its own, then one decision per
    128 rows (the large-M kernels' row tile: the tile counts and padding, hence the crossovers,
    move in those steps) up to 4096, one per power of two above; each made for its whole range
    (the cache stays small, the hot path one look-up)."""
    if m <= 64:
        return decide(m, h, i, num_sms, chip, tuned_name)
    if m <= DECISION_POW2_FROM:
        top = -(-m // DECISION_ROWS) * DECISION_ROWS
        return decide(top, h, i, num_sms, chip, tuned_name, max(65, top - DECISION_ROWS + 1))
    top = 1 << (m - 1).bit_length()
    return decide(top, h, i, num_sms, chip, tuned_name, top // 2 + 1)


def choose(m: int, h: int, i: int, variant: str | None = None, num_sms: int = NUM_SMS_H200, chip=None,
           tuned_name: str | None = None):
    """(variant, config) for an ``[m, h] x [2i, h]`` problem; ``variant`` pins the kernel
    (``"unfused"``: the baseline path, config None)."""
    choice = decision(m, h, i, num_sms, chip, tuned_name)
    if variant is None or variant == choice.variant:
        return choice.variant, choice.config
    if variant == "unfused":
        return variant, None
    if variant == "small_m":
        return variant, _small_m_heuristic(min(m, SMALL_M_MAX), h, i, num_sms)
    if variant == "pingpong":
        return variant, PingPongConfig()
    return variant, LargeMConfig()


apply_overrides(_env.settings.configs.get("swiglu", []))
