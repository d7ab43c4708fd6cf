"""``VQMoEExperts``: an MoE block's routed experts with 2-bit weights, running :func:`tilefuse.vq_moe`.

A drop-in for transformers' stacked-experts modules (``Qwen3MoeExperts`` and the modules of the
same form: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, a SiLU ``act_fn``,
``forward(hidden_states, top_k_index, top_k_weights)``): the router stays the model's own. The
routing is read on the device, so a decode step with these experts is CUDA-graph capturable.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tilefuse.ops.vq.op import vq_moe

FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


class VQMoEExperts(nn.Module):
    """``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` for ``e = top_k_index[t, j]``
    with every expert's weights in AQLM's 2x8 format (:func:`tilefuse.vq_moe`).

    Buffers: ``gate_up_codes [E, 2I, H/8, 2]`` (per expert the gate's I rows, then the up's),
    ``gate_up_codebooks [E, 2, 256, 1, 8]``, ``gate_up_scales [E, 2I, 1, 1, 1]``,
    ``down_codes [E, H, I/8, 2]``, ``down_codebooks [E, 2, 256, 1, 8]``, ``down_scales [E, H, 1, 1, 1]``.

    Parameters
    ----------
    num_experts : E.
    hidden_dim : H, a multiple of 8.
    intermediate_dim : I, a multiple of 8.
    dtype : codebooks' and scales' dtype (fp16, bf16 or fp32).
    codes_dtype : ``torch.uint8`` or ``torch.int8`` (AQLM's).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: fp16 /
    bf16 run the kernels on CUDA, fp32 the PyTorch reference. An expert id outside ``[0, E)``
    contributes nothing (transformers' expert-parallel sentinel is E).

    >>> experts = VQMoEExperts.from_experts(model.model.layers[0].mlp.experts)   # quantizes
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, codes_dtype: torch.dtype = torch.uint8, device=None):
        super().__init__()
        for name, value in (("hidden_dim", hidden_dim), ("intermediate_dim", intermediate_dim)):
            if not isinstance(value, int) or value <= 0 or value % 8:
                raise ValueError(f"{name}: expected a positive multiple of 8, got {value!r}")
        if not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
        if codes_dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"codes_dtype: expected int8 or uint8, got {codes_dtype}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        e, h, i = num_experts, hidden_dim, intermediate_dim
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
        self.register_buffer("gate_up_codes", torch.zeros(e, 2 * i, h // 8, 2, dtype=codes_dtype, device=device))
        self.register_buffer("gate_up_codebooks", torch.zeros(e, 2, 256, 1, 8, dtype=dtype, device=device))
        self.register_buffer("gate_up_scales", torch.ones(e, 2 * i, 1, 1, 1, dtype=dtype, device=device))
        self.register_buffer("down_codes", torch.zeros(e, h, i // 8, 2, dtype=codes_dtype, device=device))
        self.register_buffer("down_codebooks", torch.zeros(e, 2, 256, 1, 8, dtype=dtype, device=device))
        self.register_buffer("down_scales", torch.ones(e, h, 1, 1, 1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return vq_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_codes, self.gate_up_codebooks,
                      self.gate_up_scales, self.down_codes, self.down_codebooks, self.down_scales)

    @torch.no_grad()
    def load_quantized(self, expert: int, gate_up: tuple, down: tuple) -> "VQMoEExperts":
        """Copy expert ``expert``'s quantized weights in: ``gate_up`` and ``down`` are
        ``(codes, codebooks, scales)`` as :func:`tilefuse.quantize` returns them for its ``[2I, H]``
        and ``[H, I]`` weights (codes uint8 or int8, the same bit patterns either way)."""
        for prefix, (codes, books, scales) in (("gate_up", gate_up), ("down", down)):
            own = getattr(self, f"{prefix}_codes")
            if tuple(codes.shape) != tuple(own.shape[1:]):
                raise ValueError(f"{prefix}: expected codes of shape {tuple(own.shape[1:])}, got {tuple(codes.shape)}")
            own[expert].copy_(codes.to(own.device).view(own.dtype) if codes.dtype in (torch.int8, torch.uint8)
                              else codes.to(own.device).to(own.dtype))
            getattr(self, f"{prefix}_codebooks")[expert].copy_(books.reshape(2, 256, 1, 8))
            target = getattr(self, f"{prefix}_scales")[expert]
            target.copy_(scales.reshape(target.shape))
        return self

    @classmethod
    def from_experts(cls, experts: nn.Module, *, random_codes: bool = False, generator: torch.Generator | None = None,
                     progress: bool = False, **quantize_opts) -> "VQMoEExperts":
        """2-bit experts of a stacked-experts module (:func:`unsupported_experts` says which fit), in
        its weights' dtype and on their device. ``random_codes``: random codes, codebook entries
        ``N(0, 1/2)`` and per-row scales equal to the dense rows' RMS (speed runs; ``generator``
        seeds them); otherwise each expert's ``[2I, H]`` and ``[H, I]`` weights are quantized by
        :func:`tilefuse.quantize` without calibration (``quantize_opts``: its options)."""
        reason = unsupported_experts(experts)
        if reason:
            raise ValueError(f"experts: {reason}")
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        e, two_i, h = gate_up.shape
        dtype = gate_up.dtype if gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
        module = cls(e, h, two_i // 2, dtype=dtype, device=gate_up.device)
        if random_codes:
            device = gate_up.device
            generator = generator or torch.Generator(device=device).manual_seed(0)
            for codes in (module.gate_up_codes, module.down_codes):
                codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, device=device, dtype=torch.uint8)
                            .view(codes.dtype))
            for books in (module.gate_up_codebooks, module.down_codebooks):
                books.copy_(torch.randn(books.shape, generator=generator, device=device) * 0.5 ** 0.5)
            module.gate_up_scales.copy_(gate_up.float().pow(2).mean(2).sqrt().reshape(module.gate_up_scales.shape))
            module.down_scales.copy_(down.float().pow(2).mean(2).sqrt().reshape(module.down_scales.shape))
            return module
        from tilefuse.quantizer import quantize

        for expert in range(e):
            module.load_quantized(expert, quantize(gate_up[expert], None, progress=progress, **quantize_opts),
                                  quantize(down[expert], None, progress=progress, **quantize_opts))
        return module

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (checks and baselines)."""
        from tilefuse.ops.vq.reference import dequantize

        return tuple(torch.stack([dequantize(getattr(self, f"{p}_codes")[e], getattr(self, f"{p}_codebooks")[e],
                                             getattr(self, f"{p}_scales")[e]) for e in range(self.num_experts)])
                     for p in ("gate_up", "down"))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, format=AQLM 2x8 (2 bits/weight)")


def unsupported_experts(module: nn.Module) -> str | None:
    """Why ``module`` is not a stacked-experts module :class:`VQMoEExperts` can replace, or None:
    3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (H and I multiples of 8), a SiLU
    ``act_fn``, ``forward(hidden_states, top_k_index, top_k_weights)``, and where transformers'
    experts-implementation decorator describes the layout, gate and up concatenated (not
    interleaved), not transposed, no biases, no post-expert norm."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "expected tensors gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
    if gate_up.dim() != 3 or down.dim() != 3:
        return (f"expected 3-D gate_up_proj and down_proj, got shapes {tuple(gate_up.shape)} and "
                f"{tuple(down.shape)}")
    e, two_i, h = gate_up.shape
    if two_i % 16 or h % 8 or tuple(down.shape) != (e, h, two_i // 2):
        return (f"expected gate_up_proj [E, 2I, H] and down_proj [E, H, I] with H and I multiples of 8, got "
                f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    layout = {"is_transposed": False, "has_bias": False, "has_post_expert_norm": False, "is_concatenated": True,
              "has_gate": True}
    for name, want in layout.items():
        if getattr(module, name, want) != want:
            return f"expected {name}={want} (the stacked Qwen3-MoE layout), got {getattr(module, name)}"
    act = getattr(module, "act_fn", None)
    if act is None or "silu" not in type(act).__name__.lower():
        return f"expected a SiLU act_fn, got {type(act).__name__}"
    try:      # follows transformers' decorator (functools.wraps) to the forward it wraps
        params = tuple(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = ()
    if params != FORWARD_ARGS:
        return f"expected forward{FORWARD_ARGS}, got forward{params}"
    return None
