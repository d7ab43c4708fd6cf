"""FusedSwiGLUMLP: conversion from an HF-style MLP (shared weights), forward, torch.compile, CUDA graphs."""

import pytest
import torch
from torch import nn

import tilefuse
from tilefuse.nn.swiglu import FusedSwiGLUMLP
from tilefuse.testing import rel_err
from tilefuse.testing.swiglu import reference_fp64


class HFStyleMLP(nn.Module):
    """The shape of LlamaMLP / Qwen2MLP."""

    def __init__(self, hidden, inter, bias=False, dtype=None, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def mlp_reference_f64(mlp, x):
    """fp64 MLP with the gate/up output rounded once to x's dtype (what the fused kernel returns)."""
    w = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
    b = None if mlp.gate_proj.bias is None else torch.cat((mlp.gate_proj.bias, mlp.up_proj.bias))
    h = reference_fp64(x, w, b).to(x.dtype).double()
    return h @ mlp.down_proj.weight.double().T


# rel_err bound: h is exact to 1 ulp (2^-10 fp16, 2^-7 bf16 relative); down_proj in that dtype adds
# the same order, so the Frobenius error is a few 1e-3 at most. Garbage gives O(1).
REL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("layout", ["merged", "packed"])
@pytest.mark.parametrize("bias", [False, True])
def test_from_mlp_shares_weights_and_matches(interpret, layout, bias):
    mlp = HFStyleMLP(64, 128, bias=bias, dtype=torch.float16, device=interpret)
    x = torch.randn(2, 5, 64, dtype=torch.float16, device=interpret)
    expected = mlp_reference_f64(mlp, x)
    fused = FusedSwiGLUMLP.from_mlp(mlp, layout=layout)
    assert fused.down_proj is mlp.down_proj
    if layout == "merged":  # the original parameters now view the merged tensor: one copy
        assert mlp.gate_proj.weight.data_ptr() == fused.gate_up_weight.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == fused.gate_up_weight[128:].data_ptr()
    y = fused(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, expected) < REL[torch.float16]
    # The original module still computes the same function from the shared storage.
    assert rel_err(mlp(x), expected) < REL[torch.float16]


def test_fresh_module_and_errors():
    mod = FusedSwiGLUMLP(64, 128, bias=True, dtype=torch.bfloat16)
    assert mod.gate_up_weight.shape == (256, 64) and mod.gate_up_bias.shape == (256,)
    assert "layout='merged'" in repr(mod)
    with pytest.raises(ValueError, match="layout"):
        FusedSwiGLUMLP(64, 128, layout="zigzag")
    bad = HFStyleMLP(64, 128)
    bad.up_proj = nn.Linear(64, 96)
    with pytest.raises(ValueError, match="mlp.up_proj.weight"):
        FusedSwiGLUMLP.from_mlp(bad)


def test_from_mlp_refuses_what_it_cannot_compute():
    gelu = HFStyleMLP(64, 128)
    gelu.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="mlp.act_fn: expected SiLU"):
        FusedSwiGLUMLP.from_mlp(gelu)
    missing = HFStyleMLP(64, 128)
    del missing.act_fn
    with pytest.raises(ValueError, match="mlp.act_fn: expected SiLU"):
        FusedSwiGLUMLP.from_mlp(missing)
    odd = HFStyleMLP(64, 128)
    odd.gate_proj = nn.Identity()
    with pytest.raises(ValueError, match="mlp.gate_proj: expected an nn.Linear"):
        FusedSwiGLUMLP.from_mlp(odd)


