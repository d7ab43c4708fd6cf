"""tilefuse: fused LLM-inference kernels for NVIDIA Hopper, in Triton.

Public ops (PyTorch custom ops under ``torch.ops.tilefuse``):

* :func:`swiglu`, :func:`pack_gate_up` -- fused SwiGLU gate/up GEMM (paper 1)
* :func:`vq_matmul` -- 2-bit VQ linear layer in AQLM's 2x8 format (paper 2); :func:`vq_swiglu`, two of
  them as a gated MLP's gate/up projection with the SwiGLU epilogue; :func:`vq_moe`, an MoE block's
  2-bit experts with the routing read on the device
* :func:`get_mla_metadata`, :func:`flash_mla_with_kvcache` -- MLA decode over a paged cache (paper 3)
* :func:`quantize` -- dense weight -> 2x8 codes, codebooks, scales (:mod:`tilefuse.quantizer`)

:func:`force` pins the backend (``"triton"`` / ``"reference"``) or a kernel variant for a block;
:func:`explain` says which path a call takes and why (candidates and predicted times).
Each family is imported on first use, so ``import tilefuse`` stays cheap and side-effect free.
"""

from tilefuse._lazy import lazy_attribute

from tilefuse._backend import force  # noqa: F401
from tilefuse._registry import FAMILIES

__version__ = "0.1.0"

_PUBLIC = {
    **{name: family.op_module for family in FAMILIES.values() for name in family.public},
    "nn": "tilefuse.nn",
    "quantize": "tilefuse.quantizer",
    "explain": "tilefuse._dispatch",
    "quantizer": "tilefuse.quantizer",
    "hf": "tilefuse.hf",
    "parallel": "tilefuse.parallel",
}

__all__ = ["force", *_PUBLIC]


def __getattr__(name):
    return lazy_attribute(__name__, _PUBLIC, name)
