"""Block-by-block 2-bit quantization of a Hugging Face model with fine-tuning (``patch_vq(finetune=N)``).

AQLM's order: the decoder blocks are quantized one after the other, each on the inputs that the
already-quantized blocks before it produce (so it can compensate their errors), and after each
block's projections are quantized, their codebooks and scales are tuned by Adam so that the
block's outputs match the dense block's on those inputs (``tilefuse.quantizer.finetune``; the
codes stay fixed, so the result is the 2x8 format the kernels read). Then the block's Linear
modules become :class:`tilefuse.nn.VQLinear` and its quantized outputs feed the next block.

The blocks are found as the longest ``nn.ModuleList`` of the model that holds target Linear
modules (``model.model.layers`` in transformers' decoder models); every call of the first block
during a forward over the calibration windows is captured with its positional and keyword
arguments (hidden states, position embeddings, masks), which the later blocks take too.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch import nn
from torch.func import functional_call

from tilefuse.quantizer.finetune import adam_keep_best


class _Captured(Exception):
    """Raised by the first block's hook: the forward has gone as far as it needs to."""


def decoder_blocks(model: nn.Module, layers: list[tuple[str, nn.Linear]]) -> tuple[str, nn.ModuleList]:
    """(name, the ModuleList of decoder blocks): the longest ModuleList holding target Linears."""
    names = [name for name, _ in layers]
    found = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (found is None or len(mod) > len(found[1])):
            prefix = f"{name}." if name else ""
            if any(n.startswith(prefix) for n in names):
                found = (name, mod)
    if found is None:
        raise ValueError("model: finetune needs the target Linear modules inside a list of decoder blocks "
                         "(an nn.ModuleList such as model.model.layers), found none")
    return found


def _hidden(out) -> torch.Tensor:
    """A block's output hidden states (transformers' blocks return a tensor or a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _with_hidden(call: tuple[tuple, dict], hidden: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


@torch.no_grad()
def _first_block_calls(model: nn.Module, block: nn.Module, windows: list[torch.Tensor]) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of every call of ``block`` over one forward per calibration window."""
    calls = []

    def hook(module, args, kwargs):
        calls.append((args, dict(kwargs)))
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    device = next(block.parameters()).device
    try:
        for ids in windows:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return calls


@torch.no_grad()
def _block_grams(block: nn.Module, targets: dict[str, nn.Linear], calls) -> tuple[list, dict]:
    """The dense block's outputs on ``calls`` and ``X^T X`` of each target Linear's inputs."""
    from tilefuse.hf import input_grams

    with input_grams(list(targets.items())) as grams:
        outputs = [_hidden(block(*args, **kwargs)) for args, kwargs in calls]
    return outputs, grams


