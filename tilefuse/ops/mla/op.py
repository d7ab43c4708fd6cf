"""``tilefuse.get_mla_metadata`` and ``tilefuse.flash_mla_with_kvcache``: FlashMLA's API.

Kernels live in ``kernels.py``, the spec in ``reference.py``.

Metadata format (ours, not FlashMLA's bytes; the two functions only need to agree):

* ``tile_scheduler_metadata``: int32 ``[num_sm_parts + 2 b, 8]``. Rows ``0 .. num_sm_parts + b - 1``
  are *slots* (each run by ``slot_programs`` programs of the attention kernel): ``(request,
  first page, end page, splits of that request, its length, its first slot, 0, 0)``; request
  ``-1`` marks an unused slot. The pages are cut into chunks of at most ``chunk`` pages (split
  evenly inside each request), ``chunk`` the smallest with at most ``num_sm_parts`` busy slots
  -- one wave on the GPU whatever the mix of lengths, and the shortest longest slot -- and
  ``num_sm_parts + b`` bounds the slot count (a static shape: no host sync). The last ``b`` rows
  are the fused combine's arrival counters, one per (request, head tile), zeroed by the metadata
  kernel and reset by the slot that combines, so one metadata serves every layer of a step;
  calls sharing one metadata must not run concurrently on different streams.
* ``num_splits``: int32 ``[b + 1]``, cumulative: request ``i`` owns slots
  ``num_splits[i] .. num_splits[i + 1] - 1`` (FlashMLA's meaning).

Dispatch (``choose_variant``): from 64 query rows the standard kernel with 64-row head tiles;
17-63 rows the transposed (ETAP) one; <= 16 rows ``SMALL_ROWS_VARIANT`` per context regime,
judged by the block table's width (a shape: graph-safe, no host sync); both regimes measure
best with the unpadded standard kernel today. ``tilefuse.force(variant="transposed" | "standard")``
pins one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from tilefuse import _checks
from tilefuse._backend import choose_backend, forced_variant, interpreting, num_sms
from tilefuse._library import tilefuse_op
from tilefuse.ops.mla.reference import PAGE_SIZE, mla_decode_reference

HEAD_DIM = 576
HEAD_DIM_V = 512
VARIANTS = ("transposed", "standard")
# Launch settings (H200 sweeps in bench/results/mla-sweep{3,4}-h200.txt, graph replay):
# * "transposed": s_q * h_q < 64 rows, BLOCK_H = next_pow2(rows) (16 or 32). BLOCK_N = 64 (one
#   page, M = 64 for WGMMA), 2 stages: 168 KB SMEM, one program per SM.
# * "standard": >= 64 rows, 64-row head tiles (WGMMA M = 64), [64, 512] fp32 accumulator over
#   8 warps; 221 KB SMEM (Q + 2 K stages). BLOCK_N = 32 with 3-4 stages measured 12 % slower.
# * "standard_small": the standard orientation below 64 rows; BLOCK_H 0 = next_pow2(rows)
#   (mma.sync, no padding), BLOCK_N = 32, 3 stages: 93 KB SMEM, two programs per SM.
# slot_programs: programs per metadata slot (each takes an equal part of the slot's pages). The
#   metadata has one busy slot per SM (per head tile) whatever the kernel, so both orientations
#   run on the same metadata; 2 = two programs per SM for a config that fits twice in SMEM.
# fused_combine: the last program of a request merges the partials, else a second launch does.
# "<key>:long" / "<key>:short" entries, where present, override "<key>" in that regime.
# Sweep 4 (both regimes alike): the second-launch combine is 2-27 % faster than the fused one
# for both kernels below 64 rows (the fused merge is a serial tail in one program), 3 % slower
# to 1.5 % faster at 128 heads (kept fused); 16 warps at 128 heads: 2x slower.
CONFIGS = {
    "transposed": dict(BLOCK_N=64, num_warps=4, num_stages=2, slot_programs=1, fused_combine=False),
    "standard": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, slot_programs=1, fused_combine=True),
    "standard_small": dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=3, slot_programs=2, fused_combine=False),
}
# Orientation at <= 16 query rows, per regime. The regime comes from a shape, so it costs no host
# sync and is fixed in a CUDA graph: "long" when the block table holds >= LONG_CONTEXT_PAGES pages
# per request (its capacity, an upper bound on the context). With the fused combine and the old
# schedule (mla-h200.json) the unpadded standard kernel (two programs per SM) was 0-18 % faster
# at 16K-64K and the transposed one 2-24 % faster at 1K-4K (batch 16-32): "long" -> standard.
# With the second-launch combine and the tight schedule (sweep4, mla-h200-h16s1.json) standard is
# 0-18 % faster in both regimes except b16 x 1K (9 % slower): standard in both. At 17-63 rows the
# transposed kernel wins everywhere (25-43 %, mla-h200.json).
LONG_CONTEXT_PAGES = 256
SMALL_ROWS_VARIANT = {"short": "standard", "long": "standard"}
if os.environ.get("TILEFUSE_MLA_CONFIGS"):   # tuning hook: a JSON file {key: config} from the sweep
    _tuned = json.loads(Path(os.environ["TILEFUSE_MLA_CONFIGS"]).read_text())
    SMALL_ROWS_VARIANT.update(_tuned.pop("small_rows_variant", {}))
    CONFIGS.update(_tuned)


def regime(max_blocks: int) -> str:
    """"long" if the block table has room for >= LONG_CONTEXT_PAGES pages per request, else "short"."""
    return "long" if max_blocks >= LONG_CONTEXT_PAGES else "short"


def config_for(variant: str, rows: int, context: str = "short") -> dict:
    """The launch settings a variant uses at ``rows = s_q * h_q`` query rows in a regime."""
    key = "standard_small" if variant == "standard" and rows < 64 else variant
    return CONFIGS.get(f"{key}:{context}", CONFIGS[key])


def kernel_status(device: torch.device) -> dict[str, str]:
    """Which MLA kernel variants run on ``device`` ("ok" or why not)."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        why = "ok" if major >= 8 else f"needs sm_80+ (tl.dot on bf16), got sm_{major}x"
    elif interpreting():
        why = "ok (Triton interpreter)"
    else:
        why = "CPU: reference path (set TRITON_INTERPRET=1 to interpret the kernels)"
    return {v: why for v in VARIANTS}


