"""FusedSwiGLUMLP in FP8: from bf16/fp16 weights (quantized) and from transformers' FP8Linear layout;
hf.patch_swiglu on an FP8 model.

The fused module's output is compared with the same computation in fp64 from the same e4m3
weights, scales and dynamically quantized activations (so only the kernel's fp32 accumulation and
the one rounding of ``h`` differ: rel_err ~1e-3 in fp16), and with the unquantized MLP (e4m3 has
3 mantissa bits: ~5 % relative error, bounded by 0.1).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tilefuse.hf import patch_swiglu
from tilefuse.nn.swiglu import FusedSwiGLUMLP
from tilefuse.ops.swiglu_fp8.reference import FP8, quantize_fp8, swiglu_fp8_reference
from tilefuse.testing import rel_err


class LlamaMLP(nn.Module):
    def __init__(self, hidden, inter, dtype=torch.float16):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def fp8_reference(fused, x):
    xq, xs = quantize_fp8(x, fused.act_group)
    h = swiglu_fp8_reference(xq, xs, fused.gate_up_weight, fused.gate_up_scales, out_dtype=torch.float64)
    return h.to(x.dtype).double() @ fused.down_proj.weight.double().T


@pytest.mark.parametrize("hidden,inter", [(256, 128), (96, 48)], ids=["blocks", "channels"])
def test_from_bf16_mlp_quantizes(interpret, hidden, inter):
    mlp = LlamaMLP(hidden, inter).to(interpret)
    fused = FusedSwiGLUMLP.from_mlp(mlp, fp8=True)
    assert fused.fp8 and fused.gate_up_weight.dtype == FP8 and fused.down_proj is mlp.down_proj
    assert fused.gate_up_scales.shape == ((2, 2) if inter % 128 == 0 else (2 * inter, 1))
    assert fused.act_group == (128 if inter % 128 == 0 else None)
    x = torch.randn(3, 5, hidden, dtype=torch.float16, device=interpret)
    y = fused(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, fp8_reference(fused, x)) < 3e-3
    assert rel_err(y, mlp(x)) < 0.1


def test_from_transformers_fp8_linear_layout(interpret):
    """gate/up as transformers' FP8Linear holds them (e4m3 weight + weight_scale_inv blocks)."""
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Linear

    hidden, inter = 256, 256
    mlp = LlamaMLP(hidden, inter)
    dense = {}
    for name in ("gate_proj", "up_proj"):
        w = torch.randn(inter, hidden) * hidden ** -0.5
        q, s = quantize_fp8(w, None, block=True)
        lin = FP8Linear(hidden, inter, block_size=(128, 128))
        lin.weight.data, lin.weight_scale_inv.data = q, s
        setattr(mlp, name, lin)
        dense[name] = (q.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1))
    mlp = mlp.to(interpret)
    fused = FusedSwiGLUMLP.from_mlp(mlp)
    assert fused.fp8 and fused.gate_up_scales.shape == (4, 2) and fused.act_group == 128
    x = torch.randn(7, hidden, dtype=torch.float16, device=interpret)
    y = fused(x)
    assert rel_err(y, fp8_reference(fused, x)) < 3e-3
    # the stacked layout means the checkpoint's weights: against its dequantized gate/up in fp64
    xd = x.double()
    g, u = xd @ dense["gate_proj"].T.to(xd.device), xd @ dense["up_proj"].T.to(xd.device)
    want = (torch.nn.functional.silu(g) * u) @ mlp.down_proj.weight.double().T
    assert rel_err(y, want) < 0.1


def test_fp8_refusals():
    mlp = LlamaMLP(128, 128)
    with pytest.raises(ValueError, match="layout: expected 'merged'"):
        FusedSwiGLUMLP.from_mlp(mlp, "packed", fp8=True)
    mlp.gate_proj.weight.data = mlp.gate_proj.weight.data.to(FP8)
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.to(FP8)
    with pytest.raises(ValueError, match="mlp.gate_proj: expected an e4m3 weight with a weight_scale_inv"):
        FusedSwiGLUMLP.from_mlp(mlp)
    fused = FusedSwiGLUMLP.from_mlp(LlamaMLP(128, 128), fp8=True)
    with pytest.raises(ValueError, match="state_dict: expected FP8"):
        fused.load_state_dict(FusedSwiGLUMLP(128, 128).state_dict(), strict=False)


def test_patch_swiglu_fp8(interpret):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(model_type="llama", hidden_act="silu")
            self.layers = nn.ModuleList(LlamaMLP(128, 256) for _ in range(2))

        def forward(self, x):
            for mlp in self.layers:
                x = x + mlp(x)
            return x

    model = Model().to(interpret)
    x = torch.randn(4, 128, dtype=torch.float16, device=interpret)
    before = model(x)
    assert patch_swiglu(model, fp8=True) == 2
    assert all(isinstance(m, FusedSwiGLUMLP) and m.fp8 for m in model.layers)
    assert rel_err(model(x), before) < 0.1
    with torch.no_grad():
        assert torch.compile(model, fullgraph=True, backend="aot_eager")(x).shape == x.shape
