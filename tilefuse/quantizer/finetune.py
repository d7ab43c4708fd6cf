"""Fine-tuning of 2x8 codebooks and scales against a dense model's outputs (AQLM's block tuning).

``tilefuse.quantize`` fits every layer on its own, to its own inputs' statistics. The layers of a
block then meet each other's errors; tuning the continuous parts of their formats (both
codebooks and the row scales of every layer; the codes stay fixed, so the result is still the 2x8
format the kernels read) against the dense block's outputs on calibration inputs recovers part of
what the independent fits lost. AQLM does this per transformer block after quantizing it
(``finetune.py`` of its reference code, Adam on the codebooks and scales); the same function tunes
a whole model against the dense logits when ``forward`` is the whole model.

The objective is the relative squared error ``sum ||f(W_hat; x) - y||^2 / sum ||y||^2`` over the
calibration batches, minimized by Adam in float32 with the batches taken in order, one per step,
or any differentiable ``objective(output, target)`` of one batch (for a whole model, the KL
divergence of its next-token distributions from the dense model's, as AQLM's and PV-tuning's
end-to-end tuning uses). Dense tensors the forward reads (the RMSNorm weights, say) can be tuned
with the formats (``tune``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from tilefuse.ops.vq.reference import dequantize

Format = tuple[torch.Tensor, torch.Tensor, torch.Tensor]       # (codes, codebooks, scales)


SCHEDULES = ("constant", "cosine")       # the learning-rate schedules of adam_keep_best


def _check_args(quantized, inputs, targets, steps, lr, tune=None, objective=None, callback=None, validation=None,
                check_every=None) -> None:
    if not isinstance(quantized, dict) or not quantized:
        raise ValueError("quantized: expected a non-empty dict {name: (codes, codebooks, scales)}")
    for name, fmt in quantized.items():
        if not (isinstance(fmt, tuple) and len(fmt) == 3 and all(isinstance(t, torch.Tensor) for t in fmt)):
            raise ValueError(f"quantized[{name!r}]: expected a tuple (codes, codebooks, scales) of tensors")
        codes, books, scales = fmt
        if codes.dim() != 3 or books.dim() != 4 or books.shape[-1] != 8 or scales.shape[0] != codes.shape[0]:
            raise ValueError(f"quantized[{name!r}]: expected codes [N, K/8, 2], codebooks [2, 256, 1, 8] and "
                             f"scales [N, 1, 1, 1], got {tuple(codes.shape)}, {tuple(books.shape)}, "
                             f"{tuple(scales.shape)}")
    if len(inputs) == 0 or len(inputs) != len(targets):
        raise ValueError(f"inputs, targets: expected the same non-zero number of batches, got {len(inputs)} "
                         f"and {len(targets)}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps: expected an int >= 0, got {steps!r}")
    if not isinstance(lr, float) or not lr > 0:
        raise ValueError(f"lr: expected a float > 0, got {lr!r}")
    if tune is not None:
        if not isinstance(tune, dict):
            raise ValueError(f"tune: expected a dict {{name: tensor}} or None, got {type(tune).__name__}")
        for name, t in tune.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or name in quantized:
                raise ValueError(f"tune[{name!r}]: expected a floating-point tensor under a name that is not in "
                                 f"quantized, got {type(t).__name__}")
    if objective is not None and not callable(objective):
        raise ValueError(f"objective: expected a callable (output, target) -> scalar tensor, got "
                         f"{type(objective).__name__}")
    if callback is not None and not callable(callback):
        raise ValueError(f"callback: expected a callable (steps_done, weights) -> None, got {type(callback).__name__}")
    if validation is not None and (not isinstance(validation, (tuple, list)) or len(validation) != 2
                                   or not len(validation[0]) or len(validation[0]) != len(validation[1])):
        raise ValueError("validation: expected (inputs, targets) with the same non-zero number of batches")
    if check_every is not None and (not isinstance(check_every, int) or isinstance(check_every, bool)
                                    or check_every < 1):
        raise ValueError(f"check_every: expected an int >= 1, got {check_every!r}")


def relative_error(forward: Callable[[dict[str, torch.Tensor], object], torch.Tensor],
                   weights: dict[str, torch.Tensor], inputs: Sequence[object],
                   targets: Sequence[torch.Tensor]) -> float:
    """``sqrt(sum ||forward(weights, x) - y||^2 / sum ||y||^2)`` over the batches (no gradients)."""
    err = ref = 0.0
    with torch.no_grad():
        for x, y in zip(inputs, targets):
            out = forward(weights, x).float()
            err += (out - y.float()).pow(2).sum().item()
            ref += y.float().pow(2).sum().item()
    return (err / max(ref, 1e-300)) ** 0.5


def mean_objective(forward: Callable[[dict[str, torch.Tensor], object], torch.Tensor],
                   weights: dict[str, torch.Tensor], inputs: Sequence[object], targets: Sequence[torch.Tensor],
                   objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """The mean of ``objective(forward(weights, x), y)`` over the batches (no gradients)."""
    with torch.no_grad():
        return sum(float(objective(forward(weights, x), y)) for x, y in zip(inputs, targets)) / len(inputs)


def adam_keep_best(tensors: dict, step_loss: Callable[[int], torch.Tensor], steps: int, lr: float,
                   error: Callable[[], float], *, validated: bool, check_every: int,
                   on_step: Callable[[int, torch.Tensor], None] | None = None,
                   schedule: str = "constant") -> tuple[dict | None, float, float, int]:
    """Adam on ``tensors`` (fp32 leaves with gradients), ``steps`` steps of ``step_loss(step)``, and
    which state to keep: with ``validated``, the copy of the state with the lowest ``error()``
    among the start and every ``check_every`` steps (the last step included), None if the start
    was best; otherwise ``tensors`` themselves if ``error()`` fell over the tuning, else None.
    ``on_step(steps_done, loss)`` runs after every step. ``schedule``: the learning rate stays
    ``lr`` (``"constant"``) or falls from ``lr`` to 0 along a half cosine over the steps
    (``"cosine"``: the late steps, which mostly fit the tuning batches, move the state less).
    Returns ``(state to keep or None, error before, error of the kept state or of the start, the
    step kept)``; the shared loop of :func:`finetune` and ``hf.vq_sequential.tune_end_to_end``
    (ValueError for an unknown ``schedule``, before any work)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    before = error()
    best, best_step, kept = before, 0, None
    optimizer = torch.optim.Adam(list(tensors.values()), lr=lr)
    for step in range(steps):
        if schedule == "cosine":                # the rate of this step: lr at the first, near 0 at the last
            optimizer.param_groups[0]["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(step)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, loss)
        if validated and ((step + 1) % check_every == 0 or step + 1 == steps):
            err = error()
            if err < best:
                best, best_step = err, step + 1
                kept = {key: t.detach().clone() for key, t in tensors.items()}
    if validated:
        return kept, before, best, best_step
    after = error() if steps else before
    return (tensors if after < before else None), before, min(after, before), steps if after < before else 0


def finetune(forward: Callable[[dict[str, torch.Tensor], object], torch.Tensor], quantized: dict[str, Format],
             inputs: Sequence[object], targets: Sequence[torch.Tensor], *, steps: int = 100, lr: float = 1e-4,
             dense: dict[str, torch.Tensor] | None = None, tune: dict[str, torch.Tensor] | None = None,
             objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             progress: bool = True,
             callback: Callable[[int, Callable[[], dict[str, torch.Tensor]]], None] | None = None,
             validation: tuple[Sequence[object], Sequence[torch.Tensor]] | None = None,
             check_every: int | None = None, schedule: str = "constant") -> tuple[dict[str, Format], dict]:
    """Tune the codebooks and scales of ``quantized`` (and the tensors of ``tune``) so that
    ``forward`` matches ``targets``.

    Parameters
    ----------
    forward : ``(weights, x) -> y``, differentiable in the weights: ``weights`` maps every name of
        ``quantized`` (and of ``dense``) to a dense ``[N, K]`` weight.
    quantized : ``{name: (codes [N, K/8, 2] uint8, codebooks [2, 256, 1, 8], scales [N, 1, 1, 1])}``
        as ``tilefuse.quantize`` returns them.
    inputs, targets : calibration batches (anything ``forward`` takes: a tensor, or a block's
        positional and keyword arguments) and the dense model's output tensors on them.
    steps : Adam steps, one batch each, in order (0: nothing tuned, the errors still reported).
    lr : Adam's learning rate (codebook entries and scales are O(1) and O(row RMS)).
    dense : weights ``forward`` also needs that are not tuned (held fixed).
    tune : dense tensors ``forward`` reads that are tuned too (RMSNorm weights, biases), under
        names not in ``quantized``; ``forward`` gets float32 copies, and the tensors given are
        overwritten in place with the tuned values (in their dtype) when the tuned state is kept.
    objective : ``(output, target) -> scalar`` of one batch, differentiable in ``output``; default
        the batch's relative squared error ``||output - target||^2 / ||target||^2``.
    progress : one line per tenth of the steps to stderr.
    validation : ``(inputs, targets)`` held out from the tuning: the state kept is the one with the
        lowest error on them among the start and every ``check_every`` steps (the last step
        included), instead of the lowest error on the tuning batches (which keeps falling while
        the model stops improving on other text).
    check_every : steps between validation checks; default a tenth of ``steps``.
    schedule : ``"constant"`` (the rate stays ``lr``) or ``"cosine"`` (from ``lr`` to 0 along a
        half cosine over the steps).
    callback : called after every step as ``callback(steps_done, weights)``; ``weights()`` returns
        the current dense weights (every name of ``quantized``, ``dense`` and ``tune``, float32, no
        gradients) for an evaluation at chosen steps (a held-out perplexity, say). Its cost is the
        caller's: it runs between steps.

    Returns
    -------
    ``({name: (codes, codebooks, scales)}, info)``: the codes as given, the tuned codebooks and
    scales in their dtypes; ``info``: ``{"error_before", "error_after", "steps", "seconds"}``
    (the relative output error over all batches, or with ``objective`` its mean over the
    batches; with ``validation``, over its batches, and ``"best_step"``). The state with the lower
    error is returned (and written to ``tune``'s tensors), so tuning never makes that error worse.
    """
    _check_args(quantized, inputs, targets, steps, lr, tune, objective, callback, validation, check_every)
    start = time.perf_counter()
    fixed = dict(dense or {})
    extra = {name: t.detach().float().clone().requires_grad_(True) for name, t in (tune or {}).items()}
    codes = {name: fmt[0] for name, fmt in quantized.items()}
    books = {name: fmt[1].detach().float().clone().requires_grad_(True) for name, fmt in quantized.items()}
    scales = {name: fmt[2].detach().float().clone().requires_grad_(True) for name, fmt in quantized.items()}

    def weights() -> dict[str, torch.Tensor]:
        return {**fixed, **extra, **{name: dequantize(codes[name], books[name], scales[name], dtype=torch.float32)
                                     for name in quantized}}

    ref = [t.float().pow(2).sum().clamp_min(1e-30) for t in targets]

    def batch_loss(i: int) -> torch.Tensor:
        out = forward(weights(), inputs[i]).float()
        if objective is not None:
            return objective(out, targets[i])
        return (out - targets[i].float()).pow(2).sum() / ref[i]

    def snapshot() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return weights()

    scored_inputs, scored_targets = validation if validation is not None else (inputs, targets)

    def error() -> float:
        w = snapshot()
        if objective is None:
            return relative_error(forward, w, scored_inputs, scored_targets)
        return mean_objective(forward, w, scored_inputs, scored_targets, lambda out, y: objective(out.float(), y))

    tensors = {**{("books", n): t for n, t in books.items()}, **{("scales", n): t for n, t in scales.items()},
               **{("extra", n): t for n, t in extra.items()}}
    every = check_every or max(1, steps // 10)

    def on_step(done: int, loss: torch.Tensor) -> None:
        if callback is not None:
            callback(done, snapshot)
        if progress and done % max(1, steps // 10) == 0:
            print(f"tilefuse.finetune step {done}/{steps}: batch loss {loss.item():.5f} "
                  f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

    state, before, after, best_step = adam_keep_best(tensors, lambda step: batch_loss(step % len(inputs)), steps, lr,
                                                     error, validated=validation is not None, check_every=every,
                                                     on_step=on_step, schedule=schedule)
    keep = state is not None
    if keep:
        with torch.no_grad():
            if state is not tensors:            # a validated copy (else the tuned tensors are the state)
                for key, t in tensors.items():
                    t.copy_(state[key])
            for name, t in (tune or {}).items():
                t.copy_(extra[name])
    result = {name: (codes[name],
                     (books[name] if keep else quantized[name][1]).detach().to(quantized[name][1].dtype),
                     (scales[name] if keep else quantized[name][2]).detach().to(quantized[name][2].dtype))
              for name in quantized}
    info = {"error_before": before, "error_after": after, "steps": steps,
            "seconds": round(time.perf_counter() - start, 2)}
    if validation is not None:
        info["best_step"] = best_step
    return result, info
