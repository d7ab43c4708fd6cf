"""tilefuse: fused LLM-inference kernels for NVIDIA Hopper, in Triton.

Public ops (PyTorch custom ops under ``torch.ops.tilefuse``):

* :func:`swiglu`, :func:`pack_gate_up` -- fused SwiGLU gate/up GEMM (paper 1)
* :func:`vq_matmul` -- 2-bit VQ linear layer in AQLM's 2x8 format (paper 2)
* :func:`get_mla_metadata`, :func:`flash_mla_with_kvcache` -- MLA decode over a paged cache (paper 3)

:func:`force` pins the backend (``"triton"`` / ``"reference"``) or a kernel variant for a block.
"""

from tilefuse._backend import force  # noqa: F401
from tilefuse.ops.swiglu import swiglu  # noqa: F401

__version__ = "0.1.0"
