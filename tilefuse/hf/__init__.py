"""Patch Hugging Face models so their SwiGLU MLPs run :class:`tilefuse.nn.FusedSwiGLUMLP`.

One table maps a config's ``model_type`` to the class name of its MLP; every such MLP has
``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU activation (``config.hidden_act``).
"""

from __future__ import annotations

from torch import nn

# model_type -> MLP class name (all with gate_proj / up_proj / down_proj and act_fn).
SWIGLU_MLP_CLASSES = {
    "llama": "LlamaMLP",
    "mistral": "MistralMLP",
    "qwen2": "Qwen2MLP",
    "qwen3": "Qwen3MLP",
}
SILU_NAMES = ("silu", "swish")


def patch_swiglu(model: nn.Module, layout: str = "merged") -> int:
    """Swap every SwiGLU MLP of ``model`` for ``FusedSwiGLUMLP.from_mlp`` in place.

    ``model.config.model_type`` picks the MLP class from :data:`SWIGLU_MLP_CLASSES`; models whose
    ``hidden_act`` is not SiLU are refused. Returns the number of modules replaced.
    """
    from tilefuse.nn.swiglu import FusedSwiGLUMLP

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SWIGLU_MLP_CLASSES:
        raise ValueError(f"model: expected config.model_type in {sorted(SWIGLU_MLP_CLASSES)}, got {model_type!r}")
    act = getattr(config, "hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"model: expected config.hidden_act in {SILU_NAMES} (SwiGLU), got {act!r}")
    cls_name = SWIGLU_MLP_CLASSES[model_type]
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ == cls_name]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedSwiGLUMLP.from_mlp(mod, layout=layout))
    return len(targets)
