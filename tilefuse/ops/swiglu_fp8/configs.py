"""Tile configurations of the FP8 fused SwiGLU kernel, chosen from the problem's shape.

Register budget (8 warps = 2 warpgroups, 255 registers per thread): the fp32 accumulator of a
BLOCK_M x 2 BLOCK_N GEMM tile takes BLOCK_M * 2 BLOCK_N / 256 registers per thread, and with
scales that vary along K a second tile of that size holds each K block's product before it is
scaled into the total. So block-scaled tiles are 64 x 256 or 128 x 128 (64 + 64 registers), and
per-token / per-channel ones (no second tile) may be 128 x 256 (128 registers). A quantized output
needs the 128 output columns of a group in one tile (BLOCK_N = 128).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

NUM_SMS_H200 = 132


@dataclass(frozen=True)
class Fp8Config:
    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    group_m: int = 8
    num_stages: int = 4
    num_warps: int = 8


@functools.lru_cache(maxsize=4096)
def choose(m: int, k: int, i: int, k_scaled: bool, quant_out: bool, num_sms: int = NUM_SMS_H200) -> Fp8Config:
    """The config for ``x [m, k] x w [2i, k]``. ``k_scaled``: some scale varies along K (block or
    group scaling: BLOCK_K = 128, the scale block); ``quant_out``: e4m3 output with 1 x 128 group
    scales (BLOCK_N = 128)."""
    if quant_out:
        block_n = 128
    elif k_scaled:
        # 64 output columns (a 128-wide GEMM tile) unless 128 fill the SMs for at least two waves
        block_n = 128 if -(-m // 64) * -(-i // 128) >= 2 * num_sms else 64
    else:
        block_n = 128
    if k_scaled and block_n == 128:
        block_m = 64            # 64 x 256 GEMM tile: two fp32 tiles of 64 registers per thread
    else:
        block_m = 64 if m <= 64 else 128
    # Stages: 4 while the ring (x box + the gate|up box, e4m3) stays within ~160 KB of SMEM.
    stage_bytes = block_m * 128 + 2 * block_n * 128
    num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    return Fp8Config(block_m, block_n, 128 if k_scaled or k % 128 == 0 else 64, num_stages=num_stages)
