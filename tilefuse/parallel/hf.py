"""``patch_swiglu``, ``patch_vq`` and ``patch_mla`` for Hugging Face models loaded with transformers'
tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

Why :mod:`tilefuse.hf`'s patchers do not apply as they are: transformers (5.x) keeps such a
model's weights as DTensors of the *global* shape (``Shard(0)`` for its "colwise" q/k/v/gate/up
projections, ``Shard(1)`` for "rowwise" o/down) and swaps the local tensors in around each
Linear's forward. :func:`tilefuse.hf.patch_swiglu` concatenates gate and up into one weight, which
stays a DTensor; the fused op then meets a DTensor weight and a plain activation (on a CPU PyTorch
refuses the mix: "aten.mm.default got mixed torch.Tensor and DTensor"; on CUDA the kernel is
launched with the DTensor's pointer: an illegal memory access), and tilefuse's custom ops have no
DTensor sharding rule to run on shards. :func:`tilefuse.hf.patch_vq` would quantize the global
weight into a one-device layer and drop the module's tensor-parallel forward.
:func:`tilefuse.hf.patch_mla`'s absorbed decode slices ``kv_b_proj``'s weight per head, which
there is a DTensor of the global shape.

Here each module is rebuilt from its local shards (``DTensor.to_local()``) as a tilefuse
tensor-parallel module (:mod:`tilefuse.parallel.layers`) whose collective runs on the DTensor's
mesh group; the fused kernels then see plain tensors. On a model without DTensor weights both
functions are :mod:`tilefuse.hf`'s.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist
from torch import nn

from tilefuse.parallel.group import Placement, split
from tilefuse.parallel.layers import ColumnParallel, ParallelSwiGLUMLP, RowParallel
from tilefuse.parallel.sharding import (MLA_HEAD_ROWS, columns_of, is_mla_attention, linear_from, local_swiglu,
                                        rows_of, swiglu_mlp_class)


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:       # torch without distributed tensors: nothing is one
        return None
    return DTensor


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (a transformers ``tp_plan`` model)."""
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def split_style(param) -> tuple[Placement | None, str | None]:
    """(placement in the DTensor's 1-D mesh, ``"column"`` / ``"row"`` / None) of a Linear weight;
    (None, None) for a plain tensor."""
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(param, dtensor):
        return None, None
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"model: expected weights on a 1-D tensor-parallel device mesh, got a mesh of "
                         f"{mesh.ndim} dimensions {tuple(mesh.mesh_dim_names or ())}")
    where = Placement(mesh.get_group(), mesh.get_local_rank(), mesh.size())
    (place,) = param.placements
    if place.is_shard():
        return where, "column" if place.dim == 0 else "row"
    return where, None


def _local(tensor):
    if tensor is None:
        return None
    tensor = tensor.detach()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor):
    if tensor is None:
        return None
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def patch_swiglu(model: nn.Module, layout: str = "merged") -> int:
    """:func:`tilefuse.hf.patch_swiglu` for a ``tp_plan`` model: every SwiGLU MLP (gate/up "colwise",
    down "rowwise") becomes a :class:`~tilefuse.parallel.ParallelSwiGLUMLP` over this rank's
    shards, whose one all-reduce replaces the down projection's. Returns the number replaced."""
    from tilefuse.hf import patch_swiglu as patch_one_device

    if not is_tensor_parallel(model):
        return patch_one_device(model, layout)
    mlp_class = swiglu_mlp_class(model)
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ == mlp_class]
    for name, mlp in targets:
        styles = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            where, styles[proj] = split_style(getattr(mlp, proj).weight)
        if styles != {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}:
            raise ValueError(f"model: expected {name} with gate_proj/up_proj colwise and down_proj rowwise "
                             f"(transformers' tp plan), got {styles}")
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        local = local_swiglu(_local(gate.weight), _local(up.weight), _local(gate.bias), _local(up.bias),
                             _local(down.weight), _local(down.bias) if where.rank == 0 else None, mlp.act_fn, layout)
        model.set_submodule(name, ParallelSwiGLUMLP(local, where))
    return len(targets)


