"""Cut full (one-device) modules into this rank's tensor-parallel shard.

* :func:`shard` -- one module: a SwiGLU MLP (:class:`~tilefuse.nn.FusedSwiGLUMLP` or an HF-style
  MLP) becomes a :class:`~tilefuse.parallel.ParallelSwiGLUMLP`; an ``nn.Linear`` or
  :class:`~tilefuse.nn.VQLinear` a :class:`~tilefuse.parallel.ColumnParallel` or
  :class:`~tilefuse.parallel.RowParallel` (``style=``); an :class:`~tilefuse.nn.MLADecodeAttention`
  a :class:`~tilefuse.parallel.ParallelMLADecodeAttention`.
* :func:`shard_model` -- every decoder block of a Llama, Mistral, Qwen2 or Qwen3 model, the
  layout of transformers' own plan for them (q/k/v and gate/up column-parallel, o and down
  row-parallel), dense or after :func:`tilefuse.hf.patch_swiglu` / :func:`tilefuse.hf.patch_vq`;
  and of a DeepSeek-V2/V3 model (:func:`mla_attention_of`: the MLA heads split, the latent path
  replicated), before or after :func:`tilefuse.hf.patch_mla`.

Every rank builds the same full module (same seed or checkpoint) and keeps its part; the shards
are copies, so the caller may drop the full module afterwards. VQ codebooks and per-row scales
are replicated: a 2x8 layer shards by rows (codes and scales of its output rows) or by K groups
(the codes of its input groups of 8; each rank applies every row's scale to its partial sum).
"""

from __future__ import annotations

import torch
from torch import nn

from tilefuse.nn.mla import MLADecodeAttention
from tilefuse.nn.swiglu import FusedSwiGLUMLP
from tilefuse.nn.vq import VQLinear
from tilefuse.parallel.group import Placement, placement, split
from tilefuse.parallel.layers import ColumnParallel, ParallelSwiGLUMLP, RowParallel
from tilefuse.parallel.mla import ParallelMLADecodeAttention

STYLES = ("column", "row")
# Attribute names -> style in the decoder blocks shard_model handles (transformers' tp plan of
# these models: "colwise" / "rowwise").
COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_NAMES = ("o_proj", "down_proj")


# ----------------------------------------------------------------------------- local shards
def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous and in memory of its own: a slice of a larger tensor (a rank's rows
    of a weight) is copied, so a shard does not keep the full weight alive."""
    tensor = tensor.contiguous()
    if tensor.device.type != "meta" and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool = False) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight [N, K]`` and ``bias [N]`` (no initialization pass), each in
    memory of its own (a slice of a larger tensor is copied)."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(_owned(weight), requires_grad=requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(_owned(bias), requires_grad=requires_grad)
    return layer


def _vq_from(layer: VQLinear, codes, scales, bias) -> VQLinear:
    part = VQLinear(codes.shape[1] * 8, codes.shape[0], bias is not None, dtype=layer.codebooks.dtype,
                    codes_dtype=layer.codes.dtype, device=layer.codes.device)
    return part.load_quantized(codes, layer.codebooks, scales, bias)


def _check_linear(module) -> None:
    if not isinstance(module, (nn.Linear, VQLinear)):
        raise ValueError(f"module: expected an nn.Linear or a VQLinear for a column/row split, "
                         f"got {type(module).__name__}")


def rows_of(module: nn.Module, where: Placement) -> nn.Module:
    """This rank's output rows of an ``nn.Linear`` / ``VQLinear`` (weights or codes, scales, bias)."""
    _check_linear(module)
    split(module.out_features, where.world_size, "out_features", why="each rank holds out_features / world_size output rows")
    rows = where.part(module.out_features)
    bias = None if module.bias is None else module.bias.detach()[rows]
    if isinstance(module, VQLinear):
        return _vq_from(module, module.codes[rows], module.scales[rows], bias)
    return linear_from(module.weight.detach()[rows], bias, module.weight.requires_grad)


