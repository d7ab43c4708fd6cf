"""FP8 SwiGLU gate/up projection in plain PyTorch: the executable spec of ``tilefuse.swiglu_fp8``,
and the e4m3 quantizers that produce its inputs.

Scales multiply: a dequantized value is ``e4m3 value * scale`` (the convention of
``torch._scaled_mm`` and of DeepSeek-V3 / transformers' ``weight_scale_inv``). Scale layouts:

* activations ``x [M, K]``: ``[M, K/128]`` (1 x 128 groups) or ``[M, 1]`` (per token);
* weights ``w [N, K]``: ``[N/128, K/128]`` (128 x 128 blocks) or ``[N, 1]`` (per output channel);
* a 0-dim scale (per tensor) is taken as the per-token / per-channel one, broadcast.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def dequantize(t: torch.Tensor, scales: torch.Tensor, *, weight: bool = False,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``t * scales`` in ``dtype``, each scale broadcast over its group or block (layouts above);
    ``weight``: ``t`` is a weight ``[N, K]``, whose 2-D scales are per 128 x 128 block."""
    rows, cols = t.shape[-2:]
    s = scales.to(dtype)
    if weight and s.dim() == 1:                           # [N]: per channel
        s = s[:, None]
    if weight and s.dim() == 2 and s.shape[0] != rows:   # 128 x 128 blocks
        s = s.repeat_interleave(GROUP, dim=0)[:rows].repeat_interleave(GROUP, dim=1)[:, :cols]
    elif not weight and s.dim() and s.shape[-1] != 1:     # 1 x 128 groups along K
        s = s.repeat_interleave(GROUP, dim=-1)[..., :cols]
    return t.to(dtype) * s


def quantize_fp8(t: torch.Tensor, group: int | None = GROUP, *, block: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``t [..., K]`` to e4m3 with ``scale = amax / 448`` per group (1 where amax = 0).

    ``group=128``: 1 x 128 groups along K, scales ``[..., K/128]`` (activations, the kernel's
    quantized output). ``group=None``: one scale per row, ``[..., 1]`` (per token / per channel).
    ``block=True`` (2-D ``t``, both sizes multiples of 128): 128 x 128 blocks, scales
    ``[N/128, K/128]`` (weights). Computed in fp32 (fp64 for an fp64 ``t``: the spec), the scales
    rounded to fp32 before the values are divided by them, as the kernel does. Returns
    (e4m3 tensor, fp32 scales).
    """
    x = t if t.dtype == torch.float64 else t.to(torch.float32)
    if block:
        n, k = x.shape
        groups = x.reshape(n // GROUP, GROUP, k // GROUP, GROUP).transpose(1, 2)   # [N/128, K/128, 128, 128]
        reduce = (-2, -1)
    else:
        size = x.shape[-1] if group is None else group
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
        reduce = (-1,)
    amax = groups.abs().amax(dim=reduce, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (groups / scale.to(x.dtype)).clamp(-FP8_MAX, FP8_MAX)
    if block:
        q, scale = q.transpose(1, 2).reshape(n, k), scale[..., 0, 0]
    else:
        q, scale = q.reshape(x.shape), scale[..., 0]
    return q.to(FP8), scale


def swiglu_fp8_reference(x: torch.Tensor, x_scales: torch.Tensor, w_gate_up: torch.Tensor,
                         w_scales: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                         compute_dtype: torch.dtype = torch.float64):
    """x: [M, K] e4m3 with x_scales; w_gate_up: [2I, K] e4m3 (gate rows, then up rows) with
    w_scales (layouts in the module docstring).

    ``h = silu(Xd Wgd^T) * (Xd Wud^T)`` from the dequantized operands in ``compute_dtype``. Returns
    ``h`` in ``out_dtype``; for ``out_dtype = float8_e4m3fn`` the pair (``h`` quantized in 1 x 128
    groups by :func:`quantize_fp8` from the ``compute_dtype`` values, fp32 scales ``[M, I/128]``).
    Leading dimensions of ``x`` (and of ``x_scales``) are kept.
    """
    inter = w_gate_up.shape[0] // 2
    xd = dequantize(x, x_scales, dtype=compute_dtype)
    wd = dequantize(w_gate_up, w_scales, weight=True, dtype=compute_dtype)
    gate, up = xd @ wd[:inter].T, xd @ wd[inter:].T
    h = gate * torch.sigmoid(gate) * up
    if out_dtype == FP8:
        return quantize_fp8(h)
    return h.to(out_dtype)
