"""Patch Hugging Face models in place to run tilefuse's modules.

* :func:`patch_swiglu` -- every SwiGLU MLP becomes a :class:`tilefuse.nn.FusedSwiGLUMLP`. One table
  maps a config's ``model_type`` to the class name of its MLP; every such MLP has ``gate_proj``,
  ``up_proj``, ``down_proj`` and a SiLU activation (``config.hidden_act``).
* :func:`patch_vq` -- the attention and MLP projections become 2-bit :class:`tilefuse.nn.VQLinear`
  layers (AQLM 2x8), quantized with calibration data, without, or filled randomly for speed runs.
* :func:`patch_mla`, :class:`PagedMLACache` -- DeepSeek-V2/V3 attention decodes in the absorbed
  form through :func:`tilefuse.flash_mla_with_kvcache` over a paged latent cache
  (:mod:`tilefuse.hf.mla`, imported on first use: it needs transformers).
* :func:`save_vq`, :func:`load_vq` -- a 2-bit model to a directory (its state dict, AQLM's names
  for the 2-bit layers) and back into a freshly built model of the same config.
* :func:`generate` -- ``model.generate``'s greedy / sampled continuation with the decode step
  replayed from a CUDA graph (:mod:`tilefuse.hf.decode`), for stock and patched models.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from tilefuse import _checks
from tilefuse._lazy import lazy_attribute

_PUBLIC = {"patch_mla": "tilefuse.hf.mla", "PagedMLACache": "tilefuse.hf.mla", "generate": "tilefuse.hf.decode",
           "Generator": "tilefuse.hf.decode", "save_aqlm": "tilefuse.hf.aqlm", "load_aqlm": "tilefuse.hf.aqlm"}


def __getattr__(name):
    return lazy_attribute(__name__, _PUBLIC, name)


# model_type -> MLP class name (all with gate_proj / up_proj / down_proj and act_fn).
SWIGLU_MLP_CLASSES = {
    "llama": "LlamaMLP",
    "mistral": "MistralMLP",
    "qwen2": "Qwen2MLP",
    "qwen3": "Qwen3MLP",
    "deepseek_v2": "DeepseekV2MLP",     # the dense blocks' MLPs and the MoE blocks' shared experts
    "deepseek_v3": "DeepseekV3MLP",
}
SILU_NAMES = ("silu", "swish")


def patch_swiglu(model: nn.Module, layout: str = "merged", *, fp8: bool = False) -> int:
    """Swap every SwiGLU MLP of ``model`` for ``FusedSwiGLUMLP.from_mlp`` in place.

    ``model.config.model_type`` picks the MLP class from :data:`SWIGLU_MLP_CLASSES`; models whose
    ``hidden_act`` is not SiLU are refused. MLPs with e4m3 weights (a model loaded from an FP8
    checkpoint through transformers' ``FP8Linear``) run :func:`tilefuse.swiglu_fp8`; ``fp8=True``
    quantizes bf16/fp16 gate/up weights to that layout (128 x 128 blocks). Returns the number of
    modules replaced.
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
        model.set_submodule(name, FusedSwiGLUMLP.from_mlp(mod, layout=layout, fp8=fp8))
    return len(targets)


# Module names of the projections ``patch_vq`` replaces: attention q/k/v/o and the SwiGLU MLP's
# gate/up/down (Llama, Mistral, Qwen2, Qwen3 all use these names). ``lm_head`` is left dense.
VQ_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def patch_vq(model: nn.Module, calibration=None, *, random_codes: bool = False,
             targets: tuple[str, ...] = VQ_PROJECTIONS, seed: int = 0, progress: bool | None = None,
             finetune: int = 0, finetune_lr: float = 1e-4, finetune_e2e: int = 0, finetune_e2e_lr: float = 3e-4,
             finetune_norms: bool = True, finetune_e2e_held_out: int = 0, finetune_e2e_schedule: str = "constant",
             finetune_pv: int = 0,
             finetune_pv_step: float = 0.1, finetune_pv_fraction: float = 0.02, fuse_gate_up: bool = True,
             experts: bool | None = None, **quantize_opts) -> int:
    """Replace the projections of ``model`` by 2-bit :class:`tilefuse.nn.VQLinear` layers, in place.

    Every ``nn.Linear`` whose attribute name is in ``targets`` (default :data:`VQ_PROJECTIONS`)
    becomes a VQLinear in AQLM's 2x8 format, in the Linear's dtype and on its device; the dense
    weight is freed. Three ways to fill the codes:

    * ``calibration`` given (token ids): GPTQ/AQLM practice. Forward hooks collect, for every target
      layer, ``X^T X`` (fp32, ``[K, K]``) of its inputs over one pass of the *dense* model over the
      calibration tokens; then each weight is quantized by ``tilefuse.quantize(weight, X^T X)``.
      Memory: ``4 K^2`` bytes per target layer until it is quantized
      (SmolLM2-135M: 0.5 GB in all; a Llama-3-8B block: 1.2 GB, mostly ``down_proj``).
    * ``calibration`` and ``finetune=N``: AQLM's order and block fine-tuning. The decoder blocks
      are quantized one after the other, each on the inputs the already-quantized blocks produce;
      after a block's projections are quantized, ``N`` Adam steps (one calibration window each,
      learning rate ``finetune_lr``) tune their codebooks and scales so that the block's outputs
      match the dense block's on those inputs (:func:`tilefuse.quantizer.finetune`; the codes stay
      fixed, the result is the same 2x8 format). Slower (a forward and backward of the block per
      step) and better: see docs/vq_quality.md (``tilefuse.hf.vq_sequential``).
    * neither: each weight is quantized without calibration (plain weight MSE).
    * ``random_codes=True``: random codes, codebook entries ``N(0, 1/2)`` (so ``C0[a] + C1[b]`` has unit
      variance) and per-row scales equal to the dense row's RMS, so the layer's weights and outputs
      have the dense layer's magnitude. For speed measurements only; fast, computed on the model's
      device.

    Parameters
    ----------
    model : an HF-style model; with ``calibration`` it is called as ``model(input_ids=ids, use_cache=False)``.
    calibration : token ids: a LongTensor ``[batch, seq]`` or ``[seq]``, or a list of such tensors
        (windows, each one forward pass).
    random_codes : fill the codes randomly instead of quantizing (no ``calibration`` then).
    targets : attribute names of the Linear modules to replace.
    seed : seeds the random codes, and the quantizer's k-means (``quantize(seed=...)``).
    progress : print progress to stderr: the calibration pass, then one line per replaced layer
        (its time, the time so far and an estimate of the time left). Default: on when quantizing
        (with or without ``calibration``: minutes on a real model), off for ``random_codes``
        (fast); ``progress=False`` silences it. :func:`tilefuse.quantize`'s own per-stage lines
        stay off here (one line per layer is enough for a model).
    finetune : Adam steps of block fine-tuning per decoder block (needs ``calibration``; 0: none,
        the one-pass calibration above).
    finetune_lr : Adam's learning rate for ``finetune``.
    finetune_e2e : Adam steps of end-to-end tuning after the quantization (needs ``calibration``; 0:
        none): every VQLinear's codebooks and scales together, one calibration window per step, so
        that the model's next-token distributions match the dense model's (the KL divergence from
        them; ``tilefuse.hf.vq_sequential.tune_end_to_end``). The dense model's head inputs on the
        calibration windows are kept for it (``windows x tokens x hidden`` values in the model's dtype).
        SmolLM2-135M at 2x8: perplexity 28.1 -> 22.4 with 78 steps (docs/vq_quality.md).
    finetune_e2e_lr : Adam's learning rate for ``finetune_e2e``.
    finetune_norms : with ``finetune_e2e``, the RMSNorm weights are tuned too.
    finetune_e2e_held_out : calibration windows (the last ones) kept out of the quantization and
        all tuning, to pick the end-to-end tuning's state: the lowest KL on them among the start and
        every tenth of the steps (0: the state with the lowest KL on the tuning windows, which keeps
        falling after the model stops improving on other text).
    finetune_e2e_schedule : Adam's learning rate over the end-to-end steps: ``"constant"``, or
        ``"cosine"`` (from ``finetune_e2e_lr`` to 0 along a half cosine).
    finetune_pv : with ``finetune_e2e``, rounds of PV-tuning's alternation after the end-to-end
        tuning: each a code step (``tilefuse.hf.vq_sequential.tune_codes_end_to_end``: up to
        ``finetune_pv_fraction`` of every layer's 8-weight groups re-coded toward the weight
        moved by ``finetune_pv_step`` times its norm along the gradient of the KL, kept only if
        the KL falls), then ``finetune_e2e`` more Adam steps on the codebooks and scales. 0: none.
        (Not yet measured on a real model: docs/vq_quality.md.)
    finetune_pv_step, finetune_pv_fraction : the code step's settings (above).
    fuse_gate_up : after the projections are 2-bit, every SwiGLU MLP whose gate and up projections
        both became VQLinear runs them as one :func:`tilefuse.vq_swiglu` call
        (:func:`fuse_vq_mlps`: a :class:`tilefuse.nn.VQSwiGLUMLP` holding the same layers, so the
        state dict keeps its keys). False keeps the MLP modules as they are.
    experts : every MoE block's stacked experts module (transformers' ``Qwen3MoeExperts`` form:
        3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, a SiLU ``act_fn``,
        ``forward(hidden_states, top_k_index, top_k_weights)``; :func:`tilefuse.nn.vq_moe.unsupported_experts`)
        becomes a :class:`tilefuse.nn.VQMoEExperts` running :func:`tilefuse.vq_moe` (routing read on
        the device: graph-capturable), the router kept: random codes with ``random_codes``, else
        each expert's two weights quantized without calibration. Calibrated experts are not built
        (per-expert ``X^T X`` of the routed tokens is not collected): None (the default) keeps the
        experts dense when ``calibration`` is given and converts them otherwise; True with
        ``calibration`` raises ``NotImplementedError``; False keeps the experts dense.
    **quantize_opts : passed to :func:`tilefuse.quantize` (``iters``, ``beam``, ``init_iters``,
        ``feedback``, ``device``).

    Returns the number of modules replaced (Linears and experts modules). Raises ValueError (naming the argument) when no target
    Linear is found, a target's ``in_features`` is not a multiple of 8, or ``calibration`` is not
    token ids or is combined with ``random_codes``.

    >>> patch_vq(model, tokenizer(text, return_tensors="pt").input_ids)     # calibrated, 2 bits/weight
    >>> patch_vq(model, random_codes=True)                                  # speed runs
    """
    _checks.check_bool("fuse_gate_up", fuse_gate_up)
    if experts is not None:
        _checks.check_bool("experts", experts)
    windows = _calibration_windows(calibration, random_codes)
    if experts is None:     # auto: the experts where they can be built, dense under calibration
        experts = not (windows or finetune or finetune_e2e)
    moe = _moe_experts(model) if experts else []
    if moe and (windows or finetune or finetune_e2e):
        raise NotImplementedError(
            f"patch_vq: calibrated 2-bit MoE experts are not built ({len(moe)} experts modules, e.g. {moe[0]!r}): "
            f"the X^T X of the tokens routed to each expert (gate/up) and of each expert's intermediate "
            f"activations (down) is not collected; pass random_codes=True, or calibration=None (each expert "
            f"quantized without calibration), or experts=False (the experts stay dense)")
    layers = _vq_targets(model, targets)
    if progress is None:
        progress = not random_codes
    if not isinstance(progress, bool):
        raise ValueError(f"progress: expected True, False or None, got {progress!r}")
    if not isinstance(finetune, int) or isinstance(finetune, bool) or finetune < 0:
        raise ValueError(f"finetune: expected an int >= 0 (Adam steps per block), got {finetune!r}")
    if finetune and not windows:
        raise ValueError("finetune: expected calibration token ids with finetune > 0 (the block outputs to match "
                         "come from them), got none")
    if not isinstance(finetune_e2e, int) or isinstance(finetune_e2e, bool) or finetune_e2e < 0:
        raise ValueError(f"finetune_e2e: expected an int >= 0 (Adam steps over the whole model), got {finetune_e2e!r}")
    if not isinstance(finetune_e2e_lr, (int, float)) or isinstance(finetune_e2e_lr, bool) or not finetune_e2e_lr > 0:
        raise ValueError(f"finetune_e2e_lr: expected a number > 0, got {finetune_e2e_lr!r}")
    if (not isinstance(finetune_e2e_held_out, int) or isinstance(finetune_e2e_held_out, bool)
            or not 0 <= finetune_e2e_held_out < max(len(windows), 1)):
        raise ValueError(f"finetune_e2e_held_out: expected an int from 0 to the calibration windows less one "
                         f"({max(len(windows) - 1, 0)}), got {finetune_e2e_held_out!r}")
    from tilefuse.quantizer.finetune import SCHEDULES

    if finetune_e2e_schedule not in SCHEDULES:
        raise ValueError(f"finetune_e2e_schedule: expected one of {SCHEDULES}, got {finetune_e2e_schedule!r}")
    if not isinstance(finetune_pv, int) or isinstance(finetune_pv, bool) or finetune_pv < 0:
        raise ValueError(f"finetune_pv: expected an int >= 0 (rounds of code and end-to-end steps), "
                         f"got {finetune_pv!r}")
    if finetune_pv:
        from tilefuse.hf.vq_sequential import check_code_step

        check_code_step(finetune_pv_step, finetune_pv_fraction, prefix="finetune_pv_")
    if finetune_pv and not finetune_e2e:
        raise ValueError("finetune_pv: expected finetune_e2e > 0 with it (each round ends with that many end-to-end "
                         "steps), got finetune_e2e=0")
    if finetune_e2e and not windows:
        raise ValueError("finetune_e2e: expected calibration token ids with finetune_e2e > 0 (the dense "
                         "next-token distributions to match come from them), got none")
    if finetune_e2e:
        from tilefuse.hf.vq_sequential import head_inputs, tune_codes_end_to_end, tune_end_to_end

        dense_inputs = head_inputs(model, windows)           # before any layer is replaced
        fitted = windows[:len(windows) - finetune_e2e_held_out]  # held-out windows calibrate nothing
        replaced = patch_vq(model, fitted, targets=targets, seed=seed, progress=progress, finetune=finetune,
                            finetune_lr=finetune_lr, fuse_gate_up=False, **quantize_opts)
        tune_end_to_end(model, windows, dense_inputs, steps=finetune_e2e, lr=float(finetune_e2e_lr),
                        norms=bool(finetune_norms), progress=progress, held_out=finetune_e2e_held_out,
                        schedule=finetune_e2e_schedule)
        for _ in range(finetune_pv):
            tune_codes_end_to_end(model, windows, dense_inputs, step=finetune_pv_step,
                                  fraction=finetune_pv_fraction, progress=progress, held_out=finetune_e2e_held_out)
            tune_end_to_end(model, windows, dense_inputs, steps=finetune_e2e, lr=float(finetune_e2e_lr),
                            norms=bool(finetune_norms), progress=progress, held_out=finetune_e2e_held_out,
                            schedule=finetune_e2e_schedule)
        if fuse_gate_up:
            fuse_vq_mlps(model)
        return replaced
    if finetune:
        from tilefuse.hf.vq_sequential import quantize_sequential

        replaced = quantize_sequential(model, layers, windows, steps=finetune, lr=float(finetune_lr), seed=seed,
                                       progress=progress, quantize_opts=quantize_opts)[0]
        if fuse_gate_up:
            fuse_vq_mlps(model)
        return replaced
    begin = time.perf_counter()
    if windows:
        if progress:
            tokens = sum(ids.numel() for ids in windows)
            print(f"patch_vq: collecting X^T X of {len(layers)} layers over {len(windows)} calibration "
                  f"window(s), {tokens} tokens", file=sys.stderr, flush=True)
        grams = _input_grams(model, layers, windows)
        if progress:
            print(f"patch_vq: calibration pass done ({time.perf_counter() - begin:.1f} s)", file=sys.stderr,
                  flush=True)
    else:
        grams = {}
    generator = None
    weights_done, weights_total = 0, sum(linear.weight.numel() for _, linear in layers)
    quantizing = time.perf_counter()
    for i, (name, linear) in enumerate(layers, 1):
        start = time.perf_counter()
        if random_codes:
            generator = generator or torch.Generator(device=linear.weight.device).manual_seed(seed)
            layer = _random_vq_linear(linear, generator)
        else:
            from tilefuse.nn.vq import VQLinear

            layer = VQLinear.from_linear(linear, grams.pop(name, None), seed=seed, progress=False, **quantize_opts)
        model.set_submodule(name, layer)
        weights_done += linear.weight.numel()
        if progress:
            now = time.perf_counter()
            left = (now - quantizing) * (weights_total - weights_done) / weights_done
            print(f"patch_vq [{i}/{len(layers)}] {name} {linear.out_features}x{linear.in_features} "
                  f"({now - start:.2f} s; {now - begin:.1f} s so far, about {left:.0f} s left)",
                  file=sys.stderr, flush=True)
    for name in moe:
        start = time.perf_counter()
        if random_codes:
            generator = generator or torch.Generator(device=model.get_submodule(name).gate_up_proj.device).manual_seed(seed)
        model.set_submodule(name, _vq_experts(model.get_submodule(name), random_codes, generator, seed, quantize_opts))
        if progress:
            print(f"patch_vq {name}: 2-bit experts ({time.perf_counter() - start:.2f} s)", file=sys.stderr, flush=True)
    if fuse_gate_up:
        fuse_vq_mlps(model)
    return len(layers) + len(moe)


def _moe_experts(model: nn.Module) -> list[str]:
    """Names of the stacked-experts modules :class:`tilefuse.nn.VQMoEExperts` can replace."""
    from tilefuse.nn.vq_moe import VQMoEExperts, unsupported_experts

    return [name for name, mod in model.named_modules()
            if name and not isinstance(mod, VQMoEExperts) and hasattr(mod, "gate_up_proj")
            and unsupported_experts(mod) is None]


@torch.no_grad()
def _vq_experts(module: nn.Module, random_codes: bool, generator, seed: int, quantize_opts: dict) -> nn.Module:
    """The 2-bit form of one stacked-experts module (random codes, or quantized without calibration)."""
    from tilefuse.nn.vq_moe import VQMoEExperts

    if random_codes:
        return VQMoEExperts.from_experts(module, random_codes=True, generator=generator)
    return VQMoEExperts.from_experts(module, seed=seed, **quantize_opts)


def fuse_vq_mlps(model: nn.Module) -> int:
    """Swap every SwiGLU MLP of ``model`` whose ``gate_proj`` and ``up_proj`` are
    :class:`tilefuse.nn.VQLinear` layers of one shape (and whose ``act_fn`` is SiLU) for a
    :class:`tilefuse.nn.VQSwiGLUMLP` holding the same three layers, in place: the gate/up
    projections and SiLU·mul then run as one :func:`tilefuse.vq_swiglu` call. The state dict keeps
    its keys. Other modules are left alone. Returns the number of MLPs swapped (0 is not an error:
    a model without such MLPs, or one already fused)."""
    from tilefuse.nn.vq import VQSwiGLUMLP, unfusable_mlp

    targets = [name for name, mod in model.named_modules()      # the root ("") cannot be swapped in place
               if name and not isinstance(mod, VQSwiGLUMLP) and hasattr(mod, "gate_proj") and unfusable_mlp(mod) is None]
    for name in targets:
        model.set_submodule(name, VQSwiGLUMLP.from_mlp(model.get_submodule(name)))
    return len(targets)


def _calibration_windows(calibration, random_codes: bool) -> list[torch.Tensor]:
    """``calibration`` as a list of ``[batch, seq]`` int64 tensors (empty for None), validated."""
    if calibration is None:
        return []
    if random_codes:
        raise ValueError("calibration: expected None with random_codes=True (random codes use no data), "
                         "got token ids")
    items = [calibration] if isinstance(calibration, torch.Tensor) else calibration
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"calibration: expected token ids (a LongTensor [batch, seq] or [seq], or a non-empty list "
                         f"of them), got {type(calibration).__name__}")
    windows = []
    for ids in items:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() not in (1, 2):
            what = (f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                    else type(ids).__name__)
            raise ValueError(f"calibration: expected integer token ids of shape [batch, seq] or [seq], got {what}")
        if ids.numel():
            windows.append(ids.long().reshape(-1, ids.shape[-1]))
    if not windows:
        raise ValueError("calibration: expected at least one token, got none")
    return windows