def quantize_sequential(model: nn.Module, layers: list[tuple[str, nn.Linear]], windows: list[torch.Tensor], *,
                        steps: int, lr: float, seed: int, progress: bool, quantize_opts: dict) -> tuple[int, dict]:
    """Quantize ``layers`` block by block with ``steps`` Adam steps of tuning per block (see the
    module docstring). Returns (modules replaced, {block name: finetune info})."""
    from tilefuse.nn.vq import VQLinear
    from tilefuse.quantizer import finetune, quantize

    list_name, blocks = decoder_blocks(model, layers)
    prefix = f"{list_name}." if list_name else ""
    by_block: dict[int, dict[str, nn.Linear]] = {}
    for name, mod in layers:
        if name.startswith(prefix):
            index, _, rel = name[len(prefix):].partition(".")
            by_block.setdefault(int(index), {})[rel] = mod
    outside = [name for name, _ in layers if not name.startswith(prefix)]
    if outside:
        raise ValueError(f"model: finetune quantizes the decoder blocks of {list_name!r} only; target Linear "
                         f"modules outside them: {outside[:3]}")
    begin = time.perf_counter()
    calls = _first_block_calls(model, blocks[0], windows)
    if progress:
        print(f"patch_vq: {len(blocks)} blocks, {len(calls)} calibration window(s); quantizing block by block, "
              f"{steps} tuning steps each", file=sys.stderr, flush=True)
    replaced, info = 0, {}
    for b, block in enumerate(blocks):
        start = time.perf_counter()
        targets = by_block.get(b, {})
        if targets:
            outputs, grams = _block_grams(block, targets, calls)
            formats = {rel: quantize(mod.weight.detach(), grams.pop(rel), seed=seed, progress=False, **quantize_opts)
                       for rel, mod in targets.items()}

            def forward(weights, call, block=block, targets=targets):
                args, kwargs = call
                params = {f"{rel}.weight": w.to(targets[rel].weight.dtype) for rel, w in weights.items()}
                return _hidden(functional_call(block, params, args, kwargs))

            formats, info[f"{prefix}{b}"] = finetune(forward, formats, calls, outputs, steps=steps, lr=lr,
                                                     progress=False)
            for rel, mod in targets.items():
                layer = VQLinear(mod.in_features, mod.out_features, mod.bias is not None,
                                 dtype=mod.weight.dtype if mod.weight.dtype in (torch.float16, torch.bfloat16)
                                 else torch.float32, device=mod.weight.device)
                block.set_submodule(rel, layer.load_quantized(*formats[rel], mod.bias))
                replaced += 1
            del formats, outputs
        with torch.no_grad():
            calls = [_with_hidden(call, _hidden(block(*call[0], **call[1]))) for call in calls]
        if progress:
            now = time.perf_counter()
            left = (now - begin) * (len(blocks) - b - 1) / (b + 1)
            tuned = info.get(f"{prefix}{b}")
            err = (f"block output error {tuned['error_before']:.4f} -> {tuned['error_after']:.4f}; "
                   if tuned else "")
            print(f"patch_vq block [{b + 1}/{len(blocks)}] {err}{now - start:.1f} s; {now - begin:.1f} s so far, "
                  f"about {left:.0f} s left", file=sys.stderr, flush=True)
    return replaced, info


# ------------------------------------------------------------------------- end-to-end tuning


@torch.no_grad()
def head_inputs(model: nn.Module, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs of the model's output head (``get_output_embeddings()``: the final normed hidden
    states) on each calibration window: the dense model's next-token distributions, kept as
    ``[batch, seq, hidden]`` instead of vocabulary-wide logits."""
    head = _output_head(model)
    captured = []
    handle = head.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    device = head.weight.device
    try:
        for ids in windows:
            model(input_ids=ids.to(device), use_cache=False)
    finally:
        handle.remove()
    return captured


def _output_head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError("model: finetune_e2e needs a causal LM whose get_output_embeddings() is an nn.Linear "
                         "(the dense next-token head), found none")
    return head


def _norm_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: weight}`` of every RMSNorm-like module (its class name ends in ``RMSNorm``)."""
    return {f"{name}.weight" if name else "weight": mod.weight for name, mod in model.named_modules()
            if type(mod).__name__.endswith("RMSNorm") and isinstance(getattr(mod, "weight", None), torch.Tensor)}


