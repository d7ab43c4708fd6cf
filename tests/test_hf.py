"""tilefuse.hf.patch_swiglu: swapping a model's SwiGLU MLPs for FusedSwiGLUMLP."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tilefuse
from tilefuse.hf import SWIGLU_MLP_CLASSES, patch_swiglu
from tilefuse.nn.swiglu import FusedSwiGLUMLP


class Qwen2MLP(nn.Module):  # named like transformers' class; same attributes
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=torch.bfloat16)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Qwen2MLP(64, 128)

    def forward(self, x):
        return x + self.mlp(x)


class TinyModel(nn.Module):
    def __init__(self, model_type="qwen2", act="silu", layers=3):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type, hidden_act=act)
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_patch_replaces_every_mlp_and_keeps_outputs():
    model = TinyModel()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with tilefuse.force(backend="reference"):
        before = model(x)
        assert patch_swiglu(model) == 3
        after = model(x)
    assert all(isinstance(b.mlp, FusedSwiGLUMLP) for b in model.layers)
    # Unfused bf16 rounds gate and up separately, fused rounds once: equal up to bf16 rounding.
    torch.testing.assert_close(after, before, rtol=2e-2, atol=2e-2)
    assert patch_swiglu(model) == 0  # idempotent: nothing left to patch


def test_patch_errors():
    with pytest.raises(ValueError, match="model_type"):
        patch_swiglu(TinyModel(model_type="gpt2"))
    with pytest.raises(ValueError, match="hidden_act"):
        patch_swiglu(TinyModel(act="gelu"))
    assert {"llama", "qwen2"} <= set(SWIGLU_MLP_CLASSES)


@pytest.mark.gpu
def test_patch_real_qwen2_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 12), device="cuda")
    with torch.no_grad():
        before = model(ids).logits.float()
        assert patch_swiglu(model) == 2
        after = model(ids).logits.float()
    assert torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0) > 0.999
