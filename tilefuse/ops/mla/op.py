"""``tilefuse.get_mla_metadata`` and ``tilefuse.flash_mla_with_kvcache``: FlashMLA's API.

Kernels live in ``kernels.py``, launch settings and the dispatch rule in ``configs.py``, the spec
in ``reference.py``.

Metadata format (ours, not FlashMLA's bytes; the two functions only need to agree):

* ``tile_scheduler_metadata``: int32 ``[SLOT_WAVES * num_sm_parts + b, 8]``
  (:func:`metadata_slots`), one row per *slot*, a split of one request:
  ``(request, split index, first page, end page, 0, 0, 0, run start)``; request ``-1`` marks an
  unused slot. One of two schedules, picked per batch by a cost model (``configs.PART_GAIN``):
  *slots*, every request cut in even splits of the chunk that minimizes the expected busiest SM
  (``configs.schedule_cost``), one program per split, handed to SMs as they free; or *parts*
  (FlashMLA's), the batch's work (pages plus ``configs.PART_SPLIT_COST_PAGES`` per request) cut
  into ``num_sm_parts`` equal parts, each a run of whole short requests and pieces of long ones.
  Column 7: the Gluon kernel's program ``p`` runs slots ``meta[p, 7] .. meta[p + 1, 7] - 1`` (one
  slot, or a part's run); the ``tl`` kernels run one program per slot either way. The row count is
  a static shape (no host sync).
* ``num_splits``: int32 ``[b + 1]``, cumulative: request ``i`` owns slots
  ``num_splits[i] .. num_splits[i + 1] - 1`` (FlashMLA's meaning).

The metadata only schedules. Both backends take every length from ``cache_seqlens``; the kernels
clamp each split's planned pages to it (split 0 from page 0, the last split to the last page), so
metadata planned for other lengths (same batch) costs balance, never correctness, and one metadata
serves every layer of a step and any number of concurrent streams (it is never written by the attention kernels: the fused combine's arrival
counters live in zeroed scratch, ``tilefuse._scratch``). No contents of the metadata,
``num_splits``, ``block_table`` or ``cache_seqlens`` can move a kernel access outside its tensor
(each index is checked or clamped); ``check_contents=True`` or ``TILEFUSE_DEBUG=1`` raises a
``ValueError`` for contents that are out of range or disagree with the lengths (a host sync).
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from tilefuse import _checks, _dispatch, _env, _launch, _scratch
from tilefuse._backend import VARIANTS as _FAMILY_VARIANTS
from tilefuse._backend import check_interpretable, choose_backend, forced_variant, gluon_hopper, num_sms, tl_status
from tilefuse._library import PlanCache, no_backward, plan_key, tilefuse_op, use_dispatcher
from tilefuse.ops.mla import configs
from tilefuse.ops.mla.reference import (FP8_GROUP, FP8_KV_BYTES, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE,
                                        check_block_table, check_page_shape, mla_decode_reference,
                                        mla_sparse_decode_reference)

VARIANTS = _FAMILY_VARIANTS["mla"]
MAX_BATCH = 8192          # the metadata kernel holds the batch's lengths in one program


def kernel_status(device: torch.device) -> dict[str, str]:
    """Which MLA kernel variants run on ``device`` ("ok" or why not)."""
    why = tl_status(device, 8, "tl.dot on bf16")
    status = {v: why for v in VARIANTS}
    for variant in configs.GLUON_VARIANTS:
        status[variant] = ("ok" if wgmma_usable(device) else
                           "needs a Hopper GPU (sm_90: TMA, WGMMA) and Gluon; the tl kernels run instead")
    return status


def wgmma_usable(device: torch.device) -> bool:
    """The Gluon kernel runs here: a Hopper GPU (TMA, WGMMA) and an importable Gluon."""
    return gluon_hopper(device) and _kernels().get("wgmma") is not None


def choose_variant(rows: int, max_blocks: int = 1, q: torch.Tensor | None = None) -> str:
    """The kernel for ``rows = s_q * h_q`` query rows: the one pinned by ``force()``, else
    ``configs.default_variant``. ``wgmma`` (pinned or default) needs a 16-bit ``q`` on a Hopper
    GPU; elsewhere the ``tl`` kernel of the same orientation (``standard``) runs. Every page size
    of ``PAGE_SIZES`` runs on each."""
    fits = q is not None and _wgmma_fits(q)
    variant = forced_variant("mla") or configs.default_variant(rows, max_blocks, fits, _chip_ridge(q))
    return "standard" if variant in configs.GLUON_VARIANTS and not fits else variant


def _chip_ridge(q: torch.Tensor | None) -> float | None:
    """``configs.ridge`` of q's GPU (None off a GPU: the dispatch's default chip)."""
    return configs.ridge(_device_name(q.device)) if q is not None and q.device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _sparse_gluon_fits(q: torch.Tensor, caches, indices) -> bool:
    """The sparse decode of ``q`` over ``caches`` takes the Gluon gather kernel: FP8 caches whose
    rows start at 16-byte boundaries (its cp.async copies 16 bytes at a time), int32 ``indices``
    (FlashMLA's, the ones its GPU tests cover; int64 lists take the tl kernel), a bf16 q, a Hopper
    GPU with Gluon, and no ``force(variant="standard" | "transposed")`` (which pins the tl kernels,
    here the tl gather kernel)."""
    return (_sparse_gluon_runs(q.device, q.dtype) and all(idx.dtype == torch.int32 for idx in indices)
            and all(cache.shape[-1] == FP8_KV_BYTES and cache.data_ptr() % 16 == 0 for cache in caches)
            and forced_variant("mla") not in ("standard", "transposed"))


@functools.lru_cache(maxsize=None)
def _sparse_gluon_runs(device: torch.device, dtype: torch.dtype) -> bool:
    # bf16 q only: an fp16 q takes the tl kernel, which keeps the FP8 cache's values (up to
    # 448 x scale, bf16 RoPE) out of fp16 where they could overflow it
    return (dtype == torch.bfloat16 and gluon_hopper(device)
            and _kernels().get("sparse_gluon") is not None)


def _wgmma_fits(q: torch.Tensor) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16) and wgmma_usable(q.device)


def default_num_sm_parts(device: torch.device, num_q_tokens_per_head_k: int) -> int:
    """Target busy slots: the SMs shared among the 64-row head tiles (kernels may run several
    programs per slot, see ``slot_programs``)."""
    return max(1, num_sms(device) // max(1, math.ceil(num_q_tokens_per_head_k / 64)))


@functools.cache
def _kernels():
    from tilefuse.ops.mla import kernels

    # None under a Triton without Gluon's Hopper module: the tl kernels serve
    wgmma = _launch.optional_kernel("tilefuse.ops.mla.kernels_gluon", "mla_split_ws_kernel")
    return dict(metadata=_launch.Kernel(kernels.mla_metadata_kernel),
                sparse=_launch.Kernel(kernels.mla_sparse_split_kernel),
                sparse_gluon=_launch.optional_kernel("tilefuse.ops.mla.kernels_gluon_sparse",
                                                     "mla_sparse_gluon_kernel"),
                sparse_combine=_launch.Kernel(kernels.mla_sparse_combine_kernel),
                sparse_gather=_launch.Kernel(kernels.mla_sparse_gather_kernel),
                standard=_launch.Kernel(kernels.mla_split_standard_kernel),
                transposed=_launch.Kernel(kernels.mla_split_transposed_kernel),
                wgmma=wgmma,
                wgmma_fp8=_launch.optional_kernel("tilefuse.ops.mla.kernels_gluon_fp8", "mla_split_fp8_kernel"),
                wgmma_fp8_wide=_launch.optional_kernel("tilefuse.ops.mla.kernels_gluon_fp8_wide",
                                                       "mla_split_fp8_wide_kernel"),
                wgmma_t=_launch.optional_kernel("tilefuse.ops.mla.kernels_gluon_t", "mla_split_t_kernel"),
                combine=_launch.Kernel(kernels.mla_combine_kernel))


# ---------------------------------------------------------------------------------- metadata


def metadata_slots(num_parts: int, batch: int) -> int:
    """Rows of the metadata (slots) for ``batch`` requests over ``num_parts`` parts: a static shape."""
    return configs.SLOT_WAVES * num_parts + batch


def metadata_parts(num_slots: int, batch: int) -> int:
    """The parts a metadata of ``num_slots`` rows for ``batch`` requests was made for
    (:func:`metadata_slots`' inverse)."""
    return (num_slots - batch) // configs.SLOT_WAVES


def _metadata_torch(cache_seqlens: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata kernel's schedule in PyTorch (the reference backend; no host sync either)."""
    batch, dev = cache_seqlens.shape[0], cache_seqlens.device
    num_slots = metadata_slots(num_parts, batch)
    pages = (cache_seqlens.long().clamp_min(0) + PAGE_SIZE - 1) // PAGE_SIZE
    split_cost = configs.SPLIT_COST_PAGES

    # ---- slots: even splits of the chunk that minimizes the expected busiest part
    def slots(chunk):
        return ((pages + chunk - 1) // chunk).clamp_min(1).sum()

    def cost2(n_slots, chunk):      # the kernel's _schedule_cost2
        longest = chunk + split_cost
        spread = (2 * (total + split_cost * n_slots) + num_parts - 1) // num_parts + longest
        return torch.where(n_slots <= num_parts, 2 * longest, torch.maximum(2 * longest, spread))

    room = max(num_parts - batch, 1)
    total = pages.sum()
    hi = ((total + room - 1) // room).clamp_min(1)
    lo = ((total + num_parts - 1) // num_parts).clamp_min(1).minimum(hi)
    balanced = lo
    for _ in range(40):      # the kernel's bisection, a fixed number of steps (no host sync)
        mid = (lo + hi) // 2
        fits = slots(mid) <= num_parts
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid + 1)
    chunk = hi
    best = cost2(slots(chunk), chunk)
    for k in range(configs.SCHEDULE_CANDIDATES):
        cand = ((balanced * (3 - k % 2)) >> (k // 2 + 1)).clamp_min(1)
        n_slots = slots(cand)
        cost = cost2(n_slots, cand)
        better = (cost < best) & (n_slots < num_slots)
        chunk, best = torch.where(better, cand, chunk), torch.where(better, cost, best)
    # ---- parts: the work line cut into equal parts
    part_cost = configs.PART_SPLIT_COST_PAGES
    e = (pages + part_cost).cumsum(0)
    a = e - pages
    line = (pages + part_cost).sum().clamp_min(1)
    parts = line.clamp_max(num_parts)

    def cut(p):
        return p * line // parts

    cut_lo = ((a + 1) * parts + line - 1) // line
    cut_hi = (e * parts + line - 1) // line
    parts_cost2 = 2 * ((line + parts - 1) // parts + part_cost)
    use_parts = (best >= 2 * configs.PART_MIN_PAGES) & (parts_cost2 * 100 <= best * round(configs.PART_GAIN * 100))
    splits = torch.where(use_parts, 1 + (cut_hi - cut_lo).clamp_min(0), ((pages + chunk - 1) // chunk).clamp_min(1))
    cu = torch.zeros(batch + 1, dtype=torch.long, device=dev)
    cu[1:] = splits.cumsum(0)
    used = cu[-1]
    meta = torch.zeros(num_slots, 8, dtype=torch.long, device=dev)
    slot = torch.arange(num_slots, device=dev)
    if batch:
        req = torch.searchsorted(cu[1:], slot, right=True).clamp_max(batch - 1)
        valid = slot < used
        k = slot - cu[req]
        n = splits[req]
        per = (pages[req] + n - 1) // n
        begin = torch.where(use_parts, torch.where(k == 0, 0, cut(cut_lo[req] + k - 1) - a[req]),
                            (k * per).minimum(pages[req]))
        end = torch.where(use_parts, torch.where(k == n - 1, e[req], cut(cut_lo[req] + k)) - a[req],
                          (k * per + per).minimum(pages[req]))
        meta[:, 0] = torch.where(valid, req, -1)
        meta[:, 1:4] = torch.stack([k, begin, end], 1) * valid[:, None]
        # part p's first slot: the split that begins at its cut, or the first split of the
        # request whose fixed cost the cut falls in
        inside = torch.searchsorted(e, cut(slot), right=True).clamp_max(batch - 1)
        first = cu[inside] + torch.where(cut(slot) > a[inside], slot - cut_lo[inside] + 1, 0)
    else:
        meta[:, 0] = -1
        first = torch.zeros_like(slot)
    meta[:, 7] = torch.where(use_parts, torch.where(slot < parts, first, used), slot.minimum(used))
    return meta.to(torch.int32), cu.to(torch.int32)


def metadata_constexprs(block_b: int, block_p: int) -> dict:
    """The metadata kernel's constexprs: its blocks and the schedules' settings from ``configs``."""
    return dict(BLOCK_B=block_b, BLOCK_P=block_p, SPLIT_COST=configs.SPLIT_COST_PAGES,
                CANDIDATES=configs.SCHEDULE_CANDIDATES, PART_COST=configs.PART_SPLIT_COST_PAGES,
                PART_MIN2=2 * configs.PART_MIN_PAGES, PART_GAIN_PCT=round(configs.PART_GAIN * 100))


def _metadata_fake(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts):
    batch = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty(metadata_slots(num_sm_parts, batch), 8), cache_seqlens.new_empty(batch + 1))


def _get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                      num_sm_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = cache_seqlens.shape[0]
    if batch == 0 or choose_backend(cache_seqlens.device) != "triton":
        return _metadata_torch(cache_seqlens, num_sm_parts)
    num_slots = metadata_slots(num_sm_parts, batch)
    meta = torch.empty(num_slots, 8, dtype=torch.int32, device=cache_seqlens.device)
    num_splits = torch.empty(batch + 1, dtype=torch.int32, device=cache_seqlens.device)
    starts = torch.empty(batch, dtype=torch.int32, device=cache_seqlens.device)    # the kernel's scratch
    block_b = max(16, 1 << (batch - 1).bit_length())
    block_p = max(16, min(1024, 1 << (num_slots - 1).bit_length()))
    constexprs = metadata_constexprs(block_b, block_p)
    _kernels()["metadata"].launch((cache_seqlens.device, batch, num_sm_parts, cache_seqlens.data_ptr() % 16,
                                   *constexprs.values()),
                                  (1, 1, 1), cache_seqlens.device.index,
                                  (cache_seqlens, meta, num_splits, starts), (batch, num_sm_parts, num_slots),
                                  dict(constexprs, num_warps=4))
    return meta, num_splits


_get_mla_metadata_op = tilefuse_op("get_mla_metadata", fake=_metadata_fake)(_get_mla_metadata)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_sm_parts: int | None = None, *, check_contents: bool | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV schedule for :func:`flash_mla_with_kvcache`, computed on the device (no host sync).

    Parameters
    ----------
    cache_seqlens : [b] int32, the requests' cache lengths (on the device that runs attention),
        b <= 8192.
    num_q_tokens_per_head_k : s_q * h_q // h_kv, the query rows of one request (>= 1).
    num_heads_k : h_kv (1 for MLA).
    num_sm_parts : parts of equal work to cut the batch into (>= 1; the Gluon kernel runs one
        program per part and head tile); default: the SM count divided by the number of 64-row
        head tiles.
    check_contents : check that the lengths are >= 0 (reads them: a host sync); default
        ``TILEFUSE_DEBUG``. Skipped while ``torch.compile`` traces and for meta / fake tensors.

    Returns
    -------
    tile_scheduler_metadata : [SLOT_WAVES * num_sm_parts + b, 8] int32 (format in this module's
        docstring).
    num_splits : [b + 1] int32, cumulative split counts.

    The shapes depend on ``b`` and the SM count only, so a decode step that calls this then
    :func:`flash_mla_with_kvcache` can be captured in a CUDA graph and replayed with new lengths.
    """
    _checks.check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    if not isinstance(num_heads_k, int) or isinstance(num_heads_k, bool) or num_heads_k != 1:
        raise ValueError(f"num_heads_k: expected 1 (MLA has one latent KV head), got {num_heads_k!r}")
    _check_int("num_q_tokens_per_head_k", num_q_tokens_per_head_k, 1)
    if cache_seqlens.shape[0] > MAX_BATCH:
        raise ValueError(f"cache_seqlens: expected at most {MAX_BATCH} requests, got {cache_seqlens.shape[0]}")
    if num_sm_parts is None:
        num_sm_parts = default_num_sm_parts(cache_seqlens.device, num_q_tokens_per_head_k)
    _check_int("num_sm_parts", num_sm_parts, 1)
    no_data = _checks.contents_unreadable(cache_seqlens)
    if (_env.settings.debug if check_contents is None else check_contents) and not no_data:
        _check_lengths(cache_seqlens, None)
    if not cache_seqlens.is_contiguous():
        cache_seqlens = cache_seqlens.contiguous()
    if no_data:
        return _get_mla_metadata_op(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts)
    return _get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts)


# ---------------------------------------------------------------------------------- attention


class _Call:
    """What an attention call with one argument layout runs, worked out once (validation
    included): the backend, the output shapes, the kernel, its grid, scratch sizes, scalar
    arguments and constexprs, and the combine launch. Identity-hashed: it is the launch's plan
    key (with the pointers' alignment)."""

    __slots__ = ("reference", "scale", "causal", "variant", "grid", "out_shape", "lse_shape", "partials",
                 "counters", "scalars", "meta", "combine_grid", "combine_scalars", "combine_meta", "fallback")


def _attention_call(q, k_cache, block_table, meta, scale: float, causal: bool, variant: str | None = None) -> _Call:
    batch, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    max_blocks = block_table.shape[1]
    page = k_cache.shape[1]
    fp8 = k_cache.shape[-1] == FP8_KV_BYTES
    call = _Call()
    call.variant = variant or choose_variant(rows, max_blocks, q)
    if fp8:
        call.variant = _fp8_variant(call.variant, rows, max_blocks, q)
    call.variant = _gluon_form(call.variant, rows, fp8)
    # a cache view that TMA cannot address (base not 16-byte aligned), or a q whose rows the
    # Gluon kernels' 16-byte copies cannot address (strides not multiples of 8 elements, base not
    # 16-byte aligned), takes the tl kernel
    gluon = call.variant in _GLUON
    if gluon and any(stride % 8 for stride in q.stride()[:3]):
        call.variant, gluon = "standard", False
    call.fallback = _attention_call(q, k_cache, block_table, meta, scale, causal, "standard") if gluon else None
    cfg, fused, per_slot, _ = configs.launch_config(call.variant, rows, max_blocks, q.element_size())
    num_slots = meta.shape[0]
    call.out_shape, call.lse_shape = (batch, s_q, h_q, HEAD_DIM_V), (batch, h_q, s_q)
    # Partials of split requests (normalised outputs and their lse, one row per (program, query
    # row)), written before they are read: per-stream workspace.
    partials = num_slots * per_slot * rows
    call.partials = ((partials * HEAD_DIM_V, torch.float32), (partials, torch.float32))
    # the fused combine's arrival counters: one per (request, head tile), zeroed scratch (the Gluon
    # kernel's: requests of up to FUSED_SPLITS splits; PDL: the combine, and at 2 the split kernel,
    # as programmatic dependent launches)
    fused_splits = cfg.get("FUSED_SPLITS", 0) if call.variant == "wgmma" else 0
    pdl = cfg.get("PDL", 0) if call.variant in ("wgmma", "wgmma_fp8_wide") else 0
    call.counters = (batch * 8, torch.int32) if fused or fused_splits else None
    out_strides = (s_q * h_q * HEAD_DIM_V, h_q * HEAD_DIM_V, HEAD_DIM_V)     # out, lse: fresh, contiguous
    lse_strides = (h_q * s_q, s_q)
    if gluon:
        # one program per (head tile, run of slots in column 7), head tiles fastest (kernels_gluon):
        # 64-row tiles, the FP8 kernel's BLOCK_H
        call.grid = (-(-rows // cfg.get("BLOCK_H", 64)), num_slots - 1, 1)
        call.scalars = (batch, h_q, s_q, rows, num_slots, k_cache.shape[0], max_blocks * page, scale * LOG2E,
                        *q.stride()[:3], block_table.stride(0), *out_strides, *lse_strides)
        call.meta = dict(CAUSAL=causal, KV_PAGE=page, **cfg, **({"launch_pdl": True} if pdl >= 2 else {}))
    else:
        call.grid = (num_slots * per_slot, -(-rows // cfg["BLOCK_H"]), 1)
        call.scalars = (batch, h_q, s_q, rows, num_slots, k_cache.shape[0], max_blocks * page, scale * LOG2E,
                        *q.stride()[:3], k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
                        *out_strides, *lse_strides)
        call.meta = dict(CAUSAL=causal, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                         FUSED_COMBINE=fused, SLOT_PROGRAMS=per_slot, KV_PAGE=page, KV_FP8=fp8, **cfg)
    s_chunk, col_blocks, per_program = configs.combine_settings(batch, metadata_parts(num_slots, batch))
    call.combine_grid = None if fused or fused_splits >= num_slots else (batch, -(-rows // per_program), col_blocks)
    call.combine_scalars = (h_q, rows, num_slots, *out_strides, *lse_strides)
    call.combine_meta = dict(S_CHUNK=s_chunk, SLOT_PROGRAMS=per_slot, FUSED_SPLITS=max(1, fused_splits),
                             GDC=pdl >= 1, COL_BLOCKS=col_blocks, ROWS=per_program, num_warps=4,
                             **({"launch_pdl": True} if pdl >= 1 else {}))
    return call


def _launch_attention(call: _Call, q, k_cache, block_table, cache_seqlens, meta, num_splits):
    if call.fallback is not None and (k_cache.data_ptr() % 16 or q.data_ptr() % 16):
        call = call.fallback
    out = torch.empty(call.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
    o_acc, lse_acc = _scratch.workspace(q.device, *call.partials)
    key = (call, q.data_ptr() % 16, k_cache.data_ptr() % 16, block_table.data_ptr() % 16,
           cache_seqlens.data_ptr() % 16, meta.data_ptr() % 16, num_splits.data_ptr() % 16)
    (counters,) = _scratch.zeroed(q.device, call.counters) if call.counters else (lse,)
    if call.variant in _GLUON:
        if call.variant == "wgmma_fp8_wide":       # the converter reads the 656-byte rows itself
            descriptors = (_as_bytes(k_cache),)
        elif call.variant == "wgmma_fp8":
            descriptors = _fp8_descriptors(k_cache, call.meta.get("SLOT_N", 64))
        else:
            descriptors = _kv_descriptors(k_cache, call.meta["BLOCK_N"])
        tensors = (q, *descriptors, block_table, cache_seqlens, meta, num_splits, out, lse, o_acc, lse_acc)
        if call.variant == "wgmma":
            tensors += (counters,)
    else:
        tensors = (q, _as_bytes(k_cache), block_table, cache_seqlens, meta, num_splits, out, lse, o_acc, lse_acc, counters)
    _kernels()[call.variant].launch(key, call.grid, q.device.index, tensors, call.scalars, call.meta)
    if call.combine_grid is not None:
        _kernels()["combine"].launch(key, call.combine_grid, q.device.index, (num_splits, o_acc, lse_acc, out, lse),
                                     call.combine_scalars, call.combine_meta)
    return out, lse


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache in FlashMLA's float8_e4m3fn view of the FP8 layout as the bytes the kernels read
    (any other cache as it is)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


# the Gluon kernels (TMA descriptors, one program per head tile and run of slots)
_GLUON = (*configs.GLUON_VARIANTS, "wgmma_fp8", "wgmma_fp8_wide", "wgmma_t")


def _gluon_form(variant: str, rows: int, fp8: bool) -> str:
    """The Gluon 16-bit kernel's form for ``rows`` query rows: its transposed form ``wgmma_t``
    (``kernels_gluon_t``) where ``configs.transposed_gluon`` says so and it imports, else
    ``variant`` as it is."""
    if variant in configs.GLUON_VARIANTS and configs.transposed_gluon(rows, fp8) \
            and _kernels().get("wgmma_t") is not None:
        return "wgmma_t"
    return variant
LOG2E = 1.4426950408889634    # scores are kept in the log2 domain: qk_scale = softmax_scale * log2(e)


_kv_pairs = PlanCache()     # (cache address, dtype, shape, block_n) -> the pair of descriptors (GPU)


def _kv_descriptors(k_cache: torch.Tensor, block_n: int) -> tuple:
    """TMA descriptors of the cache as ``[num_blocks * page, 576]`` rows: columns 0..511 in
    ``[box, 512]`` boxes, columns 512..575 in ``[box, 64]`` boxes, ``box = min(page, block_n)``
    rows (a tile spans ``block_n / page`` pages where pages are shorter). Cached per cache address
    and shape by ``_launch.descriptor``, and the pair here too on a GPU (one lookup per call: the
    address, dtype and shape fix the geometry, the same argument as ``_launch.descriptor``'s)."""
    key = (k_cache.data_ptr(), k_cache.dtype, k_cache.shape, block_n) if k_cache.is_cuda else None
    pair = _kv_pairs.get(key) if key is not None else None
    if pair is None:
        page = k_cache.shape[1]
        rows, box = k_cache.shape[0] * page, min(page, block_n)
        pair = tuple(_launch.descriptor(k_cache, [rows, cols], [HEAD_DIM, 1], [box, cols], gluon=True,
                                        offset=offset)
                     for offset, cols in ((0, HEAD_DIM_V), (HEAD_DIM_V, HEAD_DIM - HEAD_DIM_V)))
        _kv_pairs.remember(key, pair)
    return pair


def _fp8_descriptors(k_cache: torch.Tensor, slot_n: int = 64) -> tuple:
    """TMA descriptors of an FP8 cache (``[num_blocks, page, 1, 656]`` bytes) for
    ``kernels_gluon_fp8``: its rows as float8_e4m3fn ``[num_blocks * page, 656]`` in
    ``[box, 128]`` boxes (the codes, 128 per box, and the RoPE bytes), and as fp32 from byte 512
    (``[rows, 4]`` of row stride 164: the scales) in ``[box, 4]`` boxes, ``box = min(page,
    slot_n)`` (``slot_n``: the kernel's ring slot, the config's ``SLOT_N``)."""
    page = k_cache.shape[1]
    rows, box = k_cache.shape[0] * page, min(page, slot_n)
    codes = k_cache if k_cache.dtype == torch.float8_e4m3fn else k_cache.view(torch.float8_e4m3fn)
    words = FP8_KV_BYTES // 4
    return (_launch.descriptor(codes, [rows, FP8_KV_BYTES], [FP8_KV_BYTES, 1], [box, FP8_GROUP], gluon=True),
            _launch.descriptor(k_cache.view(torch.float32), [rows, HEAD_DIM_V // FP8_GROUP], [words, 1],
                               [box, HEAD_DIM_V // FP8_GROUP], gluon=True, offset=HEAD_DIM_V // 4))


def _flash_mla_fake(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal,
                    fp8=False):
    batch, s_q, h_q, _ = q.shape
    return (q.new_empty(batch, s_q, h_q, head_dim_v), q.new_empty(batch, h_q, s_q, dtype=torch.float32))


@tilefuse_op("flash_mla_with_kvcache", fake=_flash_mla_fake,
             backward=no_backward("flash_mla_with_kvcache", "MLA decode attention"),
             setup_context=lambda ctx, inputs, output: None)
def _flash_mla_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                  head_dim_v: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
                  softmax_scale: float, causal: bool, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense decode, 16-bit (``fp8=False``) or FP8 cache, as a custom op."""
    call = _plan_call(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale, causal, fp8)
    return _run(call, q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)


def _sparse_fake(q, k_cache, indices, softmax_scale, attn_sink, extra_k_cache, extra_indices, topk_length,
                 extra_topk_length):
    batch, s_q, h_q, _ = q.shape
    return (q.new_empty(batch, s_q, h_q, HEAD_DIM_V), q.new_empty(batch, h_q, s_q, dtype=torch.float32))


@tilefuse_op("flash_mla_sparse", fake=_sparse_fake,
             backward=no_backward("flash_mla_with_kvcache", "MLA sparse decode attention"),
             setup_context=lambda ctx, inputs, output: None)
def _sparse_op(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
               attn_sink: torch.Tensor | None, extra_k_cache: torch.Tensor | None,
               extra_indices: torch.Tensor | None, topk_length: torch.Tensor | None,
               extra_topk_length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse decode (16-bit or FP8 caches, validated by the caller) as a custom op."""
    return _sparse_run(q, k_cache, indices, softmax_scale, attn_sink, extra_k_cache, extra_indices, topk_length,
                       extra_topk_length)


_plans = PlanCache()


def _plan_call(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal,
               fp8: bool = False) -> _Call:
    tracing = torch.compiler.is_compiling()
    key = None if tracing else plan_key(q, k_cache, block_table, cache_seqlens, meta, num_splits)
    try:
        # (the transposed Gluon form's and the FP8 tiles' switches and the Gluon kernel's levers
        # too: a run that changes them re-plans)
        key = key + (head_dim_v, softmax_scale, causal, fp8, configs.TRANSPOSED_GLUON_MAX_ROWS,
                     configs.FP8_WIDE_FROM_ROWS, configs.levers_version) if key is not None else None
        call = _plans.get(key) if key is not None else None
    except TypeError:       # an unhashable argument: validated (and refused) below
        key = call = None
    if call is not None:
        return call
    _validate(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, fp8)
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else _checks.check_float("softmax_scale", softmax_scale)
    if tracing:
        # torch.compile: the checks and the scale only; the op plans its launch when it runs (a plan
        # here, cached or computed, would specialize the traced sizes: dynamic=True would recompile)
        call = _Call()
        call.reference, call.scale, call.causal = None, scale, bool(causal)
        return call
    # no query token, the reference backend, or an FP8 cache the kernels do not take (an fp32 q): the reference
    if q.shape[0] == 0 or choose_backend(q.device) != "triton" or (fp8 and not fp8_sparse_kernels_run(q)):
        call = _Call()
        call.reference = True
    else:
        check_interpretable("q", q.dtype)
        call = _attention_call(q, k_cache, block_table, meta, scale, bool(causal))
        call.reference = False
    call.scale, call.causal = scale, bool(causal)
    return _plans.remember(key, call)


def _run(call: _Call, q, k_cache, block_table, cache_seqlens, meta, num_splits):
    if call.reference:
        return mla_decode_reference(q, k_cache, block_table, cache_seqlens, HEAD_DIM_V, call.scale, call.causal)
    return _launch_attention(call, q, k_cache, block_table, cache_seqlens, meta, num_splits)


def _check_lengths(cache_seqlens: torch.Tensor, max_blocks: int | None, page_size: int = PAGE_SIZE) -> None:
    """Lengths >= 0 and (``max_blocks``) within the block table: reads them (a host sync)."""
    if cache_seqlens.numel():
        lo, hi = (int(v) for v in torch.aminmax(cache_seqlens))
        top = float("inf") if max_blocks is None else max_blocks * page_size
        if lo < 0 or hi > top:
            room = "" if max_blocks is None else f" (block_table has {max_blocks} pages of {page_size})"
            raise ValueError(f"cache_seqlens: expected lengths in [0, {top}]{room}, got [{lo}, {hi}]")


def check_schedule(cache_seqlens: torch.Tensor, meta: torch.Tensor, num_splits: torch.Tensor) -> None:
    """The metadata and ``num_splits`` describe a schedule of this batch: every request has at
    least one split, each split runs on exactly one slot, a request's splits cover its pages in
    order, and the parts' runs of slots (column 7) cover the used slots once. Reads them back (a
    host sync)."""
    batch = cache_seqlens.shape[0]
    splits = num_splits.tolist()
    if splits[0] != 0 or any(b <= a for a, b in zip(splits, splits[1:])) or splits[-1] > meta.shape[0]:
        raise ValueError(f"num_splits: expected increasing cumulative split counts from 0 to at most "
                         f"{meta.shape[0]} (one per slot), got {splits[:8]}{'...' if batch > 7 else ''}")
    rows = meta.tolist()
    pages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in cache_seqlens.tolist()]
    seen = {}
    for slot, (req, split, begin, end, *_rest) in enumerate(rows):
        if req == -1:
            continue
        if not 0 <= req < batch or not 0 <= split < splits[req + 1] - splits[req] or (req, split) in seen:
            raise ValueError(f"tile_scheduler_metadata: slot {slot} runs request {req} split {split}, which is "
                             f"out of range or taken twice (expected metadata from get_mla_metadata on this batch)")
        seen[req, split] = (begin, end)
    if len(seen) != splits[-1]:
        raise ValueError(f"tile_scheduler_metadata: expected {splits[-1]} scheduled splits (num_splits), "
                         f"got {len(seen)}")
    for req in range(batch):
        n = splits[req + 1] - splits[req]
        bounds = [seen[req, s] for s in range(n)]
        if bounds[0][0] != 0 or bounds[-1][1] != pages[req] or any(
                b[1] != c[0] or b[0] > b[1] for b, c in zip(bounds, bounds[1:] + [(bounds[-1][1], 0)])):
            raise ValueError(f"tile_scheduler_metadata: request {req}'s splits cover pages {bounds[:4]}, expected "
                             f"0 to {pages[req]} in order (metadata from get_mla_metadata on these lengths)")
    starts = [row[7] for row in rows]
    if starts[0] != 0 or starts[-1] != splits[-1] or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"tile_scheduler_metadata: expected the programs' first slots (column 7) to rise from 0 "
                         f"to {splits[-1]}, got {starts[:8]}")


def _check_shape(name: str, value: torch.Tensor, expected, what: str, *sizes) -> None:
    """``_checks.check_shape`` with ``what`` formatted (``what.format(*sizes)``) only on a mismatch:
    formatting a size into text while ``torch.compile`` traces specializes it (``dynamic=True``
    would recompile for every batch)."""
    shape = tuple(value.shape)
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
        _checks.check_shape(name, value, expected, what.format(*sizes))


def _validate(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, fp8: bool = False,
              schedule_optional: bool = False) -> None:
    """The dense decode's argument checks (metadata only). ``schedule_optional``: the metadata and
    ``num_splits`` may both be None (``explain`` without them)."""
    _checks.check_tensor("q", q, dtypes=(*_checks.FLOAT16S, torch.float32), ndim=4)
    width = FP8_KV_BYTES if fp8 else HEAD_DIM
    if fp8:
        _check_fp8_cache("k_cache", k_cache)
    _checks.check_tensor("k_cache", k_cache, dtypes=(torch.uint8, torch.float8_e4m3fn) if fp8 else (q.dtype,), ndim=4)
    _checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    _checks.check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    batch, s_q, h_q, head_dim = q.shape
    if head_dim != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM} (512 latent + 64 RoPE), got {head_dim}")
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v: expected {HEAD_DIM_V}, got {head_dim_v!r}")
    check_page_shape("k_cache", k_cache, width)
    _checks.check_shape("k_cache", k_cache, (None, None, 1, width), f"[num_blocks, page, 1, {width}]")
    if k_cache.shape[0] < 1:
        raise ValueError(f"k_cache: expected at least one page, got shape {tuple(k_cache.shape)}")
    _check_shape("block_table", block_table, (batch, None), "[b={}, max_blocks]", batch)
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one page per request, got shape {tuple(block_table.shape)}")
    _check_shape("cache_seqlens", cache_seqlens, (batch,), "[b={}]", batch)
    if not (schedule_optional and meta is None and num_splits is None):
        _checks.check_tensor("tile_scheduler_metadata", meta, dtypes=(torch.int32,), ndim=2)
        _checks.check_shape("tile_scheduler_metadata", meta, (None, 8), "[slots, 8] (get_mla_metadata's)")
        if meta.shape[0] <= batch:
            raise ValueError(f"tile_scheduler_metadata: expected more than b = {batch} rows (from get_mla_metadata "
                             f"on the same batch), got {meta.shape[0]}")
        _checks.check_contiguous("tile_scheduler_metadata", meta)
        _checks.check_tensor("num_splits", num_splits, dtypes=(torch.int32,), ndim=1)
        _check_shape("num_splits", num_splits, (batch + 1,), "[b + 1 = {}]", batch + 1)
        _checks.check_contiguous("num_splits", num_splits)
    if h_q < 1 or h_q > 128 or s_q < 1 or s_q * h_q > 512:
        raise ValueError(f"q: expected 1 <= h_q <= 128, s_q >= 1 and s_q * h_q <= 512, got h_q={h_q}, s_q={s_q}")
    _checks.check_same_device(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                              tile_scheduler_metadata=meta, num_splits=num_splits)
    _checks.check_contiguous("k_cache", k_cache)
    _checks.check_contiguous("q", q, last_dim_only=True)
    _checks.check_contiguous("block_table", block_table, last_dim_only=True)


def _check_fp8_cache(name: str, cache) -> None:
    """``cache`` is in FlashMLA's FP8 layout: ``[num_blocks, page, 1, 656]`` uint8 or float8_e4m3fn."""
    _checks.check_tensor(name, cache, ndim=4)
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or cache.shape[-1] != FP8_KV_BYTES:
        raise ValueError(f"{name}: expected [num_blocks, page, 1, {FP8_KV_BYTES}] uint8 or float8_e4m3fn "
                         f"with is_fp8_kvcache=True (mla_quantize_kv's layout), got {cache.dtype} of shape "
                         f"{tuple(cache.shape)}")


def _check_mode_args(indices, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length) -> None:
    """Arguments that mean something only in a sparse decode (``indices`` given), or only with a
    second cache, are refused where they would be ignored."""
    if indices is None:
        for name, value in (("attn_sink", attn_sink), ("topk_length", topk_length), ("extra_k_cache", extra_k_cache),
                            ("extra_indices_in_kvcache", extra_indices), ("extra_topk_length", extra_topk_length)):
            if value is not None:
                raise ValueError(f"{name}: expected None in a dense decode (it is an argument of the sparse decode: "
                                 f"pass indices), got {type(value).__name__}")
    elif extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: expected None without extra_k_cache (it cuts the second cache's index "
                         "lists), got a tensor")


def _check_dense_contents(k_cache, block_table, cache_seqlens, meta, num_splits) -> None:
    """``check_contents`` of a dense decode (16-bit or FP8 cache): the lengths within the block
    table, the used pages within the cache, and (given) the schedule of this batch. Host syncs."""
    _check_lengths(cache_seqlens, block_table.shape[1], k_cache.shape[1])
    check_block_table(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1])
    if meta is not None and num_splits is not None:
        check_schedule(cache_seqlens, meta, num_splits)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                           cache_seqlens: torch.Tensor | None, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None,
                           causal: bool = False, *, check_contents: bool | None = None,
                           is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None,
                           attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           topk_length: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache (FlashMLA's signature).

    Parameters
    ----------
    q : [b, s_q, h_q, 576] bf16 or fp16 (fp32 accepted: IEEE fp32 dots). s_q query tokens per
        request (multi-token prediction / speculative decoding), h_q from 1 to 128.
    k_cache : [num_blocks, page, 1, 576], q's dtype, contiguous. Pages of ``page`` tokens: 64
        (FlashMLA's; the Gluon kernel on Hopper), or 16, 32, 128, 256 (vLLM's 16, for one; the
        ``tl`` kernels); V is the first ``head_dim_v`` values of each 576-wide latent vector.
    block_table : [b, max_blocks] int32: request i's token t is in page ``block_table[i, t // page]``.
        Only the pages below a request's length are read (vLLM's -1 padding after them is fine).
    cache_seqlens : [b] int32, each in [0, page * max_blocks]. Slots past a length are never read.
    head_dim_v : 512.
    tile_scheduler_metadata, num_splits : from :func:`get_mla_metadata` for this batch (any
        lengths: they only schedule the work).
    softmax_scale : a finite number; default ``576 ** -0.5``.
    causal : query token t of s_q sees keys ``0 .. L - s_q + t``; else all L keys.
    check_contents : read the lengths, the block table's used pages and the schedule back and
        raise ``ValueError`` where they are out of range or disagree (a host sync); default
        ``TILEFUSE_DEBUG``. Without it, out-of-range contents cannot fault (lengths are clamped
        to the block table, pages to the cache, bad slots skipped) but give unspecified outputs.
        Skipped while ``torch.compile`` traces and for meta / fake tensors (nothing to read:
        check eagerly); meta / fake inputs return outputs of the right shapes.

    is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
        extra_topk_length : FlashMLA main's FP8 cache (``k_cache [.., 656]`` bytes: ``mla_quantize_kv``)
        and sparse (top-k) decode (``indices [b, s_q, topk]`` int32 of ``page * page_size +
        offset``, -1 for none; ``topk_length [b]``; ``attn_sink [h_q]`` fp32; a second cache and
        its indices); ``block_table`` and ``cache_seqlens`` may be None with ``indices``. On the
        Triton backend with a 16-bit q (``configs.FP8_SPARSE_KERNELS``), the dense FP8 decode
        runs the ``tl`` split kernels, which dequantize each tile as they load it, and the sparse
        decode its ``tl`` gather kernel; otherwise the PyTorch references
        (``reference.mla_sparse_decode_reference``, ``mla_decode_reference``).

    Returns
    -------
    out : [b, s_q, h_q, 512] in q's dtype (0 for a row with no visible key).
    softmax_lse : [b, h_q, s_q] fp32, natural log (+inf for a row with no visible key).

    Decode only: requesting a gradient through it raises.
    """
    if indices is not None:
        return _sparse(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
                       extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    if attn_sink is not None or extra_k_cache is not None or extra_indices_in_kvcache is not None \
            or topk_length is not None or extra_topk_length is not None:
        _check_mode_args(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    fp8 = bool(is_fp8_kvcache)
    if isinstance(cache_seqlens, torch.Tensor) and not cache_seqlens.is_contiguous():
        cache_seqlens = cache_seqlens.contiguous()
    call = _plan_call(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale, causal, fp8)
    no_data = _checks.contents_unreadable(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)
    if (_env.settings.debug if check_contents is None else check_contents) and not no_data:
        _check_dense_contents(k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)
    if no_data or use_dispatcher(q, k_cache):
        return _flash_mla_op(q, k_cache, block_table, cache_seqlens, HEAD_DIM_V, tile_scheduler_metadata,
                             num_splits, call.scale, call.causal, fp8)
    return _run(call, q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)


def _fp8_variant(variant: str, rows: int, max_blocks: int, q: torch.Tensor) -> str:
    """The kernel of a dense FP8 decode: a pinned ``tl`` kernel as pinned; where the Gluon kernel
    was chosen (Hopper) and q is bf16 (the cache's RoPE part is bf16), the 64-row tiles of
    ``kernels_gluon_fp8_wide`` from ``configs.FP8_WIDE_FROM_ROWS`` rows, the transposed Gluon FP8
    kernel up to ``configs.FP8_GLUON_MAX_ROWS`` rows; else the ``tl`` kernels by rows: the unpadded standard
    kernel at <= 16 rows, transposed at 17-32 (one head tile), the standard kernel's 64-row tile
    above ``configs.FP8_TRANSPOSED_MAX_ROWS`` (the transposed kernel dequantizes every page once
    per 32-row tile; measured on the H200, so a low-ridge chip keeps the 16-bit rule)."""
    if forced_variant("mla") in ("standard", "transposed"):
        return variant
    gluon = variant in configs.GLUON_VARIANTS and q.dtype == torch.bfloat16
    if gluon and rows >= configs.FP8_WIDE_FROM_ROWS and _kernels().get("wgmma_fp8_wide") is not None:
        return "wgmma_fp8_wide"
    if gluon and rows <= configs.FP8_GLUON_MAX_ROWS and _kernels().get("wgmma_fp8") is not None:
        return "wgmma_fp8"
    ridge = _chip_ridge(q)
    if rows > configs.FP8_TRANSPOSED_MAX_ROWS and (ridge is None or ridge >= configs.PADDED_FLOP_PER_BYTE):
        return "standard"     # (a low-ridge chip, where padding costs compute, keeps the 16-bit rule)
    return configs.default_variant(rows, max_blocks, False, ridge)


def fp8_sparse_kernels_run(q: torch.Tensor) -> bool:
    """The dense FP8 decode runs the ``tl`` split kernels (reading the 656-byte layout
    themselves) and the sparse decode its ``tl`` kernel, rather than the references: where
    ``configs.FP8_SPARSE_KERNELS`` enables them (the default), or a ``force(variant="standard"|"transposed")``
    asks for them, on the Triton backend, for a 16-bit q."""
    return (choose_backend(q.device) == "triton" and q.dtype in _checks.FLOAT16S
            and (configs.FP8_SPARSE_KERNELS or forced_variant("mla") in ("standard", "transposed")))


def _sparse_decode(q, scale, sources, attn_sink, config: dict | None = None):
    """The sparse decode on the ``tl`` kernels: ``sources`` = [(cache, indices, topk_length or
    None), ...] (the main cache, then the extra one), each cut into parts of whole tiles so that
    the launches fill the SMs ``waves`` times; every part of every source writes a partial of the
    same softmax, ``mla_sparse_combine_kernel`` merges them (and applies the sink). ``config``:
    the launch (``configs.sparse_config(h_q)`` by default)."""
    batch, s_q, h_q, _ = q.shape
    gluon = _sparse_gluon_fits(q, [cache for cache, _, _ in sources], [idx for _, idx, _ in sources])
    cfg = dict(config or configs.sparse_config(h_q, gluon=gluon))
    kernel = cfg.pop("kernel", "tl")
    if kernel == "gluon" and not gluon:
        raise ValueError("config: the Gluon sparse kernel needs FP8 caches at 16-byte aligned addresses, int32 "
                         "indices and a 16-bit q on a Hopper GPU with Gluon")
    block_n = 64 if kernel == "gluon" else cfg["BLOCK_N"]
    waves, fit_regs, block_h = cfg.pop("waves", 1), cfg.pop("fit_regs", None), cfg["BLOCK_H"]
    units = batch * s_q
    tiles = -(-h_q // block_h)
    plans = []
    for cache, idx, length in sources:
        topk = idx.shape[-1]
        blocks = max(1, -(-topk // block_n))
        if kernel == "gluon":   # whole waves of one program per SM; the part's index list fits its SMEM
            chunk = block_n * configs.gluon_sparse_part_tiles(
                blocks, units * tiles, num_sms(q.device),
                configs.GLUON_SPARSE_INDEX_BYTES // idx.element_size() // block_n)
        else:   # the tl kernel: ``waves`` programs per SM, parts of equal size
            want = max(1, -(-waves * num_sms(q.device) // (units * tiles)))
            chunk = block_n * -(-blocks // min(want, blocks))
        plans.append((cache, idx, length, topk, chunk, max(1, -(-topk // chunk))))
    num_chunks = sum(plan[-1] for plan in plans)
    if fit_regs and units * tiles * num_chunks > 2 * num_sms(q.device):   # configs.SPARSE_CONFIGS: occupancy
        cfg["maxnreg"] = fit_regs
    out = torch.empty(batch, s_q, h_q, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
    if units == 0:
        return out, lse
    parts = units * num_chunks * h_q
    o_acc, lse_acc = _scratch.workspace(q.device, (parts * HEAD_DIM_V, torch.float32), (parts, torch.float32))
    base = 0
    for cache, idx, length, topk, chunk, n in plans:
        fp8 = cache.shape[-1] == FP8_KV_BYTES
        cache = _as_bytes(cache)
        num_tokens = cache.shape[0] * cache.shape[1]
        if kernel == "gluon":
            # the cache as 4-byte words (164 per token), the rows' offsets then provably 16-byte aligned
            cache = cache.view(torch.int32)
            scalars = (h_q, s_q, topk, num_tokens, base, num_chunks, scale * LOG2E, *q.stride()[:3], idx.stride(0),
                       idx.stride(1))
            meta = dict(cfg, CHUNK=chunk, IDX_TILES=triton.next_power_of_2(chunk // block_n),
                        HAS_LEN=length is not None, NUM_WARPS=cfg["num_warps"])
        else:
            scalars = (h_q, s_q, topk, num_tokens, cache.shape[1], base, num_chunks, scale * LOG2E, *q.stride()[:3],
                       cache.stride(0), cache.stride(1), idx.stride(0), idx.stride(1))
            meta = dict(cfg, CHUNK=chunk, HAS_LEN=length is not None, KV_FP8=fp8,
                        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
        tensors = (q, cache, idx, length if length is not None else idx, o_acc, lse_acc)
        key = (kernel, scalars, tuple(meta.items()), q.dtype, cache.dtype, idx.dtype,
               *(t.data_ptr() % 16 for t in tensors))
        _kernels()["sparse_gluon" if kernel == "gluon" else "sparse"].launch(key, (n, units, tiles), q.device.index,
                                                                           tensors, scalars, meta)
        base += n
    tensors = (o_acc, lse_acc, attn_sink if attn_sink is not None else lse_acc, out, lse)
    scalars = (h_q, s_q, num_chunks, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    meta = dict(HAS_SINK=attn_sink is not None, S_CHUNK=8, num_warps=4)
    key = ("sparse_combine", scalars, tuple(meta.items()), q.dtype, *(t.data_ptr() % 16 for t in tensors))
    _kernels()["sparse_combine"].launch(key, (units, h_q, 1), q.device.index, tensors, scalars, meta)
    return out, lse


def sparse_gather_dense_runs(q: torch.Tensor, indices) -> bool:
    """The sparse decode gathers the selected tokens into a dense cache once and runs the Gluon
    dense kernel on it (:func:`_sparse_gather_dense`) where that can run (a bf16 q on Hopper with
    the Gluon kernel, no ``tl`` kernel forced) and the cost model of
    ``configs.sparse_gather_dense_pays`` predicts it faster than the Gluon sparse kernel for
    ``indices`` (the index lists: main, then extra), with the host floor of an eager call where
    no CUDA graph is being captured."""
    units = q.shape[0] * q.shape[1]
    return (q.dtype == torch.bfloat16 and units > 0 and wgmma_usable(q.device)
            and forced_variant("mla") not in ("standard", "transposed")
            and configs.sparse_gather_dense_pays(q.shape[2], units * sum(idx.shape[-1] for idx in indices),
                                                 eager=not torch.cuda.is_current_stream_capturing()))


_unit_tables: dict = {}   # (device, stream, pages) -> the block table of the most query tokens asked so far


def _unit_pages(device: torch.device, units: int, pages: int) -> torch.Tensor:
    """The block table ``[units, pages]`` int32 of the gathered cache: query token u's pages are
    ``u x pages ..``. One table per device and page count, grown to the next power of two of the
    query tokens asked and returned as its first ``units`` rows (the same rows for any count), so
    the cache stays one tensor whatever batch sizes come; while a CUDA graph captures, the graph
    computes its own. One table per CUDA stream: the table is written on the stream that asks
    first, and a grown table frees the old one, so a table shared by two streams could be read
    before it is written or after its memory went to another tensor."""
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.arange(units * pages, dtype=torch.int32, device=device).view(units, pages)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream, pages)
    table = _unit_tables.get(key)
    if table is None or table.shape[0] < units:
        rows = 1 << max(units - 1, 0).bit_length()
        table = _unit_tables[key] = torch.arange(rows * pages, dtype=torch.int32, device=device).view(rows, pages)
    return table[:units]


def gather_selected(sources, s_q: int, first: int, count: int, pages: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected tokens of query tokens ``first .. first + count - 1`` (request x s_q + token)
    as a dense cache: ``dense [count x pages x 64, 576]`` in ``dtype`` (query token u's tokens packed
    from row ``u x pages x 64``, both sources in order, FP8 rows dequantized) and ``seqlens
    [count]`` int32, how many each has. ``sources``: [(cache, indices, topk_length or None), ...]
    as :func:`_sparse_decode` takes them; rows past a length are left unwritten."""
    device = sources[0][1].device
    block_t = configs.SPARSE_GATHER_BLOCK_T
    dense = torch.empty(count * pages * PAGE_SIZE, HEAD_DIM, dtype=dtype, device=device)
    seqlens = torch.empty(count, dtype=torch.int32, device=device)
    prior = None                # the first source (cache, indices, length) while the second is gathered
    for i, (cache, idx, length) in enumerate(sources):
        cache, topk = _as_bytes(cache), idx.shape[-1]
        p_cache, p_idx, p_len = prior if prior is not None else (cache, idx, None)
        # positions per program: about SPARSE_GATHER_PROGRAMS_PER_SM programs per SM in all
        want = -(-topk * count // (configs.SPARSE_GATHER_PROGRAMS_PER_SM * num_sms(device)))
        chunk = min(max(block_t, -(-want // block_t) * block_t), max(block_t, -(-topk // block_t) * block_t))
        scalars = (s_q, topk, cache.shape[0] * cache.shape[1], cache.shape[1], p_idx.shape[-1] if prior else 0,
                   p_cache.shape[0] * p_cache.shape[1], first, pages * PAGE_SIZE, chunk, cache.stride(0),
                   cache.stride(1), idx.stride(0), idx.stride(1), p_idx.stride(0), p_idx.stride(1))
        meta = dict(BLOCK_T=block_t, COUNT=256, HAS_LEN=length is not None, HAS_PRIOR=prior is not None,
                    PRIOR_HAS_LEN=p_len is not None, KV_FP8=cache.shape[-1] == FP8_KV_BYTES,
                    LAST=i == len(sources) - 1, num_warps=4)
        tensors = (cache, idx, length if length is not None else idx, p_idx, p_len if p_len is not None else idx,
                   dense, seqlens)
        key = ("sparse_gather", scalars, tuple(meta.items()), cache.dtype, idx.dtype, p_idx.dtype, dtype,
               *(t.data_ptr() % 16 for t in tensors))
        grid = (max(1, -(-topk // chunk)), count, 1)
        _kernels()["sparse_gather"].launch(key, grid, device.index, tensors, scalars, meta)
        prior = (cache, idx, length)
    return dense, seqlens


def _sparse_gather_dense(q, scale, sources, attn_sink):
    """The sparse decode as gather + dense decode: :func:`gather_selected` packs each query
    token's selected tokens (both sources, dequantized to bf16) into its own pages of a dense
    cache, their count as its length; the metadata kernel schedules those lengths and the Gluon
    dense kernel attends each query token's ``h_q`` heads to them as one request (64-head tiles:
    each selected token read once per tile instead of gathered once per 32 heads). The sink then
    scales the output by ``sigmoid(lse - sink)``. Query tokens run in groups whose dense cache
    fits ``configs.SPARSE_GATHER_MAX_BYTES``."""
    batch, s_q, h_q, _ = q.shape
    units = batch * s_q
    pages = max(1, -(-sum(idx.shape[-1] for _, idx, _ in sources) // PAGE_SIZE))
    group = max(1, min(units, configs.SPARSE_GATHER_MAX_BYTES // (pages * PAGE_SIZE * HEAD_DIM * q.element_size())))
    q_units = q.reshape(units, 1, h_q, HEAD_DIM)
    outs, lses = [], []
    for first in range(0, units, group):
        n = min(group, units - first)
        dense, seqlens = gather_selected(sources, s_q, first, n, pages, q.dtype)
        kv = dense.view(n * pages, PAGE_SIZE, 1, HEAD_DIM)
        block_table = _unit_pages(q.device, n, pages)
        meta, splits = _get_mla_metadata(seqlens, h_q, 1, default_num_sm_parts(q.device, h_q))
        call = _plan_call(q_units[first:first + n], kv, block_table, seqlens, HEAD_DIM_V, meta, splits, scale, False)
        out, lse = _run(call, q_units[first:first + n], kv, block_table, seqlens, meta, splits)
        if attn_sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)); a head with no token (lse +inf) keeps its 0
            factor = torch.sigmoid(lse.view(n, 1, h_q) - attn_sink).nan_to_num_(0.0)
            out = (out.float() * factor[..., None]).to(q.dtype)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses)
    return out.view(batch, s_q, h_q, HEAD_DIM_V), lse.view(batch, s_q, h_q).transpose(1, 2).contiguous()


def _validate_sparse(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8, indices, attn_sink, extra_k_cache,
                     extra_indices, topk_length, extra_topk_length) -> float:
    """The sparse decode's argument checks (metadata only); returns the softmax scale."""
    _checks.check_tensor("q", q, dtypes=(*_checks.FLOAT16S, torch.float32), ndim=4)
    batch, s_q, h_q, head_dim = q.shape
    if head_dim != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM} (512 latent + 64 RoPE), got {head_dim}")
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v: expected {HEAD_DIM_V}, got {head_dim_v!r}")
    if not 1 <= h_q <= 128:
        raise ValueError(f"q: expected 1 <= h_q <= 128, got {h_q}")

    def check_cache(name, cache):
        if is_fp8:
            _check_fp8_cache(name, cache)
        else:
            _checks.check_tensor(name, cache, ndim=4)
            if cache.dtype != q.dtype or cache.shape[-1] != HEAD_DIM:
                raise ValueError(f"{name}: expected [num_blocks, page, 1, {HEAD_DIM}] in q's dtype {q.dtype} (or "
                                 f"is_fp8_kvcache=True for the FP8 layout), got {cache.dtype} of shape "
                                 f"{tuple(cache.shape)}")
        check_page_shape(name, cache, cache.shape[-1])

    def check_indices(name, idx, length_name, length):
        _checks.check_tensor(name, idx, dtypes=(torch.int32, torch.int64), ndim=3)
        if idx.shape[:2] != (batch, s_q):
            raise ValueError(f"{name}: expected [b={batch}, s_q={s_q}, topk], got shape {tuple(idx.shape)}")
        if length is not None:
            _checks.check_tensor(length_name, length, dtypes=(torch.int32, torch.int64), ndim=1)
            _check_shape(length_name, length, (batch,), "[b={}]", batch)

    check_cache("k_cache", k_cache)
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else _checks.check_float("softmax_scale", softmax_scale)
    if attn_sink is not None:
        _checks.check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), ndim=1)
        _check_shape("attn_sink", attn_sink, (h_q,), "[h_q={}]", h_q)
    if causal:
        raise ValueError("causal: expected False with indices (a sparse decode attends to what its indices name)")
    check_indices("indices", indices, "topk_length", topk_length)
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("extra_k_cache, extra_indices_in_kvcache: expected both or neither")
    _check_mode_args(indices, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length)
    if extra_k_cache is not None:
        check_cache("extra_k_cache", extra_k_cache)
        check_indices("extra_indices_in_kvcache", extra_indices, "extra_topk_length", extra_topk_length)
    _checks.check_same_device(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                              extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
                              extra_topk_length=extra_topk_length)
    if fp8_sparse_kernels_run(q):
        check_interpretable("q", q.dtype)
        for name, cache in (("k_cache", k_cache), ("extra_k_cache", extra_k_cache)):
            if cache is not None:
                _checks.check_contiguous(name, cache)
        _checks.check_contiguous("q", q, last_dim_only=True)
    return scale


def _sparse(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8, indices, attn_sink, extra_k_cache, extra_indices,
            topk_length, extra_topk_length):
    """FlashMLA main's sparse decode (16-bit or FP8 caches), validated, through the custom op where
    ``torch.compile`` traces, an input needs a gradient, or the inputs hold no values (meta /
    fake tensors)."""
    scale = _validate_sparse(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8, indices, attn_sink, extra_k_cache,
                             extra_indices, topk_length, extra_topk_length)
    args = (q, k_cache, indices, scale, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length)
    if (_checks.contents_unreadable(q, k_cache, indices, attn_sink, extra_k_cache, extra_indices, topk_length,
                                    extra_topk_length) or use_dispatcher(q, k_cache, extra_k_cache, attn_sink)):
        return _sparse_op(*args)
    return _sparse_run(*args)


def _sparse_run(q, k_cache, indices, scale, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length):
    """The validated sparse decode: no query token -> empty outputs; where
    :func:`fp8_sparse_kernels_run`, gather + dense or :func:`_sparse_decode`; otherwise the
    PyTorch reference."""
    batch, s_q, h_q, _ = q.shape
    if batch * s_q == 0:
        return (q.new_zeros(batch, s_q, h_q, HEAD_DIM_V), q.new_empty(batch, h_q, s_q, dtype=torch.float32))
    if fp8_sparse_kernels_run(q):
        sources = [(k_cache, indices.contiguous(), None if topk_length is None else topk_length.contiguous())]
        if extra_k_cache is not None:
            sources.append((extra_k_cache, extra_indices.contiguous(),
                            None if extra_topk_length is None else extra_topk_length.contiguous()))
        sink = attn_sink.contiguous() if attn_sink is not None else None
        if sparse_gather_dense_runs(q, [idx for _, idx, _ in sources]):
            return _sparse_gather_dense(q, scale, sources, sink)
        return _sparse_decode(q, scale, sources, sink)
    return mla_sparse_decode_reference(q, k_cache, indices, scale, topk_length=topk_length, attn_sink=attn_sink,
                                       extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                                       extra_topk_length=extra_topk_length)


def explain(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None,
            head_dim_v: int = HEAD_DIM_V, tile_scheduler_metadata: torch.Tensor | None = None,
            num_splits: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False, *,
            check_contents: bool | None = None, is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None,
            attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
            extra_indices_in_kvcache: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
            extra_topk_length: torch.Tensor | None = None) -> _dispatch.Choice:
    """The kernel ``flash_mla_with_kvcache(q, k_cache, block_table, ...)`` runs and why
    (``tilefuse.explain``): the measured rule of ``configs.default_variant`` by query rows per KV
    head (``s_q * h_q``), the cache's length regime and the chip; its launch settings as config.
    The call's arguments are checked first, as the op checks them (the same ``ValueError``); the
    metadata and ``num_splits`` may be left out of a dense call."""
    if indices is not None:
        _validate_sparse(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
                         extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    else:
        _check_mode_args(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
        _validate(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                  bool(is_fp8_kvcache), schedule_optional=True)
        if softmax_scale is not None:
            _checks.check_float("softmax_scale", softmax_scale)
        if q.shape[0] and choose_backend(q.device) == "triton" and (not is_fp8_kvcache or fp8_sparse_kernels_run(q)):
            check_interpretable("q", q.dtype)
    batch, s_q, h_q = q.shape[:3]
    rows = s_q * h_q
    page = k_cache.shape[1]
    problem = {"batch": batch, "s_q": s_q, "h_q": h_q, "rows": rows,
               "pages": block_table.shape[-1] if block_table is not None else None,
               "page_size": page, "dtype": str(q.dtype).removeprefix("torch."), "device": str(q.device)}
    if batch * s_q == 0:
        return _dispatch.Choice("mla", problem, "reference", None, "no query token: empty outputs, nothing runs")
    if is_fp8_kvcache and indices is None and fp8_sparse_kernels_run(q):
        variant = _fp8_variant(choose_variant(rows, block_table.shape[1], q), rows, block_table.shape[1], q)
        cfg = configs.launch_config(variant, rows, block_table.shape[1])[0]
        why = (f"FP8 layout on Hopper, <= {configs.FP8_GLUON_MAX_ROWS} rows: the Gluon FP8 kernel "
               "(mla_split_fp8_kernel: pages by TMA, converter warps dequantizing into SMEM beside the MMA "
               "warpgroup, transposed WGMMAs; configs.FP8_GLUON_CONFIGS)" if variant == "wgmma_fp8" else
               "FP8 layout: the tl split kernel dequantizes each tile as it loads (configs.FP8_SPARSE_KERNELS)")
        return _dispatch.Choice("mla", problem, variant, cfg, why + _combine_why(batch, tile_scheduler_metadata),
                                (_dispatch.Candidate(variant, cfg, None),))
    if indices is not None and fp8_sparse_kernels_run(q) and sparse_gather_dense_runs(q, [indices]):
        cfg = configs.launch_config("wgmma", h_q, 1)[0]
        why = ("sparse decode on Hopper where the cost model (configs.sparse_gather_dense_pays: head tiles x "
               "positions) predicts it faster than the sparse kernel: the selected tokens gathered once into a dense "
               "bf16 cache (mla_sparse_gather_kernel), then the Gluon dense kernel over it, a query token per request")
        return _dispatch.Choice("mla", problem, "sparse_gather_dense", cfg, why,
                                (_dispatch.Candidate("sparse_gather_dense", cfg, None),))
    if indices is not None and fp8_sparse_kernels_run(q):
        cfg = configs.sparse_config(h_q, gluon=_sparse_gluon_fits(q, [k_cache], [indices]))
        why = ("sparse decode over an FP8 cache on Hopper: the Gluon gather kernel (mla_sparse_gluon_kernel: "
               "cp.async ring, transposed WGMMAs; configs.GLUON_SPARSE_CONFIGS)" if cfg["kernel"] == "gluon" else
               "sparse decode: the tl gather kernel (mla_sparse_split_kernel; configs.SPARSE_CONFIGS)")
        return _dispatch.Choice("mla", problem, "sparse", cfg, why, (_dispatch.Candidate("sparse", cfg, None),))
    if is_fp8_kvcache or indices is not None:
        return _dispatch.Choice("mla", problem, "reference", None, "reference: the FP8 and sparse kernels run only "
                                "on the Triton backend for a 16-bit q (configs.FP8_SPARSE_KERNELS)")
    if choose_backend(q.device) != "triton":
        return _dispatch.Choice("mla", problem, "reference", None, "reference")
    forced = forced_variant("mla")
    max_blocks = block_table.shape[1]
    variant = choose_variant(rows, max_blocks, q)
    chosen = variant
    variant = _gluon_form(variant, rows, False)
    cfg = configs.launch_config(variant, rows, max_blocks, q.element_size())[0]
    source = "forced" if forced else "measured rule (configs.default_variant: rows per KV head, length, chip)"
    if variant != chosen:
        source += (f"; <= {configs.TRANSPOSED_GLUON_MAX_ROWS} rows: the Gluon kernel's transposed form "
                   "(mla_split_t_kernel: cached tokens as WGMMA's M, one MMA warpgroup; "
                   "configs.TRANSPOSED_GLUON_MAX_ROWS)")
    if forced and forced != chosen:
        source += f"; {forced} cannot run here (the Gluon kernels need a 16-bit q on a Hopper GPU)"
    source += _combine_why(batch, tile_scheduler_metadata)
    return _dispatch.Choice("mla", problem, variant, cfg, source, (_dispatch.Candidate(variant, cfg, None),))


def _combine_why(batch: int, meta: torch.Tensor | None) -> str:
    """What ``explain`` says of the combine launch for a dense call with its metadata (none
    without): its partials per load and rows per program (``configs.combine_settings``)."""
    if meta is None:
        return ""
    num_parts = metadata_parts(meta.shape[0], batch)
    s_chunk, _, per_program = configs.combine_settings(batch, num_parts)
    return (f"; the combine (requests of several splits) reads {s_chunk} partials per load ({num_parts} parts over "
            f"{batch} requests: {'12 or more' if num_parts >= 12 * batch else 'fewer than 12'} a request), "
            f"{per_program} query row(s) per program (configs.combine_settings)")


# the cache writers (FP8 layout, paged scatter) are part of the family's public surface
from tilefuse.ops.mla.kv import mla_dequantize_kv, mla_quantize_kv, mla_scatter_kv  # noqa: E402, F401