def _next_token_kl(logits: torch.Tensor, head: nn.Module, dense_inputs: torch.Tensor) -> torch.Tensor:
    """KL divergence of the model's next-token distributions from the dense model's, nats per token."""
    with torch.no_grad():
        log_p = torch.log_softmax(head(dense_inputs.to(head.weight.dtype)).float(), dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    return torch.nn.functional.kl_div(log_q.flatten(0, -2), log_p.flatten(0, -2), log_target=True,
                                      reduction="batchmean")


def _tuned_and_scored(windows: list, held_out: int) -> tuple[int, range]:
    """(windows tuned on: all but the last ``held_out``, the windows a state is scored on: the
    held-out ones, else the tuned ones); ValueError unless one window at least is tuned on."""
    tuned = len(windows) - held_out
    if held_out < 0 or tuned < 1:
        raise ValueError(f"held_out: expected 0 to {len(windows) - 1} windows (one at least is tuned on), "
                         f"got {held_out}")
    return tuned, (range(tuned, len(windows)) if held_out else range(tuned))


@contextlib.contextmanager
def _frozen_parameters(model: nn.Module):
    """The model's own parameters without gradients for the duration (so that a backward pass
    reaches only the tuned leaves), their flags restored after."""
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def tune_end_to_end(model: nn.Module, windows: list[torch.Tensor], dense_inputs: list[torch.Tensor], *,
                    steps: int, lr: float, norms: bool, progress: bool, held_out: int = 0,
                    schedule: str = "constant") -> dict:
    """Tune every :class:`tilefuse.nn.VQLinear`'s codebooks and scales of ``model`` together (and,
    with ``norms``, every RMSNorm weight) so that the model's next-token distributions match the
    dense model's on the calibration windows: Adam on fp32 copies, one window per step, the KL
    divergence from the dense distributions (``dense_inputs``: :func:`head_inputs` of the dense
    model) as the loss; the codes stay fixed (the 2x8 format the kernels read). AQLM's and
    PV-tuning's end-to-end step; ``tools/vq_quality.py --e2e-loss kl --e2e-norms`` measures it.

    The tuned values are written back in the tensors' own dtypes when the mean KL over the windows
    went down, else nothing changes. With ``held_out`` the last that many windows are not tuned on
    but pick the state: the one with the lowest mean KL on them among the start and every tenth of
    the steps (the tuning windows' KL keeps falling after the model stops improving on other text).
    ``schedule``: Adam's rate stays ``lr`` or falls to 0 along a half cosine (``"cosine"``).
    Returns ``{"error_before", "error_after", "steps", "seconds"}`` (mean KL, nats per token, on
    the scored windows) and, with ``held_out``, ``"best_step"``."""
    from tilefuse.nn.vq import VQLinear

    begin = time.perf_counter()
    head = _output_head(model)
    device = head.weight.device
    targets = {}
    for name, mod in model.named_modules():
        if isinstance(mod, VQLinear):
            targets[f"{name}.codebooks"] = mod.codebooks
            targets[f"{name}.scales"] = mod.scales
    if not targets:
        raise ValueError("model: finetune_e2e tunes VQLinear layers, found none")
    if norms:
        targets.update(_norm_weights(model))
    masters = {name: t.detach().float().clone().requires_grad_(True) for name, t in targets.items()}

    def loss(i: int, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            # the model with the fp32 masters rounded to each tensor's dtype (the rounding passes
            # the gradient through to the master)
            overrides = {name: masters[name].to(t.dtype) for name, t in targets.items()}
            out = functional_call(model, overrides, (), {"input_ids": windows[i].to(device), "use_cache": False})
            return _next_token_kl(out.logits, head, dense_inputs[i])

    tuned, scored = _tuned_and_scored(windows, held_out)

    def mean_kl() -> float:
        return sum(float(loss(i, False)) for i in scored) / len(scored)

    every = max(1, steps // 10)

    def on_step(done: int, value: torch.Tensor) -> None:
        if progress and done % every == 0:
            now = time.perf_counter() - begin
            print(f"patch_vq end to end [{done}/{steps}] KL {value.item():.4f} nats/token; {now:.1f} s so "
                  f"far, about {now * (steps - done) / done:.0f} s left", file=sys.stderr, flush=True)

    with _frozen_parameters(model):                 # gradients for the masters only
        final, before, after, best_step = adam_keep_best(masters, lambda step: loss(step % tuned, True), steps, lr,
                                                         mean_kl, validated=bool(held_out), check_every=every,
                                                         on_step=on_step, schedule=schedule)
    if final is not None:
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(final[name])
    info = {"error_before": before, "error_after": after, "steps": steps,
            "seconds": round(time.perf_counter() - begin, 2)}
    if held_out:
        info["best_step"] = best_step
    if progress:
        print(f"patch_vq end to end: KL {before:.4f} -> {info['error_after']:.4f} nats/token over {len(windows)} "
              f"window(s), {info['seconds']:.1f} s", file=sys.stderr, flush=True)
    return info


def check_code_step(step, fraction, beam=1, prefix: str = "") -> None:
    """:func:`tune_codes_end_to_end`'s settings, checked before any work (ValueError naming the
    argument, ``prefix`` before its name: ``patch_vq`` passes them as ``finetune_pv_...``)."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for name, value, ok, expected in (
            ("step", step, number(step) and step > 0, "a number > 0"),
            ("fraction", fraction, number(fraction) and 0 < fraction <= 1, "a number in (0, 1]"),
            ("beam", beam, number(beam) and isinstance(beam, int) and 1 <= beam <= 256, "an int from 1 to 256")):
        if not ok:
            raise ValueError(f"{prefix}{name}: expected {expected}, got {value!r}")


def tune_codes_end_to_end(model: nn.Module, windows: list[torch.Tensor], dense_inputs: list[torch.Tensor], *,
                          step: float = 0.05, fraction: float = 0.02, beam: int = 1, progress: bool = False,
                          held_out: int = 0) -> dict:
    """PV-tuning's discrete step: move a small fraction of every :class:`tilefuse.nn.VQLinear`'s
    codes along the gradient of the end-to-end loss, its codebooks and scales fixed (the 2x8
    format stays what the kernels read). :func:`tune_end_to_end` is the continuous step.

    1. The gradient ``G`` of the mean KL over the tuning windows (as :func:`tune_end_to_end`
       scores them) with respect to each layer's dequantized weight ``W`` ([N, K] fp32: one pass
       with every layer running ``F.linear`` on ``W`` as a leaf).
    2. Per 8-weight group the target ``T_g = W_g - eta_g G_g``, ``eta_g = step ||W_g|| / ||G_g||``
       (a move of ``step`` times the group's own norm), and the codes that best represent ``T``
       with the layer's codebooks and scales (the quantizer's code search, ``beam`` candidates
       per codebook).
    3. Of the groups whose codes changed, each layer keeps the ``fraction`` of its groups (at
       most) that lower the linearized loss ``G_g . dW_g + |dW_g|^2 / (2 eta_g)`` the most.
    4. The new codes stay if the mean KL over the scored windows (the last ``held_out`` windows,
       else the tuning ones) went down; else every layer keeps its codes.

    Memory: every layer's dense weight and its gradient in fp32 at once (8 bytes per weight:
    1.1 GB for SmolLM2-135M, 56 GB for a Llama-3-8B). Returns ``{"error_before", "error_after",
    "changed", "accepted", "error_tried", "proposed", "seconds"}`` (mean KL in nats per token;
    ``changed``: the fraction of all groups whose codes the step moved, 0 when not accepted;
    ``error_tried`` and ``proposed``: the KL with the moved codes and the fraction moved, kept or
    not)."""
    from tilefuse.nn.vq import VQLinear
    from tilefuse.ops.vq.reference import codes_as_index, dequantize
    from tilefuse.quantizer.quantize import _decode, _update_codes

    check_code_step(step, fraction, beam)
    begin = time.perf_counter()
    head = _output_head(model)
    device = head.weight.device
    layers = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, VQLinear)]
    if not layers:
        raise ValueError("model: tune_codes_end_to_end moves VQLinear codes, found none")
    tuned, scored = _tuned_and_scored(windows, held_out)

    def kl(i: int) -> torch.Tensor:
        out = model(input_ids=windows[i].to(device), use_cache=False)
        return _next_token_kl(out.logits, head, dense_inputs[i])

    with torch.no_grad():
        before = sum(float(kl(i)) for i in scored) / len(scored)

    # ---- 1. dL/dW for every layer's dense weight, the model's own parameters frozen
    dense = {}
    with _frozen_parameters(model):
        try:
            for _, mod in layers:
                w = dequantize(mod.codes, mod.codebooks, mod.scales, dtype=torch.float32).requires_grad_(True)
                dense[mod] = w
                mod.forward = (lambda x, w=w, mod=mod: nn.functional.linear(
                    x, w.to(x.dtype), None if mod.bias is None else mod.bias.to(x.dtype)))
            for i in range(tuned):
                (kl(i) / tuned).backward()
        finally:
            for _, mod in layers:
                mod.__dict__.pop("forward", None)

    # ---- 2-3. per layer: the code search toward W - eta G, the best `fraction` of the moves kept
    old_codes, moved, groups_total = {}, 0, 0
    with torch.no_grad():
        for _, mod in layers:
            w, g = dense[mod].detach(), dense[mod].grad
            num_rows, k = w.shape
            num_groups = k // 8
            groups_total += num_rows * num_groups
            if g is None or not torch.isfinite(g).all() or float(g.norm()) == 0:
                continue
            # each group's own step: eta_g = step |W_g| / |G_g| moves every group by `step` times its
            # own norm (a layer-wide eta sends a gradient concentrated in a few groups many times
            # their norm away, which the linearized loss does not describe)
            w_g, g_g = w.reshape(num_rows, num_groups, 8), g.reshape(num_rows, num_groups, 8)
            g_norm = g_g.norm(dim=-1, keepdim=True)
            eta = torch.where(g_norm > 0, step * w_g.norm(dim=-1, keepdim=True) / g_norm.clamp_min(1e-30), 0.0)
            books = mod.codebooks.detach().float().reshape(2, 256, 8)
            scales = mod.scales.detach().float().reshape(num_rows, 1, 1)
            old = codes_as_index(mod.codes)
            new = _update_codes((w_g - eta * g_g) / scales, old.clone(), books, None, beam)
            d_w = scales * (_decode(books, new) - _decode(books, old))                   # [N, G, 8]
            gain = (g_g * d_w).sum(-1) + (d_w * d_w).sum(-1) / (2 * eta.squeeze(-1)).clamp_min(1e-30)
            gain = torch.where((new != old).any(-1) & (gain < 0), gain, torch.inf)
            keep = min(int(fraction * num_rows * num_groups), int(torch.isfinite(gain).sum()))
            if keep == 0:
                continue
            chosen = torch.zeros(num_rows * num_groups, dtype=torch.bool, device=gain.device)
            chosen[gain.flatten().topk(keep, largest=False).indices] = True
            codes = torch.where(chosen.view(num_rows, num_groups, 1), new, old)
            old_codes[mod] = mod.codes.clone()
            mod.codes.copy_(codes.to(torch.uint8).view(mod.codes.dtype) if mod.codes.dtype == torch.int8
                            else codes.to(mod.codes.dtype))
            moved += keep

        # ---- 4. kept only if the end-to-end loss fell
        tried = sum(float(kl(i)) for i in scored) / len(scored) if moved else before
        accepted = tried < before
        if not accepted:
            for mod, codes in old_codes.items():
                mod.codes.copy_(codes)
        after = tried if accepted else before
    info = {"error_before": before, "error_after": after, "changed": moved / groups_total if accepted else 0.0,
            "accepted": accepted, "error_tried": tried, "proposed": moved / groups_total,
            "seconds": round(time.perf_counter() - begin, 2)}
    if progress:
        rejected = f" (none kept: {100 * info['proposed']:.3g} % moved gave KL {tried:.4f})"
        print(f"patch_vq code step: KL {before:.4f} -> {after:.4f} nats/token, {100 * info['changed']:.3g} % of "
              f"the groups moved{'' if accepted else rejected}, {info['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    return info
