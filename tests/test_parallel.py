"""tilefuse.parallel: every sharded module against the one-device module it was cut from.

* One process: the partial outputs of every rank's shard (``reduce_results=False``, ranks
  simulated with explicit ``rank`` / ``world_size``) sum (or concatenate) to the full output, for
  world sizes 2 and 4; bad world sizes and placements raise errors naming the argument.
* Two processes (gloo, CPU, the reference path): the collectives, in bf16, fp16 and fp32, for the
  MLP, dense and 2x8 VQ column/row layers and MLA heads; ``shard_model`` on a transformers Llama
  (dense, fused, VQ); a model loaded by transformers with ``tp_plan="auto"`` patched with
  ``tilefuse.parallel.hf`` (needs ``accelerate``).
* Two GPUs (NCCL, ``-m gpu``; skipped with fewer): the same at the benchmark's shapes with the
  kernels, CUDA-graph replay of a layer holding its all-reduce, and the ``tp_plan`` route.

DeepSeek models under tensor parallelism (``patch_mla``, both routes): ``test_parallel_mla.py``.

Tolerance: ``|y_tp - y_1| <= factor * |x| @ |W|^T`` (fp64), ``factor`` from
:func:`tilefuse.testing.parallel.tp_tolerance` (derived there): 4u for column splits, 6u for row
splits (each rank's partial sum and the all-reduce round once more), 8u for the fused MLP (plus a
1-ulp flip of the intermediate), 16u for the unfused one, + 2^-16 for fp32 summation order. MLA heads: out and lse within twice the
MLA tests' tolerance against fp64 (both sides are within it), cos_diff < 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tilefuse.bench.tp import capture
from tilefuse.nn.mla import MLADecodeAttention
from tilefuse.nn.swiglu import FusedSwiGLUMLP
from tilefuse.nn.vq import VQLinear
from tilefuse.ops.swiglu.reference import swiglu_reference
from tilefuse.parallel import (ColumnParallel, ParallelMLADecodeAttention, ParallelSwiGLUMLP, RowParallel, placement,
                               shard, shard_model)
from tilefuse.testing.compare import assert_close, cos_diff
from tilefuse.testing.mla import make_case as mla_case
from tilefuse.testing.parallel import check_within, error_scale, tp_tolerance
from tilefuse.testing.vq import make_weight

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# MLA: twice test_mla's tolerances against fp64 (atol = rtol for out; atol for lse).
MLA_TOL = {torch.bfloat16: (2e-2, 2e-3), torch.float16: (4e-3, 2e-4), torch.float32: (2e-5, 2e-5)}


# ----------------------------------------------------------------------------- builders
def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_mlp(hidden, inter, dtype, device, *, bias=False, layout="merged", seed=0) -> FusedSwiGLUMLP:
    """A FusedSwiGLUMLP with O(1) intermediates and outputs, drawn on ``device`` (the same on every
    rank for one seed: one generator kind per device type)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *shape, std: (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)  # noqa: E731
    mlp = FusedSwiGLUMLP(hidden, inter, bias=bias, down_bias=bias, layout="merged", device="meta", dtype=dtype)
    mlp.gate_up_weight = nn.Parameter(draw(2 * inter, hidden, std=hidden ** -0.5))
    mlp.down_proj.weight = nn.Parameter(draw(hidden, inter, std=inter ** -0.5))
    if bias:
        mlp.gate_up_bias = nn.Parameter(draw(2 * inter, std=0.5))
        mlp.down_proj.bias = nn.Parameter(draw(hidden, std=0.5))
    if layout == "packed":
        mlp = FusedSwiGLUMLP.from_mlp(_hf_view(mlp), layout="packed")
    return mlp


