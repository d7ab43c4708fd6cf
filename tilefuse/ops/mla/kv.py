"""Writing the latent cache: FlashMLA's FP8 layout and the paged scatter a serving engine needs.

* :func:`mla_quantize_kv` -- ``latent [T, 576]`` -> ``[T, 656]`` uint8 in the FP8 layout
  (``reference.quantize_kv_reference``: 512 e4m3 values, 4 fp32 scales, 64 bf16 RoPE values).
* :func:`mla_dequantize_kv` -- the layout back to ``[..., 576]`` in a floating dtype: a bf16 cache
  that :func:`tilefuse.flash_mla_with_kvcache` decodes (its FP8 kernel is not written yet).
* :func:`mla_scatter_kv` -- ``latent [T, 576]`` into a paged cache at ``slot_mapping [T]``
  (``slot = page * page_size + offset``, -1 skipped, vLLM's convention), a bf16 / fp16 cache
  ``[num_blocks, page, 1, 576]`` as it is, an FP8 one ``[num_blocks, page, 1, 656]`` quantized.

Each is a PyTorch custom op (``torch.compile`` and CUDA graphs see through them). The
quantization is a few elementwise PyTorch kernels (no host sync); the scatter is one Triton
kernel (``kernels.mla_scatter_rows_kernel``: a program per token, skipped slots skipped on the
device), PyTorch indexing on the reference backend.
"""

from __future__ import annotations

import functools

import torch

from tilefuse import _checks, _launch
from tilefuse._backend import choose_backend
from tilefuse._library import tilefuse_op, use_dispatcher
from tilefuse.ops.mla.reference import (FP8_KV_BYTES, HEAD_DIM, HEAD_DIM_V, check_finite_latent, check_page_shape,
                                        dequantize_kv_reference, quantize_kv_reference)

LATENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def _quantize_fake(latent):
    return latent.new_empty(*latent.shape[:-1], FP8_KV_BYTES, dtype=torch.uint8)


@tilefuse_op("mla_quantize_kv", fake=_quantize_fake)
def _quantize_op(latent: torch.Tensor) -> torch.Tensor:
    return quantize_kv_reference(latent)


def mla_quantize_kv(latent: torch.Tensor, *, check_contents: bool | None = None) -> torch.Tensor:
    """``latent [..., 576]`` fp32 / bf16 / fp16 (512 latent + 64 RoPE values per token) ->
    ``[..., 656]`` uint8 in FlashMLA's FP8 layout (module docstring; an fp16 latent dequantizes
    within fp16's range). No host sync: an inf or NaN value makes its 128-value group NaN;
    ``check_contents`` (default ``TILEFUSE_DEBUG``) reads the values and raises ``ValueError``
    for one instead (skipped while ``torch.compile`` traces and for meta / fake tensors, which
    get the output's shape)."""
    _checks.check_tensor("latent", latent, dtypes=LATENT_DTYPES)
    if latent.dim() < 1 or latent.shape[-1] != HEAD_DIM:
        raise ValueError(f"latent: expected [..., {HEAD_DIM}] (512 latent + 64 RoPE), got shape {tuple(latent.shape)}")
    no_data = _checks.contents_unreadable(latent)
    if _check_contents(check_contents) and not no_data:
        check_finite_latent(latent)
    return _quantize_op(latent) if no_data or use_dispatcher(latent) else quantize_kv_reference(latent)


def _check_contents(check_contents: bool | None) -> bool:
    from tilefuse import _env

    return _env.settings.debug if check_contents is None else check_contents


def _dequantize_fake(packed, dtype):
    return packed.new_empty(*packed.shape[:-1], HEAD_DIM, dtype=dtype)


