"""Tensor parallelism over several GPUs with ``torch.distributed`` (docs/parallel.md).

A package of wrappers rather than a ``tp_group`` argument on the one-device modules: a shard is
an ordinary :class:`~tilefuse.nn.FusedSwiGLUMLP`, :class:`~tilefuse.nn.VQLinear`, ``nn.Linear``
or :class:`~tilefuse.nn.MLADecodeAttention` over this rank's slice of the tensors, so the kernels,
their call plans and their tests apply to it unchanged, and the wrapper adds only the collective
its layout needs (:mod:`tilefuse.parallel.layers`).

* :func:`shard` -- a full module -> this rank's shard; :func:`shard_model` -- every decoder block
  of an HF Llama-family model (dense, fused or 2-bit VQ) or DeepSeek-V2/V3 model (MLA heads split,
  for :func:`tilefuse.hf.patch_mla`).
* :class:`ParallelSwiGLUMLP`, :class:`ColumnParallel`, :class:`RowParallel`,
  :class:`ParallelMLADecodeAttention` -- the sharded modules.
* :mod:`tilefuse.parallel.hf` -- ``patch_swiglu`` / ``patch_vq`` / ``patch_mla`` for models that
  transformers loaded with ``tp_plan="auto"`` (DTensor weights).
* :func:`placement` -- rank and world size in a group; every world-size error comes from
  :func:`tilefuse.parallel.group.split` and names the argument.
"""

from tilefuse._lazy import lazy_attribute

_PUBLIC = {
    "shard": "tilefuse.parallel.sharding",
    "shard_model": "tilefuse.parallel.sharding",
    "ColumnParallel": "tilefuse.parallel.layers",
    "RowParallel": "tilefuse.parallel.layers",
    "ParallelSwiGLUMLP": "tilefuse.parallel.layers",
    "ParallelMLADecodeAttention": "tilefuse.parallel.mla",
    "placement": "tilefuse.parallel.group",
    "Placement": "tilefuse.parallel.group",
    "hf": "tilefuse.parallel.hf",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
    return lazy_attribute(__name__, _PUBLIC, name)
