"""``VQLinear``: a 2-bit linear layer in AQLM's 2x8 format, running :func:`tilefuse.vq_matmul`;
``VQSwiGLUMLP``: a gated MLP of such layers whose gate/up projections and SiLU·mul run as one
:func:`tilefuse.vq_swiglu` call.

Buffers carry AQLM's names and shapes, so the state dict of an AQLM 2x8 ``QuantizedLinear``
(``codes`` [N, K/8, 2] int8, ``codebooks`` [2, 256, 1, 8], ``scales`` [N, 1, 1, 1], ``bias`` [N])
loads as is, and a VQLinear's state dict round-trips through safetensors.
"""

from __future__ import annotations

import torch
from torch import nn

from tilefuse._backend import forced_state
from tilefuse.ops.vq.op import bind_decode, silu_mul_outputs, swiglu_fuses, vq_matmul, vq_swiglu


class VQLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W[n, 8g:8g+8] = scales[n] * (C0[codes[n,g,0]] + C1[codes[n,g,1]])``.

    Parameters
    ----------
    in_features : K, a multiple of 8.
    out_features : N.
    bias : whether the layer has a bias ``[N]``.
    dtype : dtype of codebooks, scales and bias (fp16, bf16 or fp32); inputs in fp16/bf16 run the
        kernels on CUDA, fp32 inputs the PyTorch reference (see :func:`tilefuse.vq_matmul`).
    codes_dtype : ``torch.int8`` (AQLM's checkpoints) or ``torch.uint8``.

    >>> layer = VQLinear.from_linear(nn.Linear(4096, 4096, dtype=torch.float16))  # quantizes
    >>> y = layer(x)                                  # x: [..., 4096] fp16 -> [..., 4096]
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.float16, codes_dtype: torch.dtype = torch.int8, device=None):
        super().__init__()
        if in_features % 8:
            raise ValueError(f"in_features: expected a multiple of 8, got {in_features}")
        if codes_dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"codes_dtype: expected int8 or uint8, got {codes_dtype}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        self.in_features, self.out_features = in_features, out_features
        self._bound = None          # ops.vq.op.BoundDecode of the last decode-size call, or None
        self.register_buffer("codes", torch.zeros(out_features, in_features // 8, 2, dtype=codes_dtype, device=device))
        self.register_buffer("codebooks", torch.zeros(2, 256, 1, 8, dtype=dtype, device=device))
        self.register_buffer("scales", torch.ones(out_features, 1, 1, 1, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decode sizes: the launch bound to this layer's weights and the last input layout (a
        # host-cost shortcut with the same kernel and result; anything else takes vq_matmul)
        compiling = torch.compiler.is_compiling()      # torch.compile traces vq_matmul's custom op only
        bound = None if compiling else getattr(self, "_bound", None)
        if bound is not None and bound.accepts(x, self.codes, self.codebooks, self.scales, self.bias):
            return bound(x)
        out = vq_matmul(x, self.codes, self.codebooks, self.scales, self.bias)
        if x.is_cuda and not compiling:
            bound = bind_decode(x, self.codes, self.codebooks, self.scales, self.bias)
            if bound is not None:       # a prefill call keeps the decode binding
                self._bound = bound
        return out

    def __getstate__(self):
        return {**self.__dict__, "_bound": None}     # pickles and copies rebind on their first call

    @classmethod
    def from_linear(cls, linear: nn.Linear, calib: torch.Tensor | None = None, *,
                    dtype: torch.dtype | None = None, codes_dtype: torch.dtype = torch.int8,
                    progress: bool = True, **quantize_opts) -> "VQLinear":
        """Quantize a dense ``nn.Linear`` with :func:`tilefuse.quantize` (``calib``: ``X^T X``).

        ``progress``: the quantizer's line per stage on stderr (its relative error and the time so
        far; a large layer takes minutes); ``progress=False`` silences it. ``quantize_opts``: the
        quantizer's other options (``iters``, ``beam``, ``init_iters``, ``feedback``, ``seed``,
        ``device``)."""
        from tilefuse.quantizer import quantize

        weight = linear.weight.detach()
        dtype = dtype or (weight.dtype if weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
                          else torch.float32)
        codes, codebooks, scales = quantize(weight, calib, progress=progress, **quantize_opts)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=dtype,
                    codes_dtype=codes_dtype, device=weight.device)
        layer.load_quantized(codes, codebooks, scales, linear.bias)
        return layer

    @torch.no_grad()
    def load_quantized(self, codes, codebooks, scales, bias=None) -> "VQLinear":
        """Copy quantized tensors in (uint8 or int8 codes, same bit patterns either way; wider
        integer codes must lie in [0, 256))."""
        codes = codes.to(self.codes.device)
        if tuple(codes.shape) != tuple(self.codes.shape):
            raise ValueError(f"codes: expected shape {tuple(self.codes.shape)}, got {tuple(codes.shape)}")
        self.codes.copy_(_as_code_dtype(codes, self.codes.dtype, "codes"))
        self.codebooks.copy_(codebooks)
        self.scales.copy_(scales.reshape(self.scales.shape))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias.detach())
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """``load_state_dict`` takes the codes as :meth:`load_quantized` does: int8 or uint8 (the same
        bit patterns either way), or wider integers in [0, 256) (a host sync to check them); other
        dtypes (floats, bool) and out-of-range values raise ``ValueError`` instead of being narrowed
        (int32 300 would become 44, float 3.7 would become 3)."""
        key = prefix + "codes"
        codes = state_dict.get(key)
        if isinstance(codes, torch.Tensor) and codes.dtype != self.codes.dtype:
            state_dict[key] = _as_code_dtype(codes, self.codes.dtype, f"state_dict[{key!r}]")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def dequantize(self) -> torch.Tensor:
        """The dense weight ``[N, K]`` (for checks and baselines)."""
        from tilefuse.ops.vq.reference import dequantize

        return dequantize(self.codes, self.codebooks, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=AQLM 2x8 (2 bits/weight)")


class VQSwiGLUMLP(nn.Module):
    """``y = down_proj(silu(gate_proj(x)) * up_proj(x))`` with 2-bit gate and up projections run by one
    :func:`tilefuse.vq_swiglu` call: at decode sizes one kernel reads x once for both weights and
    writes only ``silu(g) * u`` (where ``vq_matmul`` would run its small-layer kernel; elsewhere the
    two projections' own kernels, then SiLU·mul in one pass).

    The children keep the names of the MLP it replaces -- ``gate_proj`` and ``up_proj``
    (:class:`VQLinear`, the same ``in_features`` and ``out_features``), ``down_proj`` (any module:
    a VQLinear or a dense Linear) -- so the state dict, :func:`tilefuse.hf.save_vq` and
    :func:`tilefuse.hf.save_aqlm` see the same keys as before the swap.

    Shapes: ``x [..., H]`` -> ``[..., H_out]`` (``down_proj``'s); fp16/bf16 run the kernels on
    CUDA, fp32 the PyTorch reference. Where a gradient is wanted (grad mode on and x, a codebook,
    scale or bias requiring one: fine-tuning), since ``vq_swiglu`` has no backward, and where the
    layers have been replaced by other modules since, the two layers run on their own, as in the
    MLP replaced; ``tilefuse.parallel.shard_model``'s column-parallel shards (their output not
    gathered) stay fused over each rank's rows.

    >>> mlp = VQSwiGLUMLP.from_mlp(model.model.layers[0].mlp)     # gate/up already VQLinear
    """

    def __init__(self, gate_proj: VQLinear, up_proj: VQLinear, down_proj: nn.Module):
        super().__init__()
        reason = _unfusable(gate_proj, up_proj)
        if reason:
            raise ValueError(reason)
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self._fuses = {}        # x's layout and the force() state -> swiglu_fuses (eager calls)

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "VQSwiGLUMLP":
        """The fused form of an MLP with ``gate_proj``, ``up_proj`` (VQLinear), ``down_proj`` and a
        SiLU ``act_fn`` (Llama, Mistral, Qwen2/3 and their MoE models' shared and per-expert MLPs);
        shares its layers. ValueError naming what does not fit otherwise (:func:`unfusable_mlp`)."""
        reason = unfusable_mlp(mlp)
        if reason:
            raise ValueError(f"mlp: {reason}")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _vq_layer(self.gate_proj), _vq_layer(self.up_proj)
        if gate is None or up is None or gate.codes.shape != up.codes.shape or (
                torch.is_grad_enabled() and _needs_grad(x, gate, up)):
            # the layers wrapped since in another way, or training and tuning (vq_swiglu has no
            # backward): the layers' own forwards, as the MLP replaced ran them
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        if not torch.compiler.is_compiling():
            # eager: where vq_swiglu would run the two projections unfused, run them through the
            # layers (their bound decode launches, a fraction of the op's host time) and the same
            # one-pass epilogue; the result is vq_swiglu's
            key = (x.shape, x.stride(), x.dtype, x.device, gate.codes.device, gate.codebooks.dtype,
                   up.codebooks.dtype, forced_state())
            fuses = self._fuses.get(key, "?")
            if fuses == "?":
                if len(self._fuses) >= 256:      # prefill lengths: bounded
                    self._fuses.clear()
                fuses = self._fuses[key] = swiglu_fuses(x, gate.codes, gate.codebooks, gate.scales, up.codes,
                                                        up.codebooks, up.scales, gate.bias, up.bias)
            if fuses is False:
                return self.down_proj(silu_mul_outputs(gate(x), up(x)))
        h = vq_swiglu(x, gate.codes, gate.codebooks, gate.scales, up.codes, up.codebooks, up.scales, gate.bias, up.bias)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return "gate_proj and up_proj with silu(gate) * up in one tilefuse.vq_swiglu call"


def _vq_layer(child: nn.Module) -> VQLinear | None:
    """The VQLinear that computes ``child``'s output: ``child`` itself, or the rank's shard a
    column-parallel wrapper holds when it returns that shard's output as is (``local``,
    ``gather_output`` False: ``tilefuse.parallel.ColumnParallel``, so ``shard_model``'s 2-bit
    MLPs stay fused over their local rows, ``down_proj``'s row-parallel shard taking the local
    slice it expects); None otherwise."""
    if isinstance(child, VQLinear):
        return child
    local = getattr(child, "local", None)
    return local if isinstance(local, VQLinear) and getattr(child, "gather_output", True) is False else None


def _needs_grad(x: torch.Tensor, *layers: VQLinear) -> bool:
    return x.requires_grad or any(t is not None and t.requires_grad for layer in layers
                                  for t in (layer.codebooks, layer.scales, layer.bias))


def unfusable_mlp(mlp: nn.Module) -> str | None:
    """Why ``mlp`` cannot become a :class:`VQSwiGLUMLP` (None when it can): it needs ``gate_proj``
    and ``up_proj`` VQLinear layers of one shape, a ``down_proj`` and a SiLU ``act_fn``."""
    from tilefuse.nn.swiglu import is_silu

    missing = [name for name in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, name)]
    if missing:
        return f"expected gate_proj, up_proj, down_proj and act_fn, {type(mlp).__name__} has no {missing}"
    if not is_silu(mlp.act_fn):
        return f"expected a SiLU act_fn (SwiGLU), got {type(mlp.act_fn).__name__}"
    return _unfusable(mlp.gate_proj, mlp.up_proj)


def _unfusable(gate_proj, up_proj) -> str | None:
    for name, layer in (("gate_proj", gate_proj), ("up_proj", up_proj)):
        if not isinstance(layer, VQLinear):
            return f"expected {name} to be a VQLinear (tilefuse.hf.patch_vq), got {type(layer).__name__}"
    if (gate_proj.in_features, gate_proj.out_features) != (up_proj.in_features, up_proj.out_features):
        return (f"expected gate_proj and up_proj of one shape, got {gate_proj.out_features}x{gate_proj.in_features} "
                f"and {up_proj.out_features}x{up_proj.in_features}")
    return None


def _as_code_dtype(codes: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``codes`` as ``dtype`` (int8 or uint8) with the same code values: 1-byte integers keep their
    bit patterns (AQLM's int8 -1 is code 255); int16/32/64 must lie in [0, 256) (read back: a host
    sync; skipped for meta and fake tensors, which hold no values); anything else raises."""
    from tilefuse._checks import contents_unreadable
    from tilefuse.ops.vq.op import WIDE_CODE_DTYPES, check_code_range

    if codes.dtype in (torch.int8, torch.uint8):
        return codes.view(dtype)
    if codes.dtype not in WIDE_CODE_DTYPES:
        raise ValueError(f"{name}: expected integer codes (int8, uint8, or int16/32/64 in [0, 256)), "
                         f"got {codes.dtype}")
    if not contents_unreadable(codes):
        try:
            check_code_range(codes)
        except ValueError as err:
            raise ValueError(f"{name}: {str(err).removeprefix('codes: ')}") from None
    return codes.to(torch.uint8).view(dtype)