def _hf_view(mlp: FusedSwiGLUMLP) -> nn.Module:
    """An HF-style MLP (gate_proj, up_proj, down_proj, act_fn) over a merged FusedSwiGLUMLP's tensors."""
    from tilefuse.parallel.sharding import linear_from

    inter, w, b = mlp.intermediate_size, mlp.gate_up_weight.detach(), mlp.gate_up_bias
    hf = nn.Module()
    hf.gate_proj = linear_from(w[:inter].clone(), None if b is None else b.detach()[:inter].clone())
    hf.up_proj = linear_from(w[inter:].clone(), None if b is None else b.detach()[inter:].clone())
    hf.down_proj, hf.act_fn = mlp.down_proj, nn.SiLU()
    hf.forward = lambda x: hf.down_proj(hf.act_fn(hf.gate_proj(x)) * hf.up_proj(x))
    return hf


def mlp_scale(mlp: FusedSwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """|h| @ |W_down|^T of the fp64 intermediate h."""
    w = mlp.gate_up_weight.detach()
    if mlp.layout == "packed":
        from tilefuse.ops.swiglu.op import unpack_gate_up

        w = torch.cat(unpack_gate_up(w))
    b = mlp.gate_up_bias
    h = swiglu_reference(x.double(), w.double(), None if b is None else b.double(), compute_dtype=torch.float64)
    return error_scale(h, mlp.down_proj.weight.detach())


def make_vq(n, k, dtype, device, *, bias=True, seed=0) -> VQLinear:
    torch.manual_seed(seed)
    codes, books, scales = make_weight(n, k, dtype, "cpu", codes_dtype=torch.int8)
    layer = VQLinear(k, n, bias, dtype=dtype, device=device)
    return layer.load_quantized(codes, books, scales, torch.randn(n).to(dtype) if bias else None)


def make_linear(n, k, dtype, device, *, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)          # seeds the CPU and CUDA generators: the same layer on every rank
    layer = nn.Linear(k, n, bias=bias, device=device, dtype=dtype)
    if bias:                         # O(1) biases: a bias added on every rank (or none) stands out
        layer.bias.data.normal_()
    return layer


def weight_of(layer) -> torch.Tensor:
    return layer.dequantize() if isinstance(layer, VQLinear) else layer.weight.detach()


def x_of(m, k, dtype, device, seed=1) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)


def mla_full(heads, lens, dtype, device, seed=2):
    torch.manual_seed(seed)
    case = mla_case(lens, 1, heads, dtype, device)
    return MLADecodeAttention(heads, causal=True), case


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("world", [2, 4])
def test_partial_outputs_of_every_rank_make_the_full_output(world):
    dtype, dev = torch.float32, torch.device("cpu")
    x = x_of(3, 64, dtype, dev)
    for mlp in (make_mlp(64, 256, dtype, dev, bias=True), make_mlp(64, 512, dtype, dev, layout="packed")):
        parts = [shard(mlp, rank=r, world_size=world, reduce_results=False) for r in range(world)]
        assert all(isinstance(p, ParallelSwiGLUMLP) and p.local.intermediate_size == mlp.intermediate_size // world
                   for p in parts)
        assert parts[0].local.layout == mlp.layout
        check_within(sum(p(x) for p in parts), mlp(x), mlp_scale(mlp, x), tp_tolerance(dtype, "mlp"))
    hf = _hf_view(make_mlp(64, 256, dtype, dev, bias=True))
    parts = [shard(hf, rank=r, world_size=world, reduce_results=False) for r in range(world)]
    torch.testing.assert_close(sum(p(x) for p in parts), hf.forward(x), atol=1e-5, rtol=1e-5)
    for layer in (make_linear(96, 64, dtype, dev), make_vq(96, 64, dtype, dev)):
        cols = [shard(layer, style="column", rank=r, world_size=world) for r in range(world)]
        rows = [shard(layer, style="row", rank=r, world_size=world, reduce_results=False) for r in range(world)]
        assert isinstance(cols[0], ColumnParallel) and isinstance(rows[0], RowParallel)
        assert rows[1].local.bias is None and rows[0].local.bias is not None    # bias once, on rank 0
        scale = error_scale(x, weight_of(layer))
        check_within(torch.cat([c(x) for c in cols], -1), layer(x), scale, tp_tolerance(dtype, "column"))
        check_within(sum(r(x) for r in rows), layer(x), scale, tp_tolerance(dtype, "row"))
    full, case = mla_full(8, [100, 0, 37], dtype, dev)
    out1, lse1 = full(*case.args())
    outs = [ParallelMLADecodeAttention.from_module(full, rank=r, world_size=world)(*case.args())
            for r in range(world)]
    assert_close(torch.cat([o for o, _ in outs], 2), out1, atol=1e-5, rtol=1e-5)
    assert_close(torch.cat([lse for _, lse in outs], 1), lse1, atol=1e-5, rtol=1e-5, name="lse")


