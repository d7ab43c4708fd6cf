"""SwiGLU gate/up projection in plain PyTorch: the executable spec of ``tilefuse.swiglu``.

``h = silu(x @ Wg^T + bg) * (x @ Wu^T + bu)``, computed in ``compute_dtype`` (fp32 by default,
fp64 for comparisons) and rounded once to ``out_dtype`` (x's dtype by default).
"""

from __future__ import annotations

import torch


def swiglu_split_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                           bias_gate: torch.Tensor | None = None, bias_up: torch.Tensor | None = None, *,
                           compute_dtype: torch.dtype = torch.float32,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Separate weights.

    x: [..., H]; w_gate, w_up: [I, H]; bias_gate, bias_up: [I] or None. Returns [..., I].
    """
    xc = x.to(compute_dtype)
    gate = xc @ w_gate.to(compute_dtype).T
    up = xc @ w_up.to(compute_dtype).T
    if bias_gate is not None:
        gate = gate + bias_gate.to(compute_dtype)
    if bias_up is not None:
        up = up + bias_up.to(compute_dtype)
    out = gate * torch.sigmoid(gate) * up
    return out.to(out_dtype or x.dtype)


def swiglu_reference(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None = None, *,
                     compute_dtype: torch.dtype = torch.float32,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """vLLM's merged layout.

    x: [..., H]; w_gate_up: [2I, H] (gate rows, then up rows); bias: [2I] or None. Returns [..., I].
    """
    inter = w_gate_up.shape[0] // 2
    w_gate, w_up = w_gate_up[:inter], w_gate_up[inter:]
    bias_gate, bias_up = (None, None) if bias is None else (bias[:inter], bias[inter:])
    return swiglu_split_reference(x, w_gate, w_up, bias_gate, bias_up,
                                  compute_dtype=compute_dtype, out_dtype=out_dtype)
