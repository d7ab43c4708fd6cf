"""``tilefuse.swiglu``: validation, dispatch and custom-op registration.

Kernels live in ``kernels.py`` (Triton), the spec in ``reference.py``.
"""

from __future__ import annotations

import torch

from tilefuse import _checks
from tilefuse._backend import choose_backend
from tilefuse._library import tilefuse_op
from tilefuse.ops.swiglu.reference import swiglu_reference

LAYOUTS = ("merged", "packed")


def kernel_status(device: torch.device) -> dict[str, str]:
    """Which SwiGLU kernel variants run on ``device`` ("ok" or why not)."""
    return {"*": "not implemented yet: reference path"}


def _swiglu_fake(x, w_gate_up, bias, layout):
    return x.new_empty(*x.shape[:-1], w_gate_up.shape[0] // 2)


@tilefuse_op("swiglu", fake=_swiglu_fake)
def _swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    if choose_backend(x.device) == "triton":
        raise NotImplementedError("the Triton SwiGLU kernels are not implemented yet")
    return swiglu_reference(x, w_gate_up, bias)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None = None, *,
           layout: str = "merged") -> torch.Tensor:
    """Fused ``silu(x @ Wg^T + bg) * (x @ Wu^T + bu)``; the ``[M, 2I]`` intermediate never reaches HBM.

    Parameters
    ----------
    x : [..., H] bf16 or fp16
    w_gate_up : [2I, H], x's dtype. ``layout="merged"``: vLLM's layout, the I gate rows then the
        I up rows. ``layout="packed"``: the output of :func:`tilefuse.pack_gate_up`.
    bias : [2I] or None, in the same row order as ``w_gate_up``.

    Returns
    -------
    [..., I] in x's dtype. SiLU is computed in fp32 on the fp32 accumulator, one rounding at the end.
    """
    _checks.check_tensor("x", x, dtypes=_checks.FLOAT16S, min_ndim=1)
    _checks.check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=2)
    _checks.check_choice("layout", layout, LAYOUTS)
    hidden = x.shape[-1]
    _checks.check_shape("w_gate_up", w_gate_up, (None, hidden), f"[2I, H={hidden}]")
    _checks.check_multiple("x", hidden, 8, "H (last dimension)")
    _checks.check_multiple("w_gate_up", w_gate_up.shape[0], 16, "2I (rows; I a multiple of 8)")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=(x.dtype,), ndim=1)
        _checks.check_shape("bias", bias, (w_gate_up.shape[0],), f"[2I={w_gate_up.shape[0]}]")
    _checks.check_same_device(x=x, w_gate_up=w_gate_up, bias=bias)
    _checks.check_contiguous("w_gate_up", w_gate_up)
    return _swiglu(x, w_gate_up, bias, layout)
