"""Baselines of the quality study and the error metric they are compared with.

Both baselines return the *dense* approximation of the weight (what a layer would compute with),
in float32, so any quantizer can be scored by :func:`relative_output_error`.
"""

from __future__ import annotations

import torch

from tilefuse.quantizer import _core


def rtn(weight: torch.Tensor, bits: int, group: int = 128) -> torch.Tensor:
    """Round-to-nearest, asymmetric min-max, one (scale, zero) per ``group`` input dims of a row.

    weight: [N, K] float -> [N, K] float32. When K is not a multiple of ``group`` the last group of
    each row is shorter (e.g. K = 576 with group 128: four groups of 128 and one of 64). Storage:
    ``bits`` per weight plus two 16-bit numbers per group.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dimensions [N, K], got shape {tuple(weight.shape)}")
    if not 1 <= bits <= 16:
        raise ValueError(f"bits: expected 1..16, got {bits}")
    w = weight.detach().float()
    levels = 2 ** bits - 1
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group):
        part = w[:, start:start + group]
        low = part.amin(1, keepdim=True)
        step = (part.amax(1, keepdim=True) - low) / levels
        step = torch.where(step > 0, step, torch.ones_like(step))
        out[:, start:start + group] = torch.round((part - low) / step).clamp(0, levels) * step + low
    return out


def kmeans_vq(weight: torch.Tensor, dim: int = 4, entries: int = 256, calib: torch.Tensor | None = None, *,
              iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Plain VQ: per-row RMS scale, one k-means codebook of ``entries`` ``dim``-vectors, no refinement.

    weight: [N, K] float (K a multiple of ``dim``) -> [N, K] float32. With the defaults this is
    ``log2(256) / 4 = 2`` bits per weight, the same code budget as AQLM 2x8 (16 bits per 8 weights).
    ``calib`` ([K, K]) weights the k-means by its ``dim x dim`` diagonal blocks, like :func:`quantize`.
    """
    num_rows, k = weight.shape
    if k % dim:
        raise ValueError(f"weight: expected K a multiple of dim={dim}, got shape {tuple(weight.shape)}")
    w = weight.detach().float().reshape(num_rows, k // dim, dim)
    scales = _core.row_rms(w)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    blocks = _core.group_blocks(calib.to(w.device), dim) if calib is not None else None
    generator = torch.Generator(device=w.device).manual_seed(seed)
    book, codes = _core.kmeans(w / scales[:, None, None], _core.row_weights(scales), blocks, entries, iters,
                               generator)
    return (book[codes] * scales[:, None, None]).reshape(num_rows, k)


def relative_output_error(weight: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor | None = None) -> float:
    """``||X (W - W_hat)^T||_F / ||X W^T||_F`` computed from ``gram = X^T X`` ([K, K]), in float64.

    Without ``gram`` (``X = I``) this is the relative Frobenius error of the weight itself.
    """
    w = weight.detach().double()
    diff = w - approx.detach().to(w.device).double()
    if gram is None:
        return (diff.norm() / w.norm()).item()
    g = gram.to(w.device).double()
    num = ((diff @ g) * diff).sum().clamp_min(0)
    den = ((w @ g) * w).sum()
    return (num / den).sqrt().item()