def columns_of(module: nn.Module, where: Placement) -> nn.Module:
    """This rank's input columns of an ``nn.Linear`` / ``VQLinear`` (K groups of 8 for VQ); the
    bias goes to rank 0 only."""
    _check_linear(module)
    multiple = 8 if isinstance(module, VQLinear) else 1
    split(module.in_features, where.world_size, "in_features", multiple,
          why="each rank holds in_features / world_size input columns" + (", whole groups of 8 for 2x8 VQ" if multiple > 1 else ""))
    cols = where.part(module.in_features)
    bias = module.bias.detach() if module.bias is not None and where.rank == 0 else None
    if isinstance(module, VQLinear):
        groups = slice(cols.start // 8, cols.stop // 8)
        return _vq_from(module, module.codes[:, groups], module.scales, bias)
    return linear_from(module.weight.detach()[:, cols], bias, module.weight.requires_grad)


def _gate_up(mlp: nn.Module):
    """(w_gate, w_up, b_gate, b_up, down Linear, act, layout) of a FusedSwiGLUMLP or HF-style MLP."""
    if isinstance(mlp, FusedSwiGLUMLP):
        w = mlp.gate_up_weight.detach()
        if mlp.layout == "packed":
            from tilefuse.ops.swiglu.op import unpack_gate_up

            w_gate, w_up = unpack_gate_up(w)
        else:
            w_gate, w_up = w[:mlp.intermediate_size], w[mlp.intermediate_size:]
        b = mlp.gate_up_bias
        b_gate, b_up = (None, None) if b is None else (b.detach()[:mlp.intermediate_size],
                                                        b.detach()[mlp.intermediate_size:])
        return w_gate, w_up, b_gate, b_up, mlp.down_proj, nn.SiLU(), mlp.layout
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), nn.Linear):
            raise ValueError(f"mlp.{name}: expected an nn.Linear, got {type(getattr(mlp, name, None)).__name__}")
    bias = lambda lin: None if lin.bias is None else lin.bias.detach()  # noqa: E731
    return (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), bias(mlp.gate_proj), bias(mlp.up_proj),
            mlp.down_proj, getattr(mlp, "act_fn", None), "merged")


def local_swiglu(w_gate, w_up, b_gate, b_up, w_down, b_down, act, layout: str) -> FusedSwiGLUMLP:
    """A FusedSwiGLUMLP over one rank's tensors (gate/up rows ``[I/w, H]``, down columns ``[H, I/w]``,
    ``b_down`` on rank 0 only), through ``FusedSwiGLUMLP.from_mlp`` and its checks."""
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = linear_from(w_gate, b_gate), linear_from(w_up, b_up)
    mlp.down_proj, mlp.act_fn = linear_from(w_down, b_down), act
    return FusedSwiGLUMLP.from_mlp(mlp, layout=layout)


def swiglu_of(mlp: nn.Module, where: Placement, layout: str | None = None) -> FusedSwiGLUMLP:
    """This rank's FusedSwiGLUMLP: its slice of the intermediate size I (gate rows, the matching
    up rows, the matching down columns); ``layout`` defaults to the source's ("merged" for HF MLPs)."""
    w_gate, w_up, b_gate, b_up, down, act, source_layout = _gate_up(mlp)
    layout = layout or source_layout
    inter = w_gate.shape[0]
    split(inter, where.world_size, "intermediate_size", 64 if layout == "packed" else 1,
          why="each rank holds intermediate_size / world_size gate and up rows")
    part = where.part(inter)
    b_down = down.bias.detach() if down.bias is not None and where.rank == 0 else None
    return local_swiglu(w_gate[part], w_up[part], None if b_gate is None else b_gate[part],
                        None if b_up is None else b_up[part], down.weight.detach()[:, part], b_down, act, layout)