def patch_mla(model: nn.Module, attention=None) -> int:
    """:func:`tilefuse.hf.patch_mla` for a DeepSeek-V2/V3 ``tp_plan`` model: every MLA attention is
    rebuilt on this rank's heads from its local shards, then patched to decode over a
    :class:`tilefuse.hf.PagedMLACache` (each rank its own, holding the whole latent).

    transformers' plan for these models cuts ``q_b_proj`` (``q_proj``) and ``kv_b_proj`` colwise and
    ``o_proj`` rowwise; here they become, as :func:`tilefuse.parallel.sharding.mla_attention_of`
    builds them: ``q_b_proj`` a :class:`~tilefuse.parallel.ColumnParallel` of the local rows,
    ``kv_b_proj`` a plain ``nn.Linear`` of them (``W_UK`` / ``W_UV`` of the rank's heads, which the
    absorbed decode slices), ``o_proj`` a :class:`~tilefuse.parallel.RowParallel` whose all-reduce
    runs on the DTensor's mesh group (bias on rank 0); ``kv_a_proj_with_mqa`` (replicated, wrapped
    by transformers only for training gradients) a plain ``nn.Linear``. ``attention``: the decode
    attention, as :func:`tilefuse.hf.patch_mla`'s (None: tilefuse's; or a module with FlashMLA's
    API). Returns the number of attention modules patched; on a model without DTensor weights
    this is :func:`tilefuse.hf.patch_mla`.

    Raises ValueError (naming ``model`` or ``world_size``) for a model that is not DeepSeek-V2/V3
    with the op's latent, projections not split as above, or heads the mesh does not cut evenly.
    """
    from tilefuse.hf.mla import check_mla_config
    from tilefuse.hf.mla import patch_mla as patch_one_device

    if not is_tensor_parallel(model):
        return patch_one_device(model, attention)
    config = getattr(model, "config", None)
    check_mla_config(config, "model")
    heads = int(config.num_attention_heads)
    for name, attn in [(n, m) for n, m in model.named_modules() if is_mla_attention(m)]:
        q_name = next((n for n in MLA_HEAD_ROWS if isinstance(getattr(attn, n, None), nn.Linear)), None)
        styles, where = {}, None
        for proj in (q_name, "kv_b_proj", "o_proj"):
            linear = getattr(attn, proj, None) if proj is not None else None
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"model: expected {name}.{proj or 'q_b_proj'} to be an nn.Linear, "
                                 f"got {type(linear).__name__}")
            place, styles[proj] = split_style(linear.weight)
            where = where or place
        if styles != {q_name: "column", "kv_b_proj": "column", "o_proj": "row"}:
            raise ValueError(f"model: expected {name} with {q_name} and kv_b_proj colwise and o_proj rowwise "
                             f"(transformers' tp plan), got {styles}")
        split(heads, where.world_size, "config.num_attention_heads",
              why="each rank runs num_attention_heads / world_size MLA query heads")
        q, kv_b, o = getattr(attn, q_name), attn.kv_b_proj, attn.o_proj
        setattr(attn, q_name, ColumnParallel(linear_from(_local(q.weight), _local(q.bias)), where))
        attn.kv_b_proj = linear_from(_local(kv_b.weight), _local(kv_b.bias))
        attn.o_proj = RowParallel(linear_from(_local(o.weight), _full(o.bias) if where.rank == 0 else None), where)
        kv_a = attn.kv_a_proj_with_mqa
        attn.kv_a_proj_with_mqa = linear_from(_full(kv_a.weight), _full(kv_a.bias))
    return patch_one_device(model, attention)


def patch_vq(model: nn.Module, calibration=None, *, random_codes: bool = False, targets: tuple[str, ...] | None = None,
             seed: int = 0, progress: bool | None = None, **quantize_opts) -> int:
    """:func:`tilefuse.hf.patch_vq` for a ``tp_plan`` model: every target projection is quantized
    whole (its global weight gathered; layer i on rank ``i % world_size``, then broadcast, so all
    ranks hold the same codes, codebooks and scales), and becomes a :class:`~tilefuse.parallel.ColumnParallel`
    (colwise weights: this rank's rows) or :class:`~tilefuse.parallel.RowParallel` (rowwise: its K
    groups) 2x8 layer; replicated targets become plain ``VQLinear``. Returns the number replaced.

    ``calibration`` must be None here: each rank sees only its shard of a rowwise layer's inputs,
    so ``X^T X`` is not at hand; quantize with calibration on one device and shard the result with
    :func:`tilefuse.parallel.shard_model` instead. ``progress`` (default: on when quantizing, off
    for ``random_codes``) prints one line per layer to stderr.
    """
    from tilefuse.hf import VQ_PROJECTIONS
    from tilefuse.hf import patch_vq as patch_one_device

    targets = VQ_PROJECTIONS if targets is None else targets
    if not is_tensor_parallel(model):
        return patch_one_device(model, calibration, random_codes=random_codes, targets=targets, seed=seed,
                                progress=progress, **quantize_opts)
    if calibration is not None:
        raise ValueError("calibration: expected None for a tensor-parallel model (a rank sees only its shard of a "
                         "rowwise layer's inputs); calibrate on one device and use tilefuse.parallel.shard_model, "
                         "got token ids")
    layers = [(name, mod) for name, mod in model.named_modules()
              if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in targets]
    if not layers:
        raise ValueError(f"model: expected nn.Linear modules named {tuple(targets)}, found none")
    if progress is None:
        progress = not random_codes
    for i, (name, linear) in enumerate(layers):
        start = time.perf_counter()
        where, style = split_style(linear.weight)
        weight, bias = _full(linear.weight), _full(linear.bias)
        layer = _quantized_everywhere(weight, bias, where, owner=i, random_codes=random_codes, seed=seed + i,
                                      **quantize_opts)
        if style == "column":
            layer = ColumnParallel(rows_of(layer, where), where)
        elif style == "row":
            layer = RowParallel(columns_of(layer, where), where)
        model.set_submodule(name, layer)
        if progress:
            print(f"patch_vq [{i + 1}/{len(layers)}] {name} {style or 'replicated'} {tuple(weight.shape)} "
                  f"({time.perf_counter() - start:.2f} s)", file=sys.stderr, flush=True)
    return len(layers)


def _quantized_everywhere(weight, bias, where: Placement | None, owner: int, random_codes: bool, seed: int,
                          **quantize_opts) -> nn.Module:
    """A full VQLinear of ``weight``, quantized on rank ``owner % world_size`` and broadcast to all."""
    from tilefuse.hf import patch_vq as patch_one_device
    from tilefuse.nn.vq import VQLinear

    world = 1 if where is None else where.world_size
    src = owner % world
    if where is None or where.rank == src:
        holder = nn.Module()
        holder.proj = linear_from(weight, bias)
        patch_one_device(holder, random_codes=random_codes, targets=("proj",), seed=seed, **quantize_opts)
        layer = holder.proj
    else:
        layer = VQLinear(weight.shape[1], weight.shape[0], bias is not None, dtype=weight.dtype, device=weight.device)
    if world > 1:
        root = dist.get_global_rank(where.group, src) if where.group is not None else src
        for tensor in (layer.codes, layer.codebooks, layer.scales, layer.bias):
            if tensor is not None:
                dist.broadcast(tensor, src=root, group=where.group)
    return layer
