"""Tile configurations of the FP8 fused SwiGLU kernel, chosen from the problem's shape.

Register budget (8 warps = 2 warpgroups, 255 registers per thread): the fp32 accumulator of a
BLOCK_M x 2 BLOCK_N GEMM tile takes BLOCK_M * 2 BLOCK_N / 256 registers per thread, and a second
tile of that size holds each K block's product (or short chain of blocks, PROMOTE) before it joins
the fp32 total. So tiles are 64 x 256 or 128 x 128 (64 + 64 registers). A quantized output
needs the 128 output columns of a group in one tile (BLOCK_N = 128).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tilefuse import _env
from tilefuse.ops.swiglu.configs import SILU_MUL_LAUNCH_US
from tilefuse.ops.swiglu_fp8.reference import GROUP

NUM_SMS_H200 = 132
# With scales constant along K (per token / per channel / per tensor), the kernel adds its tensor-core
# sum to the fp32 total every PROMOTE K blocks of 128. Chaining all of K measured outside 1.5x of
# cuBLASLt's error on the H200 (up to 9.6 % of the e4m3 output codes off the spec's, against
# <= 5 % block-scaled); one block per chain is the block-scaled path's measured accuracy.
PROMOTE = 1
TUNED_M = (16, 128, 1024, 4096, 16384)


@dataclass(frozen=True)
class Fp8Config:
    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    group_m: int = 8
    num_stages: int = 4
    num_warps: int = 8


@dataclass(frozen=True)
class WsConfig:
    """Tiles of the Gluon warp-specialized kernel (``kernels_gluon.py``): [128, block_n] output
    tiles (block_n 64 or 128, 128 for an e4m3 output), ``stages`` ring slots of 32 KB. The default
    where ``TUNED`` holds one (M > 16 on Hopper, see :func:`choose`), or pinned with
    ``tilefuse.force(variant="ws")``."""
    block_n: int = 128
    stages: int = 4
    group_m: int = 8

    def __post_init__(self):
        if self.block_n not in (64, 128) or not 2 <= self.stages <= 5:
            raise ValueError(f"WsConfig: block_n must be 64 or 128 and stages 2-5, got {self.block_n}, {self.stages}")


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode kernel (``kernels.swiglu_fp8_decode_kernel``): [block_m, block_n] output
    tiles (block_n 32-128; 128 for an e4m3 output), K split over ``split_k`` programs (0: chosen
    per shape by :func:`decode_config` for ``programs_per_sm`` programs per SM)."""
    block_m: int = 16
    block_n: int = 64
    split_k: int = 0
    num_stages: int = 4
    num_warps: int = 4
    programs_per_sm: int = 4


# The decode kernel serves M <= DECODE_MAX_M (one 16-row tile) unless another variant is pinned.
DECODE_MAX_M = 16


