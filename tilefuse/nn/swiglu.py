"""``FusedSwiGLUMLP``: an LLaMA/Qwen-style MLP whose gate/up projection runs as one fused kernel
(bf16/fp16 weights: :func:`tilefuse.swiglu`; e4m3 weights with scales: :func:`tilefuse.swiglu_fp8`)."""

from __future__ import annotations

import torch
from torch import nn

from tilefuse import _scratch
from tilefuse.ops.swiglu.op import LAYOUTS, pack_gate_up, swiglu
from tilefuse.ops.swiglu_fp8.op import swiglu_fp8
from tilefuse.ops.swiglu_fp8.reference import FP8, GROUP, quantize_fp8

# Activation modules that compute SiLU (nn.SiLU; transformers' SiLUActivation, by class name so
# transformers need not be installed).
_SILU_CLASS_NAMES = ("SiLU", "SiLUActivation", "Swish")


def is_silu(act) -> bool:
    """Whether an MLP's ``act_fn`` computes SiLU (``x * sigmoid(x)``)."""
    return act is nn.functional.silu or type(act).__name__ in _SILU_CLASS_NAMES


class FusedSwiGLUMLP(nn.Module):
    """``y = down_proj(silu(x Wg^T + bg) * (x Wu^T + bu))`` with the gate/up part fused.

    Parameters
    ----------
    hidden_size, intermediate_size : H and I (multiples of 8 for bf16/fp16; of 64 for
        ``layout="packed"``).
    bias : whether gate/up carry a bias ([2I], gate biases then up biases).
    down_bias : whether ``down_proj`` carries a bias.
    layout : "merged" (``gate_up_weight`` = gate rows then up rows) or "packed"
        (:func:`tilefuse.pack_gate_up`). The layout is part of the state dict's key names, so a
        state dict is plain tensors (it passes through safetensors) and no route loads one layout's
        weights into a module of the other: merged weights are saved as ``gate_up_weight``, packed
        ones as ``gate_up_weight_packed``, FP8 ones as ``gate_up_weight`` (e4m3) beside
        ``gate_up_scales``. ``load_state_dict`` (strict or not, ``assign`` or not) raises
        ``ValueError`` naming ``state_dict`` when the weights it is given are of another layout or
        kind; dicts saved with the former ``_extra_state`` entry load as before.

    Shapes: ``x: [..., H]`` bf16/fp16 (the fused kernel on CUDA) or fp32 (the PyTorch reference)
    -> ``[..., H]``. ``gate_up_weight: [2I, H]``, ``down_proj.weight: [H, I]``. Trainable: the
    gate/up gradients come from the op's registered backward.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 down_bias: bool = False, layout: str = "merged", device=None, dtype=None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size, self.layout = hidden_size, intermediate_size, layout
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * intermediate_size, **factory)) if bias else None
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=down_bias, **factory)
        nn.init.normal_(self.gate_up_weight, std=hidden_size ** -0.5)

    fp8 = False
    act_group: int | None = None

    @classmethod
    def from_mlp(cls, mlp: nn.Module, layout: str = "merged", *, fp8: bool = False) -> FusedSwiGLUMLP:
        """Build from an HF-style MLP with ``gate_proj``, ``up_proj``, ``down_proj`` (nn.Linear) and a
        SiLU ``act_fn`` (any other activation is refused: the kernel computes SiLU).

        FP8 (the gate/up projection by :func:`tilefuse.swiglu_fp8`): taken when ``gate_proj.weight``
        is float8_e4m3fn (a model loaded from an FP8 checkpoint; see :meth:`_from_fp8_mlp` for the
        layouts read), or with ``fp8=True`` from bf16/fp16 weights, which are then quantized in
        128 x 128 blocks (per output channel if H or I is not a multiple of 128). ``down_proj`` is
        kept as it is (the model's own, FP8 or not).

        No second copy of the weights stays alive: ``down_proj`` is the same module (shared), and
        with ``layout="merged"`` the original ``gate_proj.weight``/``up_proj.weight`` are re-pointed
        at views of the new ``[2I, H]`` tensor, so both modules share one storage (only one layer's
        gate/up exists twice, during the conversion). With ``layout="packed"`` the originals are left
        as they are and freed when the caller drops ``mlp``. The new parameters require gradients
        as the originals did.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise ValueError(f"mlp.{name}: expected an nn.Linear, got {type(getattr(mlp, name, None)).__name__}")
        act = getattr(mlp, "act_fn", None)
        if not is_silu(act):
            raise ValueError(f"mlp.act_fn: expected SiLU (the fused kernel computes silu(gate) * up), "
                             f"got {type(act).__name__ if act is not None else None}")
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        if fp8 or gate.weight.dtype == FP8:
            if layout != "merged":
                raise ValueError(f"layout: expected 'merged' for an FP8 MLP, got {layout!r}")
            return cls._from_fp8_mlp(mlp)
        if gate.weight.shape != up.weight.shape:
            raise ValueError(f"mlp.up_proj.weight: expected shape {tuple(gate.weight.shape)} like "
                             f"gate_proj.weight, got {tuple(up.weight.shape)}")
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("mlp.up_proj.bias: expected a bias on both gate_proj and up_proj or on neither")
        inter, hidden = gate.weight.shape
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.hidden_size, new.intermediate_size, new.layout = hidden, inter, layout
        with torch.no_grad():
            if layout == "packed":
                weight = pack_gate_up(gate.weight.detach(), up.weight.detach())
            else:
                weight = torch.cat((gate.weight.detach(), up.weight.detach()))
                gate.weight.data, up.weight.data = weight[:inter], weight[inter:]
            new.gate_up_weight = nn.Parameter(weight, requires_grad=gate.weight.requires_grad)
            bias = None
            if gate.bias is not None:
                bias = torch.cat((gate.bias.detach(), up.bias.detach()))
                gate.bias.data, up.bias.data = bias[:inter], bias[inter:]
            new.gate_up_bias = (nn.Parameter(bias, requires_grad=gate.bias.requires_grad)
                                if bias is not None else None)
        new.down_proj = down
        return new

    @classmethod
    def _from_fp8_mlp(cls, mlp: nn.Module) -> FusedSwiGLUMLP:
        """The FP8 layout. Read from e4m3 ``gate_proj``/``up_proj`` weights ``[I, H]`` with their
        scales as transformers' ``FP8Linear`` holds them (checkpoints quantized the DeepSeek-V3 /
        ``FineGrainedFP8Config`` way): ``weight_scale_inv`` ``[I/128, H/128]`` (128 x 128 blocks)
        or ``[]`` (per tensor), or ``weight_scale`` ``[I, 1]`` / ``[I]`` (per channel, as
        compressed-tensors FP8 checkpoints store it); scales multiply (``W = weight * scale``).
        Activations are quantized on the fly: 1 x 128 groups with block-scaled weights (as
        ``FP8Linear`` does), per token otherwise. Gate/up biases are refused (no FP8 model has them).
        """
        gate, up = mlp.gate_proj, mlp.up_proj
        if gate.bias is not None or up.bias is not None:
            raise ValueError("mlp.gate_proj.bias: expected no gate/up bias for an FP8 MLP")
        if gate.weight.shape != up.weight.shape:
            raise ValueError(f"mlp.up_proj.weight: expected shape {tuple(gate.weight.shape)} like "
                             f"gate_proj.weight, got {tuple(up.weight.shape)}")
        inter, hidden = gate.weight.shape
        with torch.no_grad():
            if gate.weight.dtype == FP8:
                scales = [_fp8_scales(lin, f"mlp.{name}") for name, lin in (("gate_proj", gate), ("up_proj", up))]
                weight = torch.cat((gate.weight.detach(), up.weight.detach()))
                if scales[0].dim() == 2 and scales[0].shape[0] != inter:        # 128 x 128 blocks
                    if inter % GROUP:
                        raise ValueError(f"mlp.gate_proj.weight: expected I a multiple of 128 with 128 x 128 "
                                         f"block scales, got {inter}")
                    scale = torch.cat(scales)
                else:                                                           # per channel / tensor
                    scale = torch.cat([s.reshape(-1, 1).expand(inter, 1) for s in scales])
            else:
                w = torch.cat((gate.weight.detach(), up.weight.detach()))
                blocks = inter % GROUP == 0 and hidden % GROUP == 0
                weight, scale = quantize_fp8(w, None, block=blocks)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.hidden_size, new.intermediate_size, new.layout, new.fp8 = hidden, inter, "merged", True
        new.gate_up_weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        new.register_buffer("gate_up_scales", scale.float().contiguous())
        new.gate_up_bias = None
        new.act_group = GROUP if scale.shape[0] != 2 * inter else None
        new.down_proj = mlp.down_proj
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            # dynamic activation quantization (1 x 128 groups or per token), then the fused kernel
            xq, x_scales = quantize_fp8(x, self.act_group)
            h = swiglu_fp8(xq, x_scales, self.gate_up_weight, self.gate_up_scales, out_dtype=x.dtype)
        else:
            h = swiglu(x, self.gate_up_weight, self.gate_up_bias, layout=self.layout)
        # down_proj is cuBLAS: while a CUDA graph captures, with a workspace of that graph's own
        return _scratch.blas(self.down_proj, h)

    # The state dict carries the layout in the weight's key name (plain tensors only: safetensors
    # takes them); the parameter itself is ``gate_up_weight`` in every layout.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        name = _WEIGHT_KEYS[self.layout]
        if name != "gate_up_weight" and prefix + "gate_up_weight" in destination:
            destination[prefix + name] = destination.pop(prefix + "gate_up_weight")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _check_state_layout(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"layout={self.layout!r}, bias={self.gate_up_bias is not None}"
                + (f", fp8=True, act_group={self.act_group}" if self.fp8 else ""))


# state-dict key of the gate/up weight per layout
_WEIGHT_KEYS = {"merged": "gate_up_weight", "packed": "gate_up_weight_packed"}


def _check_state_layout(module: FusedSwiGLUMLP, state_dict: dict, prefix: str) -> None:
    """Refuse (``ValueError``) gate/up weights of another layout or kind than ``module``'s, and put
    the weight under the parameter's name (``gate_up_weight``) for ``nn.Module``'s loading. Edits
    ``state_dict``: ``load_state_dict`` hands each module its own copy."""
    key = {layout: prefix + name for layout, name in _WEIGHT_KEYS.items()}
    legacy = state_dict.pop(prefix + "_extra_state", None)     # {"layout", "fp8"}, as saved before the key names
    if legacy is not None:
        layout = legacy.get("layout") if isinstance(legacy, dict) else None
        if layout not in _WEIGHT_KEYS:
            raise ValueError(f"state_dict[{prefix + '_extra_state'!r}]: expected {{'layout': 'merged' or 'packed', "
                             f"'fp8': bool}}, got {legacy!r}")
        if layout == "packed" and key["merged"] in state_dict and key["packed"] not in state_dict:
            state_dict[key["packed"]] = state_dict.pop(key["merged"])
        if bool(legacy.get("fp8", False)) != module.fp8:
            raise ValueError(f"state_dict: expected {'FP8' if module.fp8 else 'bf16/fp16'} gate/up weights "
                             f"(this module's), got the other kind")
    other = "packed" if module.layout == "merged" else "merged"
    if key[other] in state_dict:
        raise ValueError(f"state_dict: expected gate_up_weight in layout {module.layout!r} (this module's, key "
                         f"{key[module.layout]!r}), got weights saved in layout {other!r} ({key[other]!r}); build "
                         f"the module with layout={other!r}")
    weight = state_dict.get(key[module.layout])
    has_scales = prefix + "gate_up_scales" in state_dict
    if module.fp8 and weight is not None and (not has_scales or weight.dtype != FP8):
        raise ValueError(f"state_dict: expected FP8 gate/up weights (this module's: e4m3 {key['merged']!r} with "
                         f"{prefix + 'gate_up_scales'!r}), got {getattr(weight, 'dtype', type(weight).__name__)} "
                         f"weights{'' if has_scales else ' without scales'}")
    if not module.fp8 and (has_scales or getattr(weight, "dtype", None) == FP8):
        raise ValueError(f"state_dict: expected bf16/fp16 gate/up weights (this module's), got FP8 ones "
                         f"(e4m3 weights with {prefix + 'gate_up_scales'!r}); convert an FP8 MLP with "
                         f"FusedSwiGLUMLP.from_mlp")
    if key[module.layout] != key["merged"] and key[module.layout] in state_dict:
        state_dict[key["merged"]] = state_dict.pop(key[module.layout])


def _fp8_scales(linear: nn.Module, name: str) -> torch.Tensor:
    """The dequantization scales of an e4m3 Linear (``weight_scale_inv`` or ``weight_scale``)."""
    for attr in ("weight_scale_inv", "weight_scale"):
        scale = getattr(linear, attr, None)
        if isinstance(scale, torch.Tensor):
            return scale.detach()
    raise ValueError(f"{name}: expected an e4m3 weight with a weight_scale_inv or weight_scale tensor, found neither")
