"""The kernel families, in one place.

Each family is an op package ``tilefuse/ops/<name>/`` (``kernels*.py``, ``configs.py``, ``op.py``,
``reference.py``); its ``op.py`` provides the public functions, ``kernel_status(device)`` and, where
the family dispatches among paths, ``explain(*args)``. Everything that lists the families reads
:data:`FAMILIES`: the variants ``tilefuse.force`` accepts (``_backend``), the lazy public names
(``tilefuse.__init__``), ``tilefuse.explain`` (``_dispatch``), ``tilefuse info`` and the benchmark
list (``cli``, ``bench.runner``). A new family is its package plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One kernel family: its ``name`` (the package under ``tilefuse/ops``), the ``public``
    functions of its ``op.py`` exported as ``tilefuse.<name>``, the kernel ``variants`` its dispatch
    picks among (what ``tilefuse.force(variant=...)`` pins), the public function whose calls
    ``tilefuse.explain`` describes (None: it has no explainer; ``op.explain``), the one-line
    ``bench`` help, and other public functions ``tilefuse.explain`` describes
    (``also_explained``: ``op.explain_<name>`` each)."""
    name: str
    public: tuple[str, ...]
    variants: tuple[str, ...]
    explained: str | None
    bench: str
    also_explained: tuple[str, ...] = ()

    @property
    def op_module(self) -> str:
        return f"tilefuse.ops.{self.name}.op"


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("swiglu", ("swiglu", "pack_gate_up"), ("small_m", "large_m", "pingpong", "unfused"), "swiglu",
           "fused SwiGLU gate/up GEMM (bf16) against cuBLAS, PyTorch, torch.compile"),
    Family("swiglu_fp8", ("swiglu_fp8",), ("tl", "ws", "decode", "unfused"), "swiglu_fp8",
           "FP8 fused SwiGLU against cuBLASLt's torch._scaled_mm (sm_90 GPUs)"),
    Family("mla", ("get_mla_metadata", "flash_mla_with_kvcache", "mla_quantize_kv", "mla_dequantize_kv",
                   "mla_scatter_kv"), ("transposed", "standard", "wgmma"),
           "flash_mla_with_kvcache", "MLA decode over a paged latent cache against FlashMLA (if installed), PyTorch"),
    Family("vq", ("vq_matmul", "vq_swiglu", "vq_moe"), ("decode", "decode_tl", "mma", "small", "prefill", "dequant"), "vq_matmul",
           "2-bit VQ linear (AQLM 2x8) against fp16 cuBLAS, and AQLM's own kernels", ("vq_swiglu", "vq_moe")),
)}


def family_of_op(name: str) -> Family | None:
    """The family whose public function ``name`` is (``"vq_matmul"`` -> vq), or None."""
    return next((f for f in FAMILIES.values() if name in f.public), None)