def choose_variant(rows: int, max_blocks: int = 1) -> str:
    """Standard (64-row head tiles) from 64 query rows; below, transposed (ETAP), except at <= 16
    rows where SMALL_ROWS_VARIANT picks per regime (block tables of >= LONG_CONTEXT_PAGES pages)."""
    if forced_variant() in VARIANTS:
        return forced_variant()
    if rows >= 64:
        return "standard"
    return SMALL_ROWS_VARIANT[regime(max_blocks)] if rows <= 16 else "transposed"


def default_num_sm_parts(device: torch.device, num_q_tokens_per_head_k: int) -> int:
    """Target busy slots: the SMs shared among the 64-row head tiles (kernels may run several
    programs per slot, see ``slot_programs``)."""
    return max(1, num_sms(device) // max(1, math.ceil(num_q_tokens_per_head_k / 64)))


# ---------------------------------------------------------------------------------- metadata


def _metadata_torch(cache_seqlens: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata kernel's algorithm in PyTorch (the reference backend; no host sync either)."""
    batch, dev = cache_seqlens.shape[0], cache_seqlens.device
    lens = cache_seqlens.long()
    pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE
    room = max(num_parts - batch, 1)
    total = pages.sum()
    hi = ((total + room - 1) // room).clamp_min(1)
    lo = ((total + num_parts - 1) // num_parts).clamp_min(1).minimum(hi)
    for _ in range(40):      # the kernel's bisection, a fixed number of steps (no host sync)
        mid = (lo + hi) // 2
        fits = ((pages + mid - 1) // mid).clamp_min(1).sum() <= num_parts
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid + 1)
    chunk = hi
    splits = ((pages + chunk - 1) // chunk).clamp_min(1)
    per = (pages + splits - 1) // splits
    cu = torch.zeros(batch + 1, dtype=torch.long, device=dev)
    cu[1:] = splits.cumsum(0)
    slot = torch.arange(num_parts + batch, device=dev)
    req = torch.searchsorted(cu[1:], slot, right=True)
    valid = req < batch
    r = req.clamp_max(batch - 1)
    begin = torch.minimum((slot - cu[r]) * per[r], pages[r])
    end = torch.minimum(begin + per[r], pages[r])
    zero = torch.zeros_like(slot)
    rows = torch.stack([torch.where(valid, r, -1), begin * valid, end * valid, splits[r] * valid, lens[r] * valid,
                        cu[r] * valid, zero, zero], 1)
    meta = torch.cat([rows, torch.zeros(batch, 8, dtype=torch.long, device=dev)])
    return meta.to(torch.int32), cu.to(torch.int32)


def _metadata_fake(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts):
    batch = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty(num_sm_parts + 2 * batch, 8), cache_seqlens.new_empty(batch + 1))


@tilefuse_op("get_mla_metadata", fake=_metadata_fake)
def _get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                      num_sm_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    if choose_backend(cache_seqlens.device) != "triton":
        return _metadata_torch(cache_seqlens, num_sm_parts)
    import triton

    from tilefuse.ops.mla.kernels import mla_metadata_kernel

    batch = cache_seqlens.shape[0]
    num_slots = num_sm_parts + batch
    meta = torch.empty(num_slots + batch, 8, dtype=torch.int32, device=cache_seqlens.device)
    num_splits = torch.empty(batch + 1, dtype=torch.int32, device=cache_seqlens.device)
    block_b = max(16, triton.next_power_of_2(batch))
    block_p = max(16, min(256, 8192 // block_b))
    mla_metadata_kernel[(1,)](cache_seqlens, meta, num_splits, batch, num_sm_parts, num_slots,
                              BLOCK_B=block_b, BLOCK_P=block_p, num_warps=4)
    return meta, num_splits


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_sm_parts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV schedule for :func:`flash_mla_with_kvcache`, computed on the device (no host sync).

    Parameters
    ----------
    cache_seqlens : [b] int32, the requests' cache lengths (on the device that runs attention).
    num_q_tokens_per_head_k : s_q * h_q // h_kv, the query rows of one request.
    num_heads_k : h_kv (1 for MLA).
    num_sm_parts : chunks to cut the batch's pages into; default: the SM count divided by the
        number of 64-row head tiles.

    Returns
    -------
    tile_scheduler_metadata : [num_sm_parts + 2 b, 8] int32 (format in this module's docstring).
    num_splits : [b + 1] int32, cumulative split counts.

    The shapes depend on ``b`` and the SM count only, so a decode step that calls this then
    :func:`flash_mla_with_kvcache` can be captured in a CUDA graph and replayed with new lengths.
    """
    _checks.check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    if num_heads_k != 1:
        raise ValueError(f"num_heads_k: expected 1 (MLA has one latent KV head), got {num_heads_k}")
    if num_q_tokens_per_head_k < 1:
        raise ValueError(f"num_q_tokens_per_head_k: expected >= 1, got {num_q_tokens_per_head_k}")
    if cache_seqlens.shape[0] > 8192:
        raise ValueError(f"cache_seqlens: expected at most 8192 requests, got {cache_seqlens.shape[0]}")
    parts = num_sm_parts or default_num_sm_parts(cache_seqlens.device, num_q_tokens_per_head_k)
    return _get_mla_metadata(cache_seqlens.contiguous(), int(num_q_tokens_per_head_k), int(num_heads_k), int(parts))


# ---------------------------------------------------------------------------------- attention


def _launch(q, k_cache, block_table, cache_seqlens, meta, num_splits, scale, causal, variant):
    import triton

    from tilefuse.ops.mla import kernels

    batch, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    cfg = dict(config_for(variant, rows, regime(block_table.shape[1])))
    fused = cfg.pop("fused_combine", True)
    per_slot = cfg.pop("slot_programs", 1)
    block_h = cfg.pop("BLOCK_H", 0) or max(16, triton.next_power_of_2(min(rows, 64)))
    if variant == "transposed":
        block_h = max(16, triton.next_power_of_2(min(rows, 64)))
    if block_h > 16:
        cfg["num_warps"] = max(cfg["num_warps"], 8)   # [32+, 512] fp32 accumulator: 8 warps avoid spills
    num_slots = meta.shape[0] - batch           # the last b rows are the combine's counters
    out = torch.empty(batch, s_q, h_q, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
    # Partials of split requests: normalised outputs and their lse, one row per (program, query row).
    o_acc = torch.empty(num_slots * per_slot, rows, HEAD_DIM_V, dtype=torch.float32, device=q.device)
    lse_acc = torch.empty(num_slots * per_slot, rows, dtype=torch.float32, device=q.device)
    kernel = kernels.mla_split_transposed_kernel if variant == "transposed" else kernels.mla_split_standard_kernel
    grid = (num_slots * per_slot, triton.cdiv(rows, block_h))
    kernel[grid](
        q, k_cache, block_table, meta, out, lse, o_acc, lse_acc,
        h_q, s_q, rows, num_slots, block_table.shape[1] * PAGE_SIZE, scale * kernels.LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        CAUSAL=causal, BLOCK_H=block_h, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_COMBINE=fused, SLOT_PROGRAMS=per_slot, **cfg,
    )
    if not fused:
        kernels.mla_combine_kernel[(batch, rows)](
            num_splits, o_acc, lse_acc, out, lse, h_q, rows,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), S_CHUNK=8,
            SLOT_PROGRAMS=per_slot, num_warps=4,
        )
    return out, lse


def _flash_mla_fake(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal):
    batch, s_q, h_q, _ = q.shape
    return (q.new_empty(batch, s_q, h_q, head_dim_v), q.new_empty(batch, h_q, s_q, dtype=torch.float32))


@tilefuse_op("flash_mla_with_kvcache", fake=_flash_mla_fake)
def _flash_mla(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               head_dim_v: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
               softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if choose_backend(q.device) != "triton":
        return mla_decode_reference(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
    variant = choose_variant(q.shape[1] * q.shape[2], block_table.shape[1])
    return _launch(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                   softmax_scale, causal, variant)


def _check_lengths(cache_seqlens: torch.Tensor, max_blocks: int) -> None:
    """Lengths within the block table; reads the lengths (a host sync), so skipped while capturing."""
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if cache_seqlens.numel():
        lo, hi = torch.aminmax(cache_seqlens)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi > max_blocks * PAGE_SIZE:
            raise ValueError(f"cache_seqlens: expected lengths in [0, {max_blocks * PAGE_SIZE}] "
                             f"(block_table has {max_blocks} pages of {PAGE_SIZE}), got [{lo}, {hi}]")


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None,
                           causal: bool = False, *, check_lengths: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache (FlashMLA's signature).

    Parameters
    ----------
    q : [b, s_q, h_q, 576] bf16 or fp16 (fp32 accepted for testing). s_q query tokens per request
        (multi-token prediction / speculative decoding), h_q from 1 to 128.
    k_cache : [num_blocks, 64, 1, 576], q's dtype, contiguous. Pages of 64 tokens; V is the first
        ``head_dim_v`` values of each 576-wide latent vector.
    block_table : [b, max_blocks] int32: request i's token t is in page ``block_table[i, t // 64]``.
    cache_seqlens : [b] int32, each in [0, 64 * max_blocks]. Slots past a length are never read.
    head_dim_v : 512.
    tile_scheduler_metadata, num_splits : from :func:`get_mla_metadata` on the same ``cache_seqlens``.
    softmax_scale : default ``576 ** -0.5``.
    causal : query token t of s_q sees keys ``0 .. L - s_q + t``; else all L keys.
    check_lengths : check the lengths against the block table (reads them back: a host sync;
        skipped during CUDA-graph capture).

    Returns
    -------
    out : [b, s_q, h_q, 512] in q's dtype (0 for a row with no visible key).
    softmax_lse : [b, h_q, s_q] fp32, natural log (+inf for a row with no visible key).
    """
    _checks.check_tensor("q", q, dtypes=(*_checks.FLOAT16S, torch.float32), ndim=4)
    _checks.check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    _checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    _checks.check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    batch, s_q, h_q, head_dim = q.shape
    if head_dim != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM} (512 latent + 64 RoPE), got {head_dim}")
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v: expected {HEAD_DIM_V}, got {head_dim_v}")
    _checks.check_shape("k_cache", k_cache, (None, PAGE_SIZE, 1, HEAD_DIM), f"[num_blocks, {PAGE_SIZE}, 1, {HEAD_DIM}]")
    _checks.check_shape("block_table", block_table, (batch, None), f"[b={batch}, max_blocks]")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one page per request, got shape {tuple(block_table.shape)}")
    _checks.check_shape("cache_seqlens", cache_seqlens, (batch,), f"[b={batch}]")
    _checks.check_tensor("tile_scheduler_metadata", tile_scheduler_metadata, dtypes=(torch.int32,), ndim=2)
    _checks.check_shape("tile_scheduler_metadata", tile_scheduler_metadata, (None, 8), "[num_sm_parts + 2 b, 8]")
    if tile_scheduler_metadata.shape[0] <= 2 * batch:
        raise ValueError(f"tile_scheduler_metadata: expected more than 2 b = {2 * batch} rows (from get_mla_metadata "
                         f"on the same batch), got {tile_scheduler_metadata.shape[0]}")
    _checks.check_tensor("num_splits", num_splits, dtypes=(torch.int32,), ndim=1)
    _checks.check_shape("num_splits", num_splits, (batch + 1,), f"[b + 1 = {batch + 1}]")
    if h_q < 1 or h_q > 128 or s_q < 1 or s_q * h_q > 512:
        raise ValueError(f"q: expected 1 <= h_q <= 128, s_q >= 1 and s_q * h_q <= 512, got h_q={h_q}, s_q={s_q}")
    _checks.check_same_device(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                              tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    _checks.check_contiguous("k_cache", k_cache)
    _checks.check_contiguous("q", q, last_dim_only=True)
    _checks.check_contiguous("block_table", block_table, last_dim_only=True)
    if check_lengths and not torch.compiler.is_compiling():
        _check_lengths(cache_seqlens, block_table.shape[1])
    scale = float(softmax_scale) if softmax_scale is not None else HEAD_DIM ** -0.5
    return _flash_mla(q, k_cache, block_table, cache_seqlens.contiguous(), int(head_dim_v),
                      tile_scheduler_metadata, num_splits, scale, bool(causal))