def _is_swiglu_mlp(module: nn.Module) -> bool:
    return isinstance(module, FusedSwiGLUMLP) or all(
        isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


# ----------------------------------------------------------------------------- public
def shard(module: nn.Module, group=None, *, style: str | None = None, rank: int | None = None,
          world_size: int | None = None, gather_output: bool = False, reduce_results: bool = True,
          layout: str | None = None) -> nn.Module:
    """This rank's tensor-parallel shard of ``module``.

    Parameters
    ----------
    module : a FusedSwiGLUMLP or HF-style SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``
        Linears and a SiLU ``act_fn``) -> :class:`ParallelSwiGLUMLP`; an ``nn.Linear`` or
        ``VQLinear`` with ``style`` -> :class:`ColumnParallel` (``"column"``) or
        :class:`RowParallel` (``"row"``); an ``MLADecodeAttention`` -> :class:`ParallelMLADecodeAttention`.
    group, rank, world_size : the tensor-parallel group (default: ``torch.distributed``'s default
        group), or an explicit rank and world size (:func:`tilefuse.parallel.group.placement`).
    gather_output : column-parallel and MLA: all-gather the output.
    reduce_results : row-parallel and MLP: all-reduce the output (else partial sums).
    layout : MLP: the FusedSwiGLUMLP layout of the shard (default: the source's).

    Raises ValueError naming ``world_size`` when it does not divide the split dimension
    (``intermediate_size``, ``out_features``, ``in_features`` (whole groups of 8 for VQ), ``num_heads``).
    """
    where = placement(group, rank, world_size)
    if isinstance(module, MLADecodeAttention):
        return ParallelMLADecodeAttention.from_module(module, group, rank=where.rank, world_size=where.world_size,
                                                      gather_output=gather_output)
    if isinstance(module, (nn.Linear, VQLinear)):
        if style not in STYLES:
            raise ValueError(f"style: expected one of {STYLES} for a {type(module).__name__}, got {style!r}")
        if style == "column":
            return ColumnParallel(rows_of(module, where), where, gather_output=gather_output)
        return RowParallel(columns_of(module, where), where, reduce_results=reduce_results)
    if _is_swiglu_mlp(module):
        return ParallelSwiGLUMLP(swiglu_of(module, where, layout), where, reduce_results=reduce_results)
    raise ValueError(f"module: expected a FusedSwiGLUMLP or HF-style SwiGLU MLP, an nn.Linear or VQLinear, or an "
                     f"MLADecodeAttention, got {type(module).__name__}")


def swiglu_mlp_class(model: nn.Module, require_silu: bool = True) -> str:
    """The class name of ``model``'s SwiGLU MLPs (``tilefuse.hf.SWIGLU_MLP_CLASSES`` by
    ``config.model_type``); ``require_silu``: refuse a ``config.hidden_act`` other than SiLU."""
    from tilefuse.hf import SILU_NAMES, SWIGLU_MLP_CLASSES

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SWIGLU_MLP_CLASSES:
        raise ValueError(f"model: expected config.model_type in {sorted(SWIGLU_MLP_CLASSES)}, got {model_type!r}")
    act = getattr(config, "hidden_act", "silu")
    if require_silu and act not in SILU_NAMES:
        raise ValueError(f"model: expected config.hidden_act in {SILU_NAMES} (SwiGLU), got {act!r}")
    return SWIGLU_MLP_CLASSES[model_type]


# DeepSeek MLA attention: projections whose output rows are per query head (column-parallel);
# the latent path (q_a_proj, kv_a_proj_with_mqa, their norms) is shared by all heads: replicated.
MLA_HEAD_ROWS = ("q_proj", "q_b_proj")


def is_mla_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers DeepSeek-V2/V3 attention (patched by
    :func:`tilefuse.hf.patch_mla` or not)."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return bool(names & {"DeepseekV2Attention", "DeepseekV3Attention"})


def mla_attention_of(attn: nn.Module, where: Placement, num_heads: int) -> int:
    """Shard a DeepSeek-V2/V3 attention module in place: this rank's ``num_heads / world_size``
    query heads. Returns the number of projections replaced (3).

    * ``q_b_proj`` (``q_proj`` without a q LoRA): its rows of this rank's heads, a
      :class:`ColumnParallel` (``[.., h_r * (qk_nope + qk_rope)]`` out);
    * ``kv_b_proj``: its rows of this rank's heads (``W_UK`` and ``W_UV`` of each), a plain
      ``nn.Linear``: the absorbed decode of :func:`tilefuse.hf.patch_mla` slices its weight, and
      transformers' own forward (the prefill) calls it;
    * ``o_proj``: its input columns of this rank's heads, a :class:`RowParallel` (the layer's one
      all-reduce; the bias on rank 0);
    * ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms stay whole: the latent (512 + 64 values
      per token) is shared by all heads, so every rank computes it and caches all of it.

    transformers' attention reshapes with ``-1`` heads and :func:`tilefuse.hf.patch_mla` counts the
    heads from ``kv_b_proj``, so both run on the rank's heads unchanged. An attention already cut
    (its ``o_proj`` a :class:`RowParallel`) is left as it is: returns 0. Raises ValueError naming
    ``world_size`` when it does not divide ``num_heads``.
    """
    if isinstance(getattr(attn, "o_proj", None), RowParallel):
        return 0
    split(num_heads, where.world_size, "config.num_attention_heads",
          why="each rank runs num_attention_heads / world_size MLA query heads")
    for name, want in (("kv_b_proj", nn.Linear), ("o_proj", (nn.Linear, VQLinear))):
        if not isinstance(getattr(attn, name, None), want):
            raise ValueError(f"model: expected {type(attn).__name__}.{name} to be an "
                             f"{'nn.Linear' if want is nn.Linear else 'nn.Linear or VQLinear'}, "
                             f"got {type(getattr(attn, name, None)).__name__}")
    replaced = 0
    for name in MLA_HEAD_ROWS:
        proj = getattr(attn, name, None)
        if isinstance(proj, (nn.Linear, VQLinear)):
            setattr(attn, name, ColumnParallel(rows_of(proj, where), where))
            replaced += 1
    attn.kv_b_proj = rows_of(attn.kv_b_proj, where)
    attn.o_proj = RowParallel(columns_of(attn.o_proj, where), where)
    return replaced + 2


def _check_heads(config, world: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None:
            split(heads, world, f"config.{name}", why="each rank runs its share of the attention heads")


def shard_model(model: nn.Module, group=None, *, rank: int | None = None, world_size: int | None = None,
                lm_head: bool = False) -> int:
    """Shard every decoder block of an HF Llama / Mistral / Qwen2 / Qwen3 or DeepSeek-V2 / V3
    model in place.

    q/k/v projections become :class:`ColumnParallel` (this rank's heads: the models' attention
    reshapes with ``-1`` heads, and their caches size themselves from the keys, so they run on a
    rank's heads unchanged), ``o_proj`` :class:`RowParallel`; a dense SwiGLU MLP (HF's or
    ``FusedSwiGLUMLP``) becomes a fused :class:`ParallelSwiGLUMLP`; an MLP whose projections are
    ``VQLinear`` (after :func:`tilefuse.hf.patch_vq`) gets gate/up column- and down row-parallel.
    DeepSeek's MLA attention is cut by heads (:func:`mla_attention_of`: ``q_b_proj`` / ``q_proj``
    and ``kv_b_proj`` by rows, ``o_proj`` row-parallel, the latent path replicated), its dense
    MLPs and shared experts as above; routed experts stay replicated. Embeddings and norms stay
    replicated; ``lm_head`` too, unless ``lm_head=True``: then it is cut by the vocabulary
    (:class:`ColumnParallel` with ``gather_output``: each rank reads ``vocab / world_size`` rows of
    the weight and the logits are all-gathered, so every rank still picks from all of them), as
    transformers' own plan does. Returns the number of modules replaced.

    Every rank must hold the same full model. Raises ValueError naming ``world_size`` when it does
    not divide ``config.num_attention_heads``, ``config.num_key_value_heads``, a projection's size
    or (``lm_head=True``) the vocabulary; naming ``lm_head`` for a model without an ``nn.Linear`` one.
    """
    where = placement(group, rank, world_size)
    mlp_class = swiglu_mlp_class(model, require_silu=False)
    _check_heads(model.config, where.world_size)
    head = getattr(model, "lm_head", None)
    cut_head = bool(lm_head) and not isinstance(head, ColumnParallel)      # (a ColumnParallel one is cut already)
    if cut_head:
        if not isinstance(head, nn.Linear):
            raise ValueError(f"lm_head: expected model.lm_head to be an nn.Linear to cut by the vocabulary, "
                             f"got {type(head).__name__}")
        split(head.out_features, where.world_size, "lm_head.out_features",
              why="lm_head=True: each rank holds vocab / world_size rows of lm_head")
    done: list[str] = []                      # replaced modules: their children are left alone
    count = 0
    for name, module in list(model.named_modules()):
        if any(name.startswith(prefix + ".") for prefix in done):
            continue
        attr = name.rpartition(".")[2]
        if is_mla_attention(module):
            count += mla_attention_of(module, where, int(model.config.num_attention_heads))
            done.append(name)
            continue
        if isinstance(module, FusedSwiGLUMLP) or (type(module).__name__ == mlp_class
                                                  and isinstance(getattr(module, "gate_proj", None), nn.Linear)):
            new = ParallelSwiGLUMLP(swiglu_of(module, where), where)
        elif isinstance(module, (nn.Linear, VQLinear)) and attr in COLUMN_NAMES:
            new = ColumnParallel(rows_of(module, where), where)
        elif isinstance(module, (nn.Linear, VQLinear)) and attr in ROW_NAMES:
            new = RowParallel(columns_of(module, where), where)
        else:
            continue
        model.set_submodule(name, new)
        done.append(name)
        count += 1
    if cut_head:
        model.lm_head = ColumnParallel(rows_of(head, where), where, gather_output=True)
        count += 1
    return count