def test_layout_is_part_of_the_state_dict():
    packed = FusedSwiGLUMLP(64, 128, layout="packed")
    merged = FusedSwiGLUMLP(64, 128, layout="merged")
    assert set(packed.state_dict()) == {"gate_up_weight_packed", "down_proj.weight"}
    assert set(merged.state_dict()) == {"gate_up_weight", "down_proj.weight"}
    for strict in (True, False):
        with pytest.raises(ValueError, match="state_dict: expected gate_up_weight in layout 'merged'"):
            merged.load_state_dict(packed.state_dict(), strict=strict)
        with pytest.raises(ValueError, match="state_dict: expected gate_up_weight in layout 'packed'"):
            packed.load_state_dict(merged.state_dict(), strict=strict)
    again = FusedSwiGLUMLP(64, 128, layout="packed")
    again.load_state_dict(packed.state_dict())
    assert torch.equal(again.gate_up_weight, packed.gate_up_weight)
    again = FusedSwiGLUMLP(64, 128, layout="packed", device="meta")
    again.load_state_dict(packed.state_dict(), assign=True)
    assert torch.equal(again.gate_up_weight, packed.gate_up_weight)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_round_trips_through_safetensors(tmp_path, strict, bias):
    """The state dict holds tensors only (safetensors refused the former ``_extra_state`` dict),
    and every route refuses the other layout: before, ``strict=False`` loaded packed weights into
    a merged module without a word (outputs off by up to 1.1)."""
    st = pytest.importorskip("safetensors.torch")
    x = torch.randn(3, 64)
    for layout, other in (("merged", "packed"), ("packed", "merged")):
        source = FusedSwiGLUMLP.from_mlp(HFStyleMLP(64, 128, bias=bias), layout=layout)
        path = tmp_path / f"{layout}.safetensors"
        st.save_file(source.state_dict(), str(path))
        loaded = st.load_file(str(path))
        same = FusedSwiGLUMLP(64, 128, bias=bias, layout=layout)
        result = same.load_state_dict(loaded, strict=strict)
        assert not result.missing_keys and not result.unexpected_keys
        torch.testing.assert_close(same(x), source(x), rtol=0, atol=0)
        wrong = FusedSwiGLUMLP(64, 128, bias=bias, layout=other)
        before = wrong.gate_up_weight.detach().clone()
        with pytest.raises(ValueError, match=f"state_dict: expected gate_up_weight in layout '{other}'"):
            wrong.load_state_dict(loaded, strict=strict)
        assert torch.equal(wrong.gate_up_weight, before)
        # nested in a model: the keys carry the prefix
        model = nn.Sequential(FusedSwiGLUMLP(64, 128, bias=bias, layout=other))
        with pytest.raises(ValueError, match=f"'0.gate_up_weight"):
            model.load_state_dict({f"0.{k}": v for k, v in loaded.items()}, strict=strict)


def test_state_dicts_with_the_former_extra_state_still_load():
    """Dicts saved before the layout moved into the key names (``_extra_state`` = {"layout", "fp8"}
    beside ``gate_up_weight``) load into the matching layout and are refused by the other."""
    for layout, other in (("merged", "packed"), ("packed", "merged")):
        source = FusedSwiGLUMLP(64, 128, layout=layout)
        old = {"gate_up_weight": source.gate_up_weight.detach().clone(),
               "down_proj.weight": source.down_proj.weight.detach().clone(),
               "_extra_state": {"layout": layout, "fp8": False}}
        same = FusedSwiGLUMLP(64, 128, layout=layout)
        same.load_state_dict(dict(old))
        assert torch.equal(same.gate_up_weight, source.gate_up_weight)
        with pytest.raises(ValueError, match=f"expected gate_up_weight in layout '{other}'"):
            FusedSwiGLUMLP(64, 128, layout=other).load_state_dict(dict(old), strict=False)
    with pytest.raises(ValueError, match="_extra_state"):
        FusedSwiGLUMLP(64, 128).load_state_dict({**old, "_extra_state": {"layout": "zigzag"}})


@pytest.mark.parametrize("strict", [True, False])
def test_fp8_and_plain_state_dicts_do_not_mix(strict):
    """FP8 weights (e4m3 + gate_up_scales) into a bf16 module, or bf16 weights into an FP8 module:
    refused, not converted value by value without their scales."""
    plain = FusedSwiGLUMLP.from_mlp(HFStyleMLP(128, 256, dtype=torch.bfloat16))
    fp8 = FusedSwiGLUMLP.from_mlp(HFStyleMLP(128, 256, dtype=torch.bfloat16), fp8=True)
    assert "gate_up_scales" in fp8.state_dict()
    with pytest.raises(ValueError, match="state_dict: expected bf16/fp16 gate/up weights"):
        plain.load_state_dict(fp8.state_dict(), strict=strict)
    with pytest.raises(ValueError, match="state_dict: expected FP8 gate/up weights"):
        fp8.load_state_dict(plain.state_dict(), strict=strict)
    again = FusedSwiGLUMLP.from_mlp(HFStyleMLP(128, 256, dtype=torch.bfloat16), fp8=True)
    again.load_state_dict(fp8.state_dict(), strict=strict)
    assert torch.equal(again.gate_up_weight.view(torch.uint8), fp8.gate_up_weight.view(torch.uint8))
    assert torch.equal(again.gate_up_scales, fp8.gate_up_scales)


