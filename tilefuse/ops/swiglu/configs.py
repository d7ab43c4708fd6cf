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


@dataclass(frozen=True)
class LargeMConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    warp_specialize: bool = True


S, L = SmallMConfig, LargeMConfig

# Measured winners per (H, I) and tuned M (scripts/tune_swiglu.py on the H200, bf16, merged layout).
# Empty until the sweep has run: the heuristic below is used for every shape until then.
TUNED: dict[tuple[int, int], dict[int, SmallMConfig | LargeMConfig]] = {}


def _bucket(m: int) -> int:
    return next((t for t in TUNED_M if m <= t), TUNED_M[-1])


def _small_m_heuristic(m: int, h: int, i: int, num_sms: int) -> SmallMConfig:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = -(-m // block_m)
    # Largest BLOCK_N that still gives two programs per SM; smaller tiles re-read x from L2 only.
    block_n = next((bn for bn in (64, 32) if m_tiles * -(-i // bn) >= 2 * num_sms), 16)
    block_k = 256 if (block_m <= 16 and h >= 2048) else 128
    tiles = m_tiles * -(-i // block_n)
    k_steps = -(-h // block_k)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k * 2 <= min(8, k_steps):
        split_k *= 2
    return SmallMConfig(block_m, block_n, block_k, split_k, num_stages=4 if block_k == 128 else 3)


def heuristic(m: int, h: int, i: int, num_sms: int = NUM_SMS_H200):
    """(variant, config) from tile counts alone, for shapes the sweep did not cover."""
    if m <= SMALL_M_MAX:
        return "small_m", _small_m_heuristic(m, h, i, num_sms)
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