def test_shards_hold_their_own_memory():
    """A rank's rows of a weight are copied out of it: dropping the full module frees its memory
    (a row slice is a view that would keep the whole weight alive)."""
    dev = torch.device("cpu")
    layer = make_linear(96, 64, torch.float32, dev)
    for style in ("column", "row"):
        local = shard(layer, style=style, rank=1, world_size=2).local
        for param in local.parameters():
            assert param.untyped_storage().nbytes() == param.numel() * 4, (style, tuple(param.shape))
            assert param.data_ptr() != layer.weight.data_ptr()


def test_world_sizes_that_do_not_divide_are_refused_naming_the_argument():
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="world_size: .*intermediate_size=256"):
        shard(make_mlp(64, 256, torch.float32, dev), rank=0, world_size=3)
    with pytest.raises(ValueError, match="world_size: .*intermediate_size=256 into parts that are multiples of 64"):
        shard(make_mlp(64, 256, torch.float32, dev, layout="packed"), rank=0, world_size=8)
    with pytest.raises(ValueError, match="world_size: .*num_heads=128"):
        ParallelMLADecodeAttention(128, rank=0, world_size=3)
    with pytest.raises(ValueError, match="num_heads: expected an integer in \\[1, 128\\]"):
        ParallelMLADecodeAttention(512, rank=0, world_size=2)        # 256 heads on a rank
    with pytest.raises(ValueError, match="world_size: .*out_features=96"):
        shard(make_vq(96, 64, torch.float32, dev), style="column", rank=0, world_size=5)
    with pytest.raises(ValueError, match="world_size: .*in_features=64 into parts that are multiples of 8"):
        shard(make_vq(96, 64, torch.float32, dev), style="row", rank=0, world_size=16)   # 4 inputs each
    shard(make_linear(96, 64, torch.float32, dev), style="row", rank=0, world_size=16)   # dense: any divisor
    with pytest.raises(ValueError, match="style: expected one of"):
        shard(make_linear(96, 64, torch.float32, dev), rank=0, world_size=2)
    with pytest.raises(ValueError, match="module: expected"):
        shard(nn.ReLU(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank: expected rank and world_size"):
        placement(rank=1)
    with pytest.raises(ValueError, match="rank: expected an integer in \\[0, world_size=2\\)"):
        placement(rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size: expected an integer >= 1"):
        placement(rank=0, world_size=0)


def test_shard_model_refuses_heads_the_world_size_does_not_divide():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="world_size: .*config.num_key_value_heads=3"):
        shard_model(model, rank=0, world_size=2)
    with pytest.raises(ValueError, match="model: expected config.model_type"):
        shard_model(nn.Linear(2, 2), rank=0, world_size=2)


def test_a_collective_without_a_process_group_is_refused():
    mlp = shard(make_mlp(64, 256, torch.float32, torch.device("cpu")), rank=0, world_size=2)
    with pytest.raises(ValueError, match="group: expected an initialized torch.distributed process group"):
        mlp(torch.randn(2, 64))


# ----------------------------------------------------------------------------- jobs run on every rank
def job_modules(dtype, sizes) -> dict:
    """Every sharded module against its full module on this rank; the worst error / tolerance ratio
    of each. ``sizes``: (M, H, I, N_vq, K_vq, heads, lens)."""
    m, hidden, inter, n, k, heads, lens = sizes
    dev = _device()
    x = x_of(m, hidden, dtype, dev)
    worst = {}
    for layout in ("merged", "packed"):
        mlp = make_mlp(hidden, inter, dtype, dev, bias=dev.type == "cpu", layout=layout)
        sharded = shard(mlp)
        worst[f"mlp/{layout}"] = check_within(sharded(x), mlp(x), mlp_scale(mlp, x), tp_tolerance(dtype, "mlp"))
    xk = x_of(m, k, dtype, dev)
    for name, layer in (("linear", make_linear(n, k, dtype, dev)), ("vq", make_vq(n, k, dtype, dev))):
        want, scale = layer(xk), error_scale(xk, weight_of(layer))
        col = shard(layer, style="column", gather_output=True)
        worst[f"{name}/column"] = check_within(col(xk), want, scale, tp_tolerance(dtype, "column"))
        row = shard(layer, style="row")
        worst[f"{name}/row"] = check_within(row(xk), want, scale, tp_tolerance(dtype, "row"))
        # column then row, the MLP's pattern: the local slice flows between them unchanged
        second = make_linear(k, n, dtype, dev, seed=5)
        pair_want = second(want)
        pair = shard(second, style="row")(shard(layer, style="column")(xk))
        worst[f"{name}/column->row"] = check_within(pair, pair_want, error_scale(want, second.weight) +
                                                    error_scale(scale, second.weight.abs()), tp_tolerance(dtype, "mlp"))
    full, case = mla_full(heads, lens, dtype, dev)
    out1, lse1 = full(*case.args())
    attn = shard(full, gather_output=True)
    out2, lse2 = attn(*case.args())
    atol, lse_atol = MLA_TOL[dtype]
    assert_close(out2, out1, atol=atol, rtol=atol)
    assert_close(lse2, lse1, atol=lse_atol, rtol=1e-5, name="lse")
    assert cos_diff(out2, out1) < 1e-5
    worst["mla"] = {"kernel_tp1": full_kernel(heads, case), "kernel_tp": attn.kernel(1, case.block_table.shape[1])}
    return worst


def full_kernel(heads, case) -> str:
    from tilefuse.ops.mla.op import choose_variant

    return choose_variant(heads, case.block_table.shape[1])


def _llama(dev, dtype, seed=0):
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(device=dev, dtype=dtype).eval()


@torch.no_grad()
def job_shard_model(dtype) -> dict:
    """shard_model on a dense, a fused and a 2-bit VQ Llama: the logits of every variant equal the
    one-device model's."""
    import tilefuse.hf

    dev = _device()
    ids = torch.arange(12, device=dev)[None] * 7 % 96
    out = {}
    for variant in ("dense", "swiglu", "vq2"):
        model = _llama(dev, dtype)
        if variant == "swiglu":
            tilefuse.hf.patch_swiglu(model)
        elif variant == "vq2":
            tilefuse.hf.patch_vq(model, random_codes=True, seed=3)
        want = model(input_ids=ids).logits
        replaced = shard_model(model)
        got = model(input_ids=ids).logits
        out[variant] = (replaced, float((got - want).abs().max() / want.abs().max()))
    return out


@torch.no_grad()
def job_tp_plan(path: str, dtype) -> dict:
    """A checkpoint loaded with transformers' tp_plan="auto": stock, tilefuse.hf.patch_swiglu (leaves
    a DTensor weight for the op), parallel.hf.patch_swiglu, and parallel.hf.patch_vq (random codes)
    on a fresh load; each against the one-device model."""
    import transformers

    import tilefuse.hf
    import tilefuse.parallel.hf as tp_hf
    from tilefuse.parallel.hf import _quantized_everywhere

    dev = _device()
    ids = torch.arange(12, device=dev)[None] * 7 % 96
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()  # noqa: E731
    full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    want = full(input_ids=ids).logits
    scale = float(want.abs().max())
    model = load()
    out = {"stock": float((model(input_ids=ids).logits - want).abs().max()) / scale,
           "tensor_parallel": tp_hf.is_tensor_parallel(model) and not tp_hf.is_tensor_parallel(full)}
    # tilefuse.hf.patch_swiglu alone leaves a DTensor weight in the fused MLP. Not run: on CUDA the
    # kernel would get the DTensor's pointer (an illegal memory access that poisons the process);
    # on a CPU PyTorch refuses the mix of DTensor and Tensor.
    tilefuse.hf.patch_swiglu(model)
    out["one_device_patch"] = type(model.model.layers[0].mlp.gate_up_weight.data).__name__
    model = load()
    out["patched_swiglu"] = tp_hf.patch_swiglu(model)
    assert isinstance(model.model.layers[0].mlp, ParallelSwiGLUMLP)
    tilefuse.hf.patch_swiglu(full)
    out["swiglu"] = float((model(input_ids=ids).logits - full(input_ids=ids).logits).abs().max()) / scale
    # VQ on a fresh load; the one-device reference gets the same codes (layer i quantized with seed + i)
    model, full = load(), transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    targets = ("q_proj", "o_proj", "down_proj")
    out["patched_vq"] = tp_hf.patch_vq(model, random_codes=True, targets=targets, seed=4)
    names = [name for name, mod in full.named_modules() if name.rpartition(".")[2] in targets]
    for i, name in enumerate(names):
        lin = full.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        setattr(full.get_submodule(parent), attr, _quantized_everywhere(lin.weight.detach(), lin.bias, None, i,
                                                                        True, 4 + i))
    want = full(input_ids=ids).logits
    out["vq"] = float((model(input_ids=ids).logits - want).abs().max() / want.abs().max())
    return out


# ----------------------------------------------------------------------------- CPU, 2 processes
# the gloo_ranks fixture (two CPU processes) is in conftest.py


CPU_SIZES = (3, 64, 256, 96, 128, 8, [100, 0, 37])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sharded_modules_equal_the_one_device_modules_gloo(gloo_ranks, dtype):
    for worst in gloo_ranks.run(job_modules, dtype, CPU_SIZES):
        assert all(v <= 1.0 for key, v in worst.items() if key != "mla"), worst


def test_shard_model_keeps_the_logits_gloo(gloo_ranks):
    pytest.importorskip("transformers")
    for result in gloo_ranks.run(job_shard_model, torch.float32):
        # 2 blocks x (q, k, v, o, mlp) for dense/fused; VQ MLPs keep their class: gate, up, down apart
        assert result["dense"][0] == 10 and result["swiglu"][0] == 10 and result["vq2"][0] == 14, result
        assert all(err < 1e-5 for _, err in result.values()), result


def _save_llama(tmp_path, dtype) -> str:
    path = tmp_path / "llama"
    _llama(torch.device("cpu"), dtype).save_pretrained(path)
    return str(path)


def test_tp_plan_model_patched_by_tilefuse_parallel_hf_gloo(gloo_ranks, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' tp_plan loading needs accelerate")
    check_tp_plan(gloo_ranks.run(job_tp_plan, _save_llama(tmp_path, torch.float32), torch.float32), 1e-5)


def check_tp_plan(results: list[dict], tol: float) -> None:
    for result in results:
        assert result["tensor_parallel"] and result["patched_swiglu"] == 2 and result["patched_vq"] == 6, result
        assert result["stock"] < tol and result["swiglu"] < tol and result["vq"] < tol, result
        assert "DTensor" in result["one_device_patch"], result     # why tilefuse.parallel.hf exists


# ----------------------------------------------------------------------------- 2 GPUs, NCCL
# the nccl_ranks fixture (two processes, one GPU each) is in conftest.py


# (M, H, I, N_vq, K_vq, MLA heads, lengths): the benchmark's 70B / 8B MLP, a 70B VQ down projection,
# DeepSeek's 128 heads (64 per rank) and 32 heads (16 per rank) at 16K context
GPU_SIZES = [
    (16, 8192, 28672, 8192, 28672, 128, [16384] * 4),
    (1, 4096, 14336, 28672, 8192, 32, [16384, 1, 5000, 0]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("sizes", GPU_SIZES, ids=lambda s: f"M{s[0]}-H{s[1]}-I{s[2]}-h{s[5]}")
def test_sharded_modules_equal_the_one_device_modules_nccl(nccl_ranks, dtype, sizes):
    results = nccl_ranks.run(job_modules, dtype, sizes)
    for worst in results:
        assert all(v <= 1.0 for key, v in worst.items() if key != "mla"), worst
    kernels = results[0]["mla"]
    if sizes[5] == 128:   # 64 heads per rank: still the kernel of >= 64 query rows
        assert kernels["kernel_tp1"] == kernels["kernel_tp"], kernels


def job_graph(dtype) -> float:
    """A ParallelSwiGLUMLP captured in a CUDA graph with its NCCL all-reduce: replay == eager."""
    dev = _device()
    mlp = shard(make_mlp(4096, 14336, dtype, dev))
    x = x_of(4, 4096, dtype, dev)
    eager = mlp(x).clone()
    graph, out = capture(lambda: mlp(x))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return float((out - eager).abs().max() / eager.abs().max())


@pytest.mark.gpu
def test_parallel_mlp_replays_in_a_cuda_graph_nccl(nccl_ranks):
    # split-K atomics may reorder the fp32 sums between runs: within one bf16 rounding
    assert all(err <= 2 ** -7 for err in nccl_ranks.run(job_graph, torch.bfloat16))


@pytest.mark.gpu
def test_tp_plan_model_patched_by_tilefuse_parallel_hf_nccl(nccl_ranks, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' tp_plan loading needs accelerate")
    # bf16 logits through 2 blocks: the fused vs unfused rounding of the one-device tests
    check_tp_plan(nccl_ranks.run(job_tp_plan, _save_llama(tmp_path, torch.bfloat16), torch.bfloat16), 2e-2)


def job_bench(out_dir: str) -> int:
    from pathlib import Path

    from tilefuse.bench.tp import run

    return run(False, Path(out_dir))


def test_bench_tp_pipeline_gloo(gloo_ranks, tmp_path):
    """``tilefuse bench tp`` on 2 CPU ranks (the reference path, toy shapes): every case at TP=1
    and TP=2, the TP=2 outputs within tolerance, the e2e decoders agree with TP=1's tokens."""
    import json

    pytest.importorskip("transformers")
    assert gloo_ranks.run(job_bench, str(tmp_path)) == [0, 0]
    data = json.loads(next(tmp_path.glob("tp-*x2.json")).read_text())
    assert data["machine"]["world_size"] == 2 and "incomplete" not in data
    impls = {(r["kind"], r["tp"], r["impl"]) for r in data["rows"]}
    for kind in ("mlp", "mlp-vq2", "mla"):
        assert {(kind, 1, "layer"), (kind, 2, "layer"), (kind, 2, "local"), (kind, 2, "allreduce")} <= impls
    accuracy = [g for g in data["summary"]["goals"] if "tolerance" in g["goal"] or "cos_diff" in g["goal"]]
    assert len(accuracy) == 2 and all(g["met"] for g in accuracy), accuracy
    e2e = data["summary"]["e2e"]
    assert {e["impl"] for e in e2e} >= {"stock", "tilefuse-swiglu", "shard_model", "shard_model+swiglu"}
    assert all(e["agreement_vs_tp1_stock"] == 1.0 for e in e2e), e2e
    # the DeepSeek part (tilefuse.bench.tp_deepseek): TP=1 and TP=2 decode the same tokens
    assert {("deepseek-decode", 1, "tilefuse"), ("deepseek-decode", 2, "tilefuse")} <= impls
    deepseek = data["summary"]["deepseek"]
    assert deepseek["table"] and all(e["tokens_equal_tp1"] for e in deepseek["table"]), deepseek