@pytest.mark.parametrize("layout", ["merged", "packed"])
def test_fp32_module_trains(layout):
    """A default (fp32) HF MLP converts, runs (reference path) and gets gradients for every weight."""
    mlp = HFStyleMLP(64, 128, bias=True)
    x = torch.randn(3, 64, requires_grad=True)
    expected = mlp(x)
    fused = FusedSwiGLUMLP.from_mlp(HFStyleMLP(64, 128, bias=True).requires_grad_(True), layout=layout)
    fused.load_state_dict(FusedSwiGLUMLP.from_mlp(mlp, layout=layout).state_dict())
    y = fused(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert fused.gate_up_weight.grad is not None and fused.gate_up_bias.grad is not None
    assert x.grad is not None and fused.down_proj.weight.grad is not None
    x2 = x.detach().clone().requires_grad_()
    mlp(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_traces_the_custom_op():
    """fullgraph tracing through torch.ops.tilefuse.swiglu (CPU: aot_eager, reference backend)."""
    mlp = HFStyleMLP(64, 128, dtype=torch.bfloat16)
    fused = FusedSwiGLUMLP.from_mlp(mlp)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with tilefuse.force(backend="reference"):
        eager = fused(x)
        compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _fresh_compile_state():
    """As in a fresh process: no cached call plans of either op, no compiled graphs."""
    from tilefuse.ops.swiglu import op
    from tilefuse.ops.swiglu_fp8 import op as fp8_op

    op._plans.clear()
    fp8_op._plans.clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
def test_compile_before_any_eager_call(interpret, fp8, dynamic):
    """FusedSwiGLUMLP compiled (fullgraph) before any eager call of the op: tracing once went
    through the plan and the tuned table's file lookup (CPU: the kernels in the interpreter, the
    FP8 module's op on the reference; aot_eager); then a second number of tokens."""
    _fresh_compile_state()
    fused = FusedSwiGLUMLP.from_mlp(HFStyleMLP(128, 256, dtype=torch.float16, device=interpret), fp8=fp8)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    with torch.no_grad():
        for m in (3, 5):
            x = torch.randn(m, 128, dtype=torch.float16, device=interpret)
            torch.testing.assert_close(compiled(x), fused(x), rtol=0, atol=0)   # the same kernels ran


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compile_before_any_eager_call_on_gpu(fp8, dynamic):
    _fresh_compile_state()
    fused = FusedSwiGLUMLP.from_mlp(HFStyleMLP(1024, 2048, dtype=torch.bfloat16, device="cuda"), fp8=fp8)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        out = torch.compile(fused, fullgraph=True, dynamic=dynamic)(x)
        assert rel_err(out, fused(x)) < 1e-3      # same gate/up kernel; Inductor may pick another down GEMM


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compile_and_cuda_graph_on_gpu(dtype):
    mlp = HFStyleMLP(896, 4864, dtype=dtype, device="cuda")
    x = torch.randn(16, 896, dtype=dtype, device="cuda")
    expected = mlp_reference_f64(mlp, x)
    fused = FusedSwiGLUMLP.from_mlp(mlp)
    eager = fused(x)
    assert rel_err(eager, expected) < REL[dtype]
    compiled = torch.compile(fused, fullgraph=True)
    assert rel_err(compiled(x), eager) < 1e-3  # same kernel; down_proj may pick another GEMM
    # CUDA-graph replay: capture once, change the input in place, replay, compare.
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fused(static_x)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_y, fused(x2), rtol=0, atol=0)