def _vq_targets(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """The (name, Linear) pairs to replace; every one with in_features a multiple of 8."""
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"targets: expected a non-empty tuple of module names, got {targets!r}")
    layers = [(name, mod) for name, mod in model.named_modules()
              if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in targets]
    if not layers:
        raise ValueError(f"model: expected nn.Linear modules named {tuple(targets)}, found none")
    for name, mod in layers:
        if mod.in_features % 8:
            raise ValueError(f"model: {name}.in_features must be a multiple of 8 (AQLM 2x8 groups of 8 inputs), "
                             f"got {mod.in_features}")
    return layers


@contextlib.contextmanager
def input_grams(layers):
    """Within the block: ``X^T X`` (fp32 ``[K, K]``, on the layer's device) of every forward's
    inputs to each of ``layers`` (``(name, nn.Linear)`` pairs), accumulated into the dict it
    yields (one forward pre-hook per layer, removed on exit)."""
    grams = {name: torch.zeros(mod.in_features, mod.in_features, dtype=torch.float32, device=mod.weight.device)
             for name, mod in layers}

    def accumulate(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            grams[name].addmm_(x.T, x)
        return hook

    handles = [mod.register_forward_pre_hook(accumulate(name)) for name, mod in layers]
    try:
        yield grams
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _input_grams(model: nn.Module, layers, windows) -> dict[str, torch.Tensor]:
    """``X^T X`` of every layer's inputs over one forward of ``model`` per window."""
    device = layers[0][1].weight.device
    with input_grams(layers) as grams:
        for ids in windows:
            model(input_ids=ids.to(device), use_cache=False)
    return grams


@torch.no_grad()
def _random_vq_linear(linear: nn.Linear, generator: torch.Generator) -> nn.Module:
    """A VQLinear with random codes and codebooks, scaled to the dense weight's row RMS."""
    from tilefuse.nn.vq import VQLinear

    weight = linear.weight
    n, k = weight.shape
    layer = VQLinear(k, n, linear.bias is not None, dtype=weight.dtype, device=weight.device)
    codes = torch.randint(0, 256, (n, k // 8, 2), generator=generator, device=weight.device, dtype=torch.uint8)
    books = torch.randn(2, 256, 1, 8, generator=generator, device=weight.device) * 0.5 ** 0.5
    scales = weight.float().pow(2).mean(1).sqrt()
    return layer.load_quantized(codes, books.to(weight.dtype), scales.to(weight.dtype), linear.bias)


VQ_FILE = "tilefuse_vq.json"          # which modules are 2-bit, beside the weights
VQ_WEIGHTS = "model.safetensors"


def save_vq(model: nn.Module, path) -> Path:
    """Save a model patched by :func:`patch_vq` to the directory ``path``: its whole state dict
    (``model.safetensors``; the 2-bit layers under AQLM's names: ``codes``, ``codebooks``,
    ``scales``; a weight tied to another, such as an output head tied to the embeddings, once) and
    ``tilefuse_vq.json`` naming the 2-bit modules (``VQLinear`` layers and ``VQMoEExperts``
    experts modules) and their shapes and the tied keys, which :func:`load_vq` reads to rebuild
    them. Returns the directory."""
    from tilefuse.nn.vq import VQLinear
    from tilefuse.nn.vq_moe import VQMoEExperts

    modules = {name: {"in_features": mod.in_features, "out_features": mod.out_features,
                      "bias": mod.bias is not None, "codes_dtype": str(mod.codes.dtype).removeprefix("torch.")}
               for name, mod in model.named_modules() if isinstance(mod, VQLinear)}
    experts = {name: {"num_experts": mod.num_experts, "hidden_dim": mod.hidden_dim,
                      "intermediate_dim": mod.intermediate_dim,
                      "codes_dtype": str(mod.gate_up_codes.dtype).removeprefix("torch.")}
               for name, mod in model.named_modules() if isinstance(mod, VQMoEExperts)}
    if not modules and not experts:
        raise ValueError("model: expected a model patched by tilefuse.hf.patch_vq (no VQLinear or VQMoEExperts "
                         "module found)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state, first, tied = {}, {}, {}
    for key, tensor in model.state_dict().items():   # a tied weight (lm_head = embed_tokens) once: safetensors
        where = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())  # refuses shared memory
        if tensor.numel() and where in first:
            tied[key] = first[where]
            continue
        first[where] = key
        state[key] = tensor.detach().contiguous()
    _write_tensors(state, folder / VQ_WEIGHTS)
    (folder / VQ_FILE).write_text(json.dumps({"format": "aqlm-2x8", "modules": modules, "experts": experts,
                                              "tied": tied}, indent=1, sort_keys=True))
    return folder


def load_vq(model: nn.Module, path, *, fuse_gate_up: bool = True) -> nn.Module:
    """Load what :func:`save_vq` wrote into ``model``, a freshly built model of the same config
    (``from_config``, or ``from_pretrained`` of the dense checkpoint): the modules named in
    ``tilefuse_vq.json`` become :class:`tilefuse.nn.VQLinear` shells (and its stacked experts
    modules :class:`tilefuse.nn.VQMoEExperts` shells), then the whole state dict is loaded
    (strictly: every key must match). Returns ``model``. A directory that is not what
    ``save_vq`` writes (a missing or malformed ``tilefuse_vq.json``, codes of another dtype or out
    of [0, 256), weights that do not match the model) raises ValueError naming the file.
    ``fuse_gate_up``: as :func:`patch_vq`'s (:func:`fuse_vq_mlps` after the load)."""
    _checks.check_bool("fuse_gate_up", fuse_gate_up)
    folder = Path(path)
    spec_path = folder / VQ_FILE
    if not spec_path.exists():
        raise ValueError(f"path: expected a directory written by tilefuse.hf.save_vq ({VQ_FILE} in it), got {folder}")
    spec = read_json(spec_path)
    modules = _vq_spec(spec, spec_path)
    experts = _experts_spec(spec, spec_path)
    names = set(modules)
    layers = {name: mod for name, mod in model.named_modules() if name in names}
    stacks = {name: mod for name, mod in model.named_modules() if name in experts}
    missing = sorted((names | set(experts)) - set(layers) - set(stacks))
    if missing:
        raise ValueError(f"model: expected the modules {missing[:4]}{'...' if len(missing) > 4 else ''} named in "
                         f"{spec_path} (a model of the saved config)")
    from tilefuse.nn.vq import VQLinear, _as_code_dtype

    for name, linear in layers.items():
        shape = modules[name]
        if not isinstance(linear, nn.Linear) or (linear.in_features, linear.out_features) != (
                shape["in_features"], shape["out_features"]):
            raise ValueError(f"model: {name} is {type(linear).__name__} "
                             f"{getattr(linear, 'out_features', '?')}x{getattr(linear, 'in_features', '?')}, "
                             f"the saved layer is {shape['out_features']}x{shape['in_features']}")
        weight = linear.weight
        model.set_submodule(name, VQLinear(shape["in_features"], shape["out_features"], bias=shape["bias"],
                                           dtype=weight.dtype, codes_dtype=getattr(torch, shape["codes_dtype"]),
                                           device=weight.device))
    from tilefuse.nn.vq_moe import VQMoEExperts, unsupported_experts

    for name, stack in stacks.items():
        shape = experts[name]
        why = unsupported_experts(stack)
        gate_up = getattr(stack, "gate_up_proj", None)
        dims = (shape["num_experts"], 2 * shape["intermediate_dim"], shape["hidden_dim"])
        if why is not None or tuple(gate_up.shape) != dims:
            raise ValueError(f"model: {name} is {type(stack).__name__} ({why or f'gate_up_proj {tuple(gate_up.shape)}'}), "
                             f"the saved experts are [E, 2I, H] = {list(dims)}")
        model.set_submodule(name, VQMoEExperts(shape["num_experts"], shape["hidden_dim"], shape["intermediate_dim"],
                                               dtype=gate_up.dtype, codes_dtype=getattr(torch, shape["codes_dtype"]),
                                               device=gate_up.device))
    weights = folder / VQ_WEIGHTS
    state = _read_tensors(weights)
    for key, source in spec.get("tied", {}).items():    # written once by save_vq
        if source in state:
            state.setdefault(key, state[source])
    for name in names:                      # the codes, checked here so that an error names the file
        key = f"{name}.codes"
        if isinstance(state.get(key), torch.Tensor):
            state[key] = _as_code_dtype(state[key], getattr(torch, modules[name]["codes_dtype"]),
                                        f"path: {weights}: tensor {key!r}")
    for name in experts:
        for key in (f"{name}.gate_up_codes", f"{name}.down_codes"):
            if isinstance(state.get(key), torch.Tensor):
                state[key] = _as_code_dtype(state[key], getattr(torch, experts[name]["codes_dtype"]),
                                            f"path: {weights}: tensor {key!r}")
    load_strict(model, state, weights)
    if fuse_gate_up:
        fuse_vq_mlps(model)
    return model


CODES_DTYPES = ("int8", "uint8")


def _codes_dtype(entry: dict, where: str, default: str) -> str:
    """An entry's ``codes_dtype`` (``default`` when absent), one of :data:`CODES_DTYPES`."""
    codes_dtype = entry.get("codes_dtype", default)
    if codes_dtype not in CODES_DTYPES:
        raise ValueError(f"{where}: codes_dtype must be one of {CODES_DTYPES}, got {codes_dtype!r}")
    return codes_dtype


def _vq_spec(spec, spec_path: Path) -> dict:
    """The ``modules`` of ``tilefuse_vq.json`` (``spec``, read from ``spec_path``): name ->
    in_features, out_features, bias, codes_dtype (``"int8"`` when absent), validated; a malformed
    file raises ValueError naming it."""
    if not isinstance(spec, dict) or "modules" not in spec:
        raise ValueError(f"path: {spec_path} has no \"modules\" key (the 2-bit modules save_vq lists), got "
                         f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__}")
    modules = spec["modules"]
    if not isinstance(modules, dict):
        raise ValueError(f"path: {spec_path}: \"modules\" must map module names to their shapes, got "
                         f"{type(modules).__name__}")
    out = {}
    for name, entry in modules.items():
        where = f"path: {spec_path}: modules[{name!r}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object with in_features, out_features and bias, got {entry!r}")
        for key in ("in_features", "out_features", "bias"):
            if key not in entry:
                raise ValueError(f"{where}: missing the key {key!r}")
        k, n, bias = entry["in_features"], entry["out_features"], entry["bias"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (k, n)) or k % 8:
            raise ValueError(f"{where}: expected in_features a positive multiple of 8 and out_features > 0, "
                             f"got {k!r} and {n!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"{where}: expected bias true or false, got {bias!r}")
        out[name] = dict(in_features=k, out_features=n, bias=bias, codes_dtype=_codes_dtype(entry, where, "int8"))
    return out


def _experts_spec(spec: dict, spec_path: Path) -> dict:
    """The ``experts`` of ``tilefuse_vq.json`` (``spec``, checked by :func:`_vq_spec` first; absent
    in files without 2-bit experts): name -> num_experts, hidden_dim, intermediate_dim,
    codes_dtype, validated; a malformed entry raises ValueError naming the file."""
    experts = spec.get("experts", {})
    if not isinstance(experts, dict):
        raise ValueError(f"path: {spec_path}: \"experts\" must map module names to their shapes, got "
                         f"{type(experts).__name__}")
    out = {}
    for name, entry in experts.items():
        where = f"path: {spec_path}: experts[{name!r}]"
        keys = ("num_experts", "hidden_dim", "intermediate_dim")
        if not isinstance(entry, dict) or any(key not in entry for key in keys):
            raise ValueError(f"{where}: expected an object with {', '.join(keys)} and codes_dtype, got {entry!r}")
        e, h, i = (entry[key] for key in keys)
        if (not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (e, h, i)) or h % 8 or i % 8):
            raise ValueError(f"{where}: expected num_experts > 0 and hidden_dim, intermediate_dim positive "
                             f"multiples of 8, got {e!r}, {h!r}, {i!r}")
        out[name] = dict(num_experts=e, hidden_dim=h, intermediate_dim=i,
                         codes_dtype=_codes_dtype(entry, where, "uint8"))
    return out


def read_json(file: Path):
    """``file``'s JSON; unreadable JSON raises ValueError naming the file and where it breaks."""
    try:
        return json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"path: {file} is not valid JSON ({err})") from None


def load_strict(model: nn.Module, state: dict, source, *, ignore_missing=()) -> None:
    """``model.load_state_dict(state)``, strict but for the missing keys in ``ignore_missing``;
    mismatched keys or shapes raise ValueError naming ``source`` (the file the weights came from)."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:      # shapes that do not match
        raise ValueError(f"path: the weights in {source} do not match {type(model).__name__}: {err}") from None
    missing = [key for key in missing if key not in ignore_missing]
    if missing or unexpected:
        raise ValueError(f"path: the weights in {source} do not match {type(model).__name__}: missing "
                         f"{missing[:4]}{'...' if len(missing) > 4 else ''} ({len(missing)}), unexpected "
                         f"{unexpected[:4]}{'...' if len(unexpected) > 4 else ''} ({len(unexpected)})")


def _write_tensors(state: dict, file: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:          # safetensors is optional: torch's own format then
        torch.save(state, file)
        return
    save_file(state, str(file))


def _read_tensors(file: Path) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        return torch.load(file, weights_only=True)
    try:
        return load_file(str(file))
    except Exception:            # written by torch.save where safetensors was missing
        return torch.load(file, weights_only=True)
