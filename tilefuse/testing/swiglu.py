"""Cases for the SwiGLU family, shared by the tests and ``tilefuse bench swiglu``.

``SHAPES`` (model -> (H, I)), ``make_case()`` (random inputs), ``reference_fp64()`` (the spec in fp64);
for ``swiglu_fp8``: ``LLAMA3_SHAPES``, ``make_fp8_case()``, ``reference_fp8_fp64()``.
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


# ----------------------------------------------------------------------------- FP8
# Llama-3 MLP shapes (H, I), held out of the tuning table: the FP8 benchmark's and the bf16 one's
# extra cases.
LLAMA3_SHAPES = {"L3-8B": (4096, 14336), "L3-70B": (8192, 28672)}
# Scale layouts: activations "group" (1 x 128) | "token" | "tensor"; weights "block" (128 x 128) |
# "channel" | "tensor".
X_SCALINGS = ("group", "token", "tensor")
W_SCALINGS = ("block", "channel", "tensor")


@dataclass
class SwiGLUFp8Case:
    x: torch.Tensor                   # [M, K] (or [*lead, K]) float8_e4m3fn
    x_scales: torch.Tensor            # [M, K/128] | [M, 1] | [] fp32
    w_gate_up: torch.Tensor           # [2I, K] float8_e4m3fn, merged
    w_scales: torch.Tensor            # [2I/128, K/128] | [2I, 1] | [] fp32

    def args(self):
        return self.x, self.x_scales, self.w_gate_up, self.w_scales


def make_fp8_case(m: int, hidden: int, inter: int, device, *, x_scaling: str = "group", w_scaling: str = "block",
                  lead: tuple[int, ...] | None = None) -> SwiGLUFp8Case:
    """Random bf16-like inputs quantized to e4m3 with the chosen scale layouts (as a model's FP8
    checkpoint and its dynamic activation quantization would give). Rows of x and blocks of w get
    magnitudes spread over 2^-4..2^4, so the scales differ per group and block and a kernel that
    applies a wrong one fails."""
    from tilefuse.ops.swiglu_fp8.reference import quantize_fp8

    shape = (*lead, hidden) if lead else (m, hidden)
    groups = -(-hidden // 128)
    x_mag = torch.exp2(torch.randint(-4, 5, (*shape[:-1], groups), device=device).float())
    x = torch.randn(shape, device=device) * x_mag.repeat_interleave(128, -1)[..., :hidden]
    w_mag = torch.exp2(torch.randint(-2, 3, (-(-2 * inter // 128), 1), device=device).float())
    w = torch.randn(2 * inter, hidden, device=device) * hidden ** -0.5 * w_mag.repeat_interleave(128, 0)[:2 * inter]
    if x_scaling == "tensor":
        xq, xs = quantize_fp8(x.reshape(1, -1), None)
        xq, xs = xq.reshape(shape), xs.reshape(())
    else:
        xq, xs = quantize_fp8(x, 128 if x_scaling == "group" else None)
    if w_scaling == "tensor":
        wq, ws = quantize_fp8(w.reshape(1, -1), None)
        wq, ws = wq.reshape(w.shape), ws.reshape(())
    else:
        wq, ws = quantize_fp8(w, None, block=w_scaling == "block")
    return SwiGLUFp8Case(xq, xs, wq, ws)


def reference_fp8_fp64(case: SwiGLUFp8Case, rows=None) -> torch.Tensor:
    """The fp64 spec of ``swiglu_fp8`` (unrounded ``h``), optionally for some rows of x only."""
    from tilefuse.ops.swiglu_fp8.reference import swiglu_fp8_reference

    x, xs, w, ws = case.args()
    if rows is not None:
        x = x[rows]
        xs = xs[rows] if xs.dim() else xs
    return swiglu_fp8_reference(x, xs, w, ws, out_dtype=torch.float64)