@tilefuse_op("mla_dequantize_kv", fake=_dequantize_fake)
def _dequantize_op(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_kv_reference(packed, dtype)


def mla_dequantize_kv(k_cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``k_cache [..., 656]`` (uint8, or float8_e4m3fn as FlashMLA holds it) -> ``[..., 576]`` in
    ``dtype`` (bf16 by default): ``e4m3 x scale`` per group of 128, the RoPE part as stored. On a
    paged cache ``[num_blocks, page, 1, 656]`` it gives the ``[num_blocks, page, 1, 576]`` cache
    ``flash_mla_with_kvcache`` takes, with the same block table."""
    _checks.check_tensor("k_cache", k_cache, dtypes=FP8_CACHE_DTYPES)
    if k_cache.dim() < 1 or k_cache.shape[-1] != FP8_KV_BYTES:
        raise ValueError(f"k_cache: expected [..., {FP8_KV_BYTES}] (FlashMLA's FP8 layout), got shape "
                         f"{tuple(k_cache.shape)}")
    if dtype not in LATENT_DTYPES:
        raise ValueError(f"dtype: expected one of {LATENT_DTYPES}, got {dtype!r}")
    if _checks.contents_unreadable(k_cache) or use_dispatcher(k_cache):
        return _dequantize_op(k_cache, dtype)
    return dequantize_kv_reference(k_cache, dtype)


def _scatter_fake(latent, k_cache, slot_mapping):
    return None


@tilefuse_op("mla_scatter_kv", fake=_scatter_fake, mutates_args=("k_cache",))
def _scatter_op(latent: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _scatter(latent, k_cache, slot_mapping)


def _scatter(latent, k_cache, slot_mapping) -> None:
    rows = k_cache.view(-1, k_cache.shape[-1])
    fp8 = k_cache.shape[-1] == FP8_KV_BYTES
    values = quantize_kv_reference(latent) if fp8 else latent.to(k_cache.dtype)
    if fp8 and k_cache.dtype != torch.uint8:
        values = values.view(k_cache.dtype)
    values = values.contiguous()
    if choose_backend(latent.device) == "triton":
        # one program per token: slots < 0 (and past the cache) skipped on the device, no host sync
        width = rows.shape[1]
        block = 1 << (width - 1).bit_length()
        slots = slot_mapping.contiguous()
        num_rows = rows.shape[0]
        # what Triton specializes on: dtypes, the pointers' 16-byte alignment, num_rows == 1 or % 16
        key = (latent.device, rows.dtype, slots.dtype, width, _launch.aligned(values, slots, rows),
               _launch.specialized(num_rows))
        _scatter_kernel().launch(key, (slots.shape[0], 1, 1), latent.device.index, (values, slots, rows),
                                 (num_rows,), dict(WIDTH=width, BLOCK=block, num_warps=4))
    else:
        keep = (slot_mapping >= 0) & (slot_mapping < rows.shape[0])
        rows[slot_mapping[keep].long()] = values[keep]


@functools.cache
def _scatter_kernel():
    from tilefuse.ops.mla import kernels

    return _launch.Kernel(kernels.mla_scatter_rows_kernel)


def mla_scatter_kv(latent: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   *, check_contents: bool | None = None) -> None:
    """Write ``latent [T, 576]`` into ``k_cache`` at ``slot_mapping [T]`` (int32 / int64, ``page *
    page_size + offset``; -1: skip the token), in place.

    ``k_cache``: ``[num_blocks, page, 1, 576]`` in a floating dtype (the latent rounded to it), or
    ``[num_blocks, page, 1, 656]`` uint8 / float8_e4m3fn (quantized, :func:`mla_quantize_kv`);
    contiguous, on ``latent``'s device, ``page`` in 16-256. ``check_contents`` (default
    ``TILEFUSE_DEBUG``) reads the slots back and refuses one past the cache, and (FP8 cache) a
    non-finite latent value (a host sync); without it such a token is skipped, as a -1 is, and a
    non-finite value makes its group NaN (:func:`mla_quantize_kv`)."""
    _checks.check_tensor("latent", latent, dtypes=LATENT_DTYPES, ndim=2)
    if latent.shape[1] != HEAD_DIM:
        raise ValueError(f"latent: expected [T, {HEAD_DIM}], got shape {tuple(latent.shape)}")
    _checks.check_tensor("k_cache", k_cache, ndim=4)
    width = k_cache.shape[-1]
    if width == FP8_KV_BYTES:
        if k_cache.dtype not in FP8_CACHE_DTYPES:
            raise ValueError(f"k_cache: an FP8 cache [.., {FP8_KV_BYTES}] must be uint8 or float8_e4m3fn, got "
                             f"{k_cache.dtype}")
    elif width != HEAD_DIM or k_cache.dtype not in LATENT_DTYPES:
        raise ValueError(f"k_cache: expected [num_blocks, page, 1, {HEAD_DIM}] bf16/fp16/fp32 or [num_blocks, page, 1, "
                         f"{FP8_KV_BYTES}] uint8/float8_e4m3fn, got {k_cache.dtype} of shape {tuple(k_cache.shape)}")
    check_page_shape("k_cache", k_cache, width)
    _checks.check_contiguous("k_cache", k_cache)
    _checks.check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), ndim=1)
    if slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping: expected [T={latent.shape[0]}] like latent, got shape "
                         f"{tuple(slot_mapping.shape)}")
    _checks.check_same_device(latent=latent, k_cache=k_cache, slot_mapping=slot_mapping)
    no_data = _checks.contents_unreadable(latent, k_cache, slot_mapping)
    if _check_contents(check_contents) and slot_mapping.numel() and not no_data:
        if width == FP8_KV_BYTES:
            check_finite_latent(latent)
        top = k_cache.shape[0] * k_cache.shape[1]
        if int(slot_mapping.max()) >= top or int(slot_mapping.min()) < -1:
            raise ValueError(f"slot_mapping: expected slots in [0, {top}) or -1, got "
                             f"[{int(slot_mapping.min())}, {int(slot_mapping.max())}]")
    if no_data or use_dispatcher(latent):     # (meta / fake tensors: the op's fake, nothing to write)
        _scatter_op(latent, k_cache, slot_mapping)
    else:
        _scatter(latent, k_cache, slot_mapping)


ROPE_MODES = {"pairs": 0, "halves": 1, "complex": 2}


def decode_rows(q_lat: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, c_kv: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mode: str, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor | None:
    """A decode step's new tokens for the absorbed attention, in one launch: the query ``[b, s, h,
    576]`` it returns (the absorbed ``q_lat`` then the RoPE'd ``q_pe``) and the cache rows it writes
    (``c_kv`` then the RoPE'd ``k_pe``, row ``slots[i]`` of ``pages`` viewed ``[rows, 576]``).

    q_lat: ``[h, b*s, 512]`` contiguous (the ``bmm`` of ``q_nope`` and ``W_UK``); q_pe: ``[b, s, h,
    64]``, k_pe: ``[b, s, 64]``, c_kv: ``[b, s, 512]`` (views with unit last stride); cos / sin:
    ``[b, s, n]`` (``mode`` "pairs": the first 32 of 64 entries, "halves": all 64, both in q's dtype;
    "complex": 32 fp32 entries, any last stride); slots: ``[b*s]`` int64; pages: a contiguous cache.
    ``mode`` and the rounding are those of ``tilefuse.hf.mla``'s rotations. Returns None where
    the kernels do not run (the CPU without the interpreter, the reference backend, a layout the
    launch cannot address): the caller then runs its PyTorch ops."""
    batch, q_len, heads, _ = q_pe.shape
    rows = batch * q_len
    angles = 32 if mode != "halves" else 64
    if (tuple(q_lat.shape) != (heads, rows, HEAD_DIM_V) or q_pe.shape[-1] != 64
            or tuple(k_pe.shape) != (batch, q_len, 64)
            or tuple(c_kv.shape) != (batch, q_len, HEAD_DIM_V) or tuple(cos.shape[:2]) != (batch, q_len)
            or cos.shape[-1] < angles or cos.shape != sin.shape or slots.numel() != rows):
        return None                     # (broadcast rotations, say): the caller's PyTorch ops take it
    if (choose_backend(q_pe.device) != "triton" or q_pe.dtype not in (torch.float16, torch.bfloat16)
            or not pages.is_contiguous() or not q_lat.is_contiguous() or not c_kv.is_contiguous()
            or (mode != "complex" and (cos.dtype != q_pe.dtype or sin.dtype != q_pe.dtype))
            or cos.stride() != sin.stride() or slots.dtype != torch.int64):
        return None
    strides = []
    for t in (q_pe, k_pe, cos):            # one row stride must address (request, token) pairs
        if t.shape[1] > 1 and t.shape[0] > 1 and t.stride(0) != q_len * t.stride(1):
            return None
        strides.append(t.stride(1) if q_len > 1 else t.stride(0))
    if q_pe.stride(-1) != 1 or k_pe.stride(-1) != 1:
        return None
    q = torch.empty(batch, q_len, heads, HEAD_DIM, dtype=q_pe.dtype, device=q_pe.device)
    flat = pages.view(-1, HEAD_DIM)
    tensors = (q_lat, q_pe, k_pe, c_kv, cos, sin, slots, q, flat)
    scalars = (heads, strides[0], q_pe.stride(2), strides[1], strides[2], cos.stride(-1), flat.shape[0])
    # the compiled kernel's key: what Triton specializes on (dtypes, 16-byte alignment, integers
    # equal to 1 or multiples of 16)
    key = (q.device, q.dtype, pages.dtype, cos.dtype, mode, _launch.aligned(*tensors), _launch.specialized(*scalars))
    _rows_kernel().launch(key, (rows, heads + 1, 1), q.device.index, tensors, scalars,
                          dict(MODE=ROPE_MODES[mode], num_warps=4))
    return q


@functools.cache
def _rows_kernel():
    from tilefuse.ops.mla import kernels

    return _launch.Kernel(kernels.mla_decode_rows_kernel)
