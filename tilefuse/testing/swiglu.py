"""Cases for the SwiGLU family, shared by the tests and ``tilefuse bench swiglu``.

``SHAPES`` (model -> (H, I)), ``make_case()`` (random inputs), ``reference_fp64()`` (the spec in fp64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Qwen2.5 MLP shapes: model -> (H, I).
SHAPES = {
    "0.5B": (896, 4864),
    "1.5B": (1536, 8960),
    "3B": (2048, 11008),
    "7B": (3584, 18944),
    "14B": (5120, 13824),
    "32B": (5120, 27648),
    "72B": (8192, 29568),
}
BENCH_M = (1, 16, 128, 1024, 4096, 16384)


@dataclass
class SwiGLUCase:
    x: torch.Tensor                   # [M, H] (or [*lead, H])
    w_gate_up: torch.Tensor           # [2I, H], merged layout
    bias: torch.Tensor | None         # [2I] or None

    def args(self):
        return self.x, self.w_gate_up, self.bias

    def __iter__(self):               # x, w, bias = make_case(...)
        return iter(self.args())


def make_case(m: int, hidden: int, inter: int, dtype: torch.dtype, device, *, bias: bool = False,
              lead: tuple[int, ...] | None = None) -> SwiGLUCase:
    """Random ``x: [m, H]`` (or ``[*lead, H]``), ``w_gate_up: [2I, H]`` (merged), ``bias: [2I]`` or None.

    Weights are scaled by ``1/sqrt(H)`` so gate and up are O(1) like a trained layer's (SiLU then
    works on both its curved and its linear part) and never all-zero.
    """
    shape = (*lead, hidden) if lead else (m, hidden)
    x = torch.randn(shape, device=device).to(dtype)
    w = (torch.randn(2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype)
    b = (0.5 * torch.randn(2 * inter, device=device)).to(dtype) if bias else None
    return SwiGLUCase(x, w, b)


def reference_fp64(case: SwiGLUCase | torch.Tensor, w_gate_up: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fp64 spec (merged layout), not rounded: what every output is compared against.
    ``reference_fp64(case)``, or ``reference_fp64(x, w_gate_up, bias)`` for a part of a case's rows."""
    from tilefuse.ops.swiglu.reference import swiglu_reference

    x, w_gate_up, bias = case.args() if isinstance(case, SwiGLUCase) else (case, w_gate_up, bias)
    return swiglu_reference(x, w_gate_up, bias, compute_dtype=torch.float64, out_dtype=torch.float64)