def decode_config(m: int, k: int, i: int, quant_out: bool, num_sms: int = NUM_SMS_H200,
                  base: DecodeConfig | None = None) -> DecodeConfig:
    """The decode kernel's launch config from ``base`` (default: the ``TUNED`` entry of M's bucket
    when it is a DecodeConfig, else ``DecodeConfig()``): an e4m3 output takes 128 columns (one
    group); a split of 0 becomes the one that reaches ``programs_per_sm`` programs per SM (enough
    16-32 KB K blocks in flight to keep HBM busy when the weight stream is the whole cost), never
    an empty slice (the 128-wide K blocks divided as evenly as whole blocks allow)."""
    if base is None:
        tuned = TUNED.get(quant_out, {}).get(next((t for t in TUNED_M if m <= t), TUNED_M[-1]))
        base = tuned if isinstance(tuned, DecodeConfig) else DecodeConfig()
    block_n = 128 if quant_out else base.block_n
    k_blocks = max(1, -(-k // 128))
    split = base.split_k
    if not split:
        tiles = -(-i // block_n) * -(-m // base.block_m)
        split = max(1, -(-base.programs_per_sm * num_sms // tiles))
    per_split = -(-k_blocks // min(split, k_blocks))
    return replace(base, block_n=block_n, split_k=-(-k_blocks // per_split))


def ws_config(m: int, i: int, quant_out: bool, num_sms: int = NUM_SMS_H200) -> WsConfig:
    """The Gluon kernel's tiles: 128 output columns (one e4m3 scale group, fewer x reloads) unless
    64 make at least one more wave of tiles for a bf16 output."""
    if quant_out or -(-m // 128) * -(-i // 128) >= num_sms:
        return WsConfig(128)
    return WsConfig(64)


# Measured picks by quant_out and M bucket (the TUNED_M entry at or above M), for all shapes: the
# "swiglu_fp8" section of a TILEFUSE_CONFIGS file ([{"quant", "M", "config"}, with "variant": "ws"
# for a WsConfig, "decode" for a DecodeConfig], written by ``tools/tune_swiglu.py --mode fp8`` and
# ``--mode fp8decode``) is merged in at import. A WsConfig entry makes the Gluon kernel the default
# there (where it can run; else the heuristic's tl tiles); a DecodeConfig entry (M = 16: the
# decode kernel's bucket) replaces the decode kernel's default tiles.
# Measured: tools/tune_swiglu.py --mode fp8 on the H200 (bench/results/sweeps/swiglu-fp8-sweep-h200.json):
# graph time summed over Llama-3-8B and Qwen2.5-72B, block scales; the Gluon kernel's best against
# the tl kernel's best. M <= 16 keeps the heuristic's tl tiles (a 128-row tile is mostly padding).
F = Fp8Config
W = WsConfig
TUNED: dict[bool, dict[int, Fp8Config | WsConfig]] = {
    False: {  # bf16 output
        128: W(128, 4),        # 215.2 us vs the tl kernel's best 233.9
        1024: W(128, 3),       # 1403.0 vs 1512.1
        4096: W(128, 3),       # 5671.1 vs 6201.0
        16384: W(128, 3),      # 24217.1 vs 25123.1
    },
    True: {   # e4m3 output (1 x 128 group scales)
        128: W(128, 5),        # 216.5 vs 259.0
        1024: W(128, 4),       # 1352.7 vs 1562.6
        4096: W(128, 3),       # 5711.4 vs 6736.8
        16384: W(128, 5),      # 25135.2 vs 28425.7
    },
}
# A WsConfig pick stands only where its [128, 128] tiles cover at least this fraction of the SMs:
# below it the tl kernel's 64-row tiles run twice the programs (Qwen2.5-0.5B at M = 128: 38 Gluon
# tiles, 16.5 us against the tl kernel's 14.8 in bench/results/swiglu_fp8-h200-quick.json, where
# Llama-3-8B's 112 tiles run 48.3; in bench/results/sweeps/swiglu-fp8-sweep-h200.json, 47.5 against the
# tl kernel's best 61.2 with an e4m3 output).
WS_MIN_SM_FRACTION = 0.5


# ------------------------------------------------------------------------------- cost model
# The fused kernels against the unfused FP8 pipeline (variant "unfused": cuBLASLt's FP8 GEMM
# ``torch._scaled_mm`` on the merged weight, bf16 out, then one SiLU·mul pass that re-quantizes an
# e4m3 output), each predicted from its roofline terms with factors fitted to the graph times of
# bench/results/swiglu_fp8-h200-quick.json (M = 128 and 4096 on four shapes, 0.5B-72B):
# * fused (the Gluon / tl tiled kernels above 16 rows): the larger of the bytes at the copy
#   bandwidth and the FLOPs at ``FUSED_EFF`` x the chip's FP8 rate over whole waves of its output
#   tiles (``_dispatch.tile_fill``); 0.74 with group / block scales (one promotion per 128-wide K
#   step), 0.82 with scales constant along K (within 3 % at M = 4096 but 0.5B's 19 tiles a wave);
# * unfused: ``_dispatch.gemm_us`` (FP8 operands, bf16 out) x ``SCALED_MM_FIT`` (cuBLASLt measured
#   1.05-1.30x the model, 1.2 typical; its block-scaled GEMM once 1.8x at 72B, M = 128), plus the
#   pass: its launch (the bf16 family's `SILU_MUL_LAUNCH_US`) and 4 bytes read, 1-2 written per
#   output at the copy bandwidth.
# The unfused path runs only where predicted faster by a margin (``_dispatch``'s: 3 % at M >= 128,
# where both are measured; 15 % below): the fused kernels are the measured, tuned incumbent. And
# only where the fused kernel's predicted time is at least ``UNFUSED_MIN_US``: an eager call of
# the pipeline costs the host 120-140 us (``_scaled_mm``'s block-scaled call, the activations'
# scales transposed for it, the pass; bench/results/swiglu_fp8-h200-quick.json, M = 128: 130 us
# eager against 62 us in graph replay at 7B, where the fused kernel's eager call took 70 us), so
# below that an eager caller would wait on the host for what graph replay gains.
FUSED_EFF = {"grouped": 0.74, "constant": 0.82}
SCALED_MM_FIT = 1.2
UNFUSED_MEASURED_M = 128
UNFUSED_MIN_US = 150.0
# cuBLASLt's block-scaled FP8 GEMM (1 x 128 activation groups, 128 x 128 weight blocks) reads both
# scale tensors outer-dim-major with 16-byte aligned columns: M and K/128 multiples of 4. On the
# H200 (torch 2.11) other M fail (CUBLAS_STATUS_NOT_SUPPORTED: 1, 2, 15, 17, 31, 127, 129, 333,
# 1025) and K/128 = 7 (Qwen2.5-0.5B, K = 896) runs but returns wrong sums; the unfused path takes
# block scales only where both hold.
UNFUSED_BLOCK_ALIGN = 4


def unfused_form(m: int, k: int, x_kind: str, w_kind: str) -> str | None:
    """How ``torch._scaled_mm`` takes the call's scales ("block", "row" or "tensor"), or None where
    it cannot: group / block scales on one side only, or block scales with M or K/128 not a
    multiple of :data:`UNFUSED_BLOCK_ALIGN`. ``x_kind`` / ``w_kind``: "k" (varies along K),
    "row" or "tensor" (``op._scale_kind``)."""
    if x_kind == "k" or w_kind == "k":
        aligned = m % UNFUSED_BLOCK_ALIGN == 0 and (k // GROUP) % UNFUSED_BLOCK_ALIGN == 0
        return "block" if x_kind == w_kind == "k" and aligned else None
    return "tensor" if x_kind == w_kind == "tensor" else "row"


def predict_us(variant: str, cfg, m: int, k: int, i: int, quant_out: bool, grouped: bool, chip) -> float:
    """Predicted graph-replay time (us) of ``x [m, k] x w [2i, k]`` e4m3 on ``chip``
    (``_dispatch.Chip``): ``variant`` "unfused", or a fused kernel with its tiles ``cfg``
    (:class:`WsConfig`: [128, block_n] output tiles; :class:`Fp8Config`); ``grouped``: either
    side's scales vary along K."""
    from tilefuse import _dispatch

    out_bytes = m * i * (1 if quant_out else 2)
    if variant == "unfused":
        gemm = _dispatch.gemm_us(chip, m, 2 * i, k, elem=1, out_elem=2) * SCALED_MM_FIT
        return gemm + SILU_MUL_LAUNCH_US + (4 * m * i + out_bytes) / chip.copy_bytes_per_us
    block_m = 128 if isinstance(cfg, WsConfig) else cfg.block_m
    fill = _dispatch.tile_fill(m, i, block_m, cfg.block_n, chip.sms)
    rate = chip.fp8_flop_per_us * fill * FUSED_EFF["grouped" if grouped else "constant"]
    compute = chip.ramp_us / 2 + 2.0 * m * 2 * i * k / rate
    return max(_dispatch.stream_us(chip, m * k + 2 * i * k + out_bytes), compute)


def unfused_wins(m: int, k: int, i: int, quant_out: bool, grouped: bool, fused_cfg, chip) -> tuple[bool, float, float]:
    """(run the unfused path, its predicted time, the fused kernel's) for one problem size."""
    from tilefuse import _dispatch

    fused = predict_us("fused", fused_cfg, m, k, i, quant_out, grouped, chip)
    unfused = predict_us("unfused", None, m, k, i, quant_out, grouped, chip)
    margin = (_dispatch.MARGIN_MEASURED_REGIME if m >= UNFUSED_MEASURED_M else _dispatch.MARGIN_UNMEASURED)
    return unfused * (1 + margin) < fused and fused >= UNFUSED_MIN_US, unfused, fused


def apply_overrides(entries: list[dict]) -> None:
    for entry in entries:
        cls = {"ws": WsConfig, "decode": DecodeConfig}.get(entry.get("variant"), Fp8Config)
        TUNED.setdefault(bool(entry["quant"]), {})[entry["M"]] = cls(**entry["config"])
    choose.cache_clear()


@functools.lru_cache(maxsize=4096)
def choose(m: int, k: int, i: int, quant_out: bool, num_sms: int = NUM_SMS_H200) -> Fp8Config | WsConfig:
    """The config for ``x [m, k] x w [2i, k]``; ``quant_out``: e4m3 output with 1 x 128 group scales
    (BLOCK_N = 128). Every scale layout runs the same tiles (two fp32 tiles, BLOCK_K = 128: the
    scale block and the promotion step). A :class:`WsConfig` means the Gluon kernel."""
    bucket = next((t for t in TUNED_M if m <= t), TUNED_M[-1])
    tuned = TUNED.get(quant_out, {}).get(bucket)
    if isinstance(tuned, DecodeConfig):      # the decode kernel's (op.py takes it through decode_config)
        tuned = None
    if isinstance(tuned, WsConfig) and -(-m // 128) * -(-i // tuned.block_n) < WS_MIN_SM_FRACTION * num_sms:
        tuned = None
    if tuned is not None:
        return tuned
    return heuristic(m, k, i, quant_out, num_sms)


def heuristic(m: int, k: int, i: int, quant_out: bool, num_sms: int = NUM_SMS_H200) -> Fp8Config:
    """Tiles from the register budget and the tile count (the module docstring)."""
    if quant_out:
        block_n = 128
    else:
        # 64 output columns (a 128-wide GEMM tile) unless 128 fill the SMs for at least two waves
        block_n = 128 if -(-m // 64) * -(-i // 128) >= 2 * num_sms else 64
    if block_n == 128:
        block_m = 64            # 64 x 256 GEMM tile: two fp32 tiles of 64 registers per thread
    else:
        block_m = 64 if m <= 64 else 128
    # Stages: 4 while the ring (x box + the gate|up box, e4m3) stays within ~160 KB of SMEM.
    stage_bytes = block_m * 128 + 2 * block_n * 128
    num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    return Fp8Config(block_m, block_n, 128, num_stages=num_stages)


apply_overrides(_env.settings.configs.get("swiglu_fp8", []))
