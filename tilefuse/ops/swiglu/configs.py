"""Kernel configurations of the fused SwiGLU GEMM: the tuned table and the fallback heuristic.

``choose(M, H, I)`` returns the (variant, config) the op runs. Lookup order: the table measured on
the H200 by ``scripts/tune_swiglu.py`` (keyed by the model shape ``(H, I)`` and the tuned M nearest
above), else a heuristic from the tile counts. Results are cached per ``(M bucket, H, I)``, so after
the first call of a shape the hot path is one dict lookup (no autotuning, ever).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

NUM_SMS_H200 = 132
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
    promote: bool = False  # per-K-step fp32 adds outside the tensor core (accuracy; unmeasured)


@dataclass(frozen=True)
class LargeMConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    warp_specialize: bool = True
    promote: bool = False  # per-K-step fp32 adds (accuracy); likely slows WGMMA, unmeasured


S, L = SmallMConfig, LargeMConfig

# Measured winners per (H, I) and tuned M: scripts/tune_swiglu.py on the H200, bf16, merged layout,
# 2026-11-29 (bench/results/swiglu-tune-h200.json holds every candidate's time). Fields in order:
# S(block_m, block_n, block_k, split_k, num_stages, num_warps),
# L(block_m, block_n, block_k, group_m, num_stages, num_warps, warp_specialize).
TUNED: dict[tuple[int, int], dict[int, SmallMConfig | LargeMConfig]] = {
    (896, 4864): {
        1: S(16, 64, 128, 1, 4, 4),
        16: S(16, 64, 128, 1, 4, 4),
        128: S(64, 64, 64, 1, 4, 4),
        1024: L(128, 128, 64, 8, 3, 8, False),
        4096: L(128, 128, 64, 8, 4, 8, True),
        16384: L(128, 128, 64, 8, 3, 8, True),
    },
    (1536, 8960): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 32, 128, 1, 4, 4),
        128: S(64, 64, 64, 1, 4, 4),
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
        128: L(64, 128, 64, 8, 4, 4, False),
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
        16384: L(128, 128, 64, 8, 4, 8, True),
    },
    (5120, 27648): {
        1: S(16, 64, 256, 1, 3, 4),
        16: S(16, 64, 128, 1, 4, 4),
        128: L(128, 128, 64, 8, 4, 8, True),
        1024: L(128, 64, 64, 8, 4, 4, False),
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
        return ("small_m" if isinstance(entry, SmallMConfig) else "large_m"), entry
    return heuristic(m_small, h, i, num_sms)


def choose(m: int, h: int, i: int, variant: str | None = None, num_sms: int = NUM_SMS_H200):
    """(variant, config) for an ``[m, h] x [2i, h]`` problem; ``variant`` pins the kernel."""
    bucket = _bucket(m)
    # The heuristic's small-M tiles depend on M itself below 64, on its bucket above.
    m_key = m if m <= 64 else bucket
    chosen, config = _choose_bucketed(bucket, m_key, h, i, num_sms)
    if variant is None or variant == chosen:
        return chosen, config
    if variant == "small_m":
        return variant, _small_m_heuristic(min(m, SMALL_M_MAX), h, i, num_sms)
    return variant, LargeMConfig()
