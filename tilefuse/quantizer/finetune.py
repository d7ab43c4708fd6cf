"""Fine-tuning of 2x8 codebooks and scales against a dense model's outputs (AQLM's block tuning).

``tilefuse.quantize`` fits every layer on its own, to its own inputs' statistics. The layers of a
block then meet each other's errors; tuning the continuous parts of their formats (both
codebooks and the row scales of every layer; the codes stay fixed, so the result is still the 2x8
format the kernels read) against the dense block's outputs on calibration inputs recovers part of
what the independent fits lost. AQLM does this per transformer block after quantizing it
(``finetune.py`` of its reference code, Adam on the codebooks and scales); the same function tunes
a whole model against the dense logits when ``forward`` is the whole model.

The objective is the relative squared error ``sum ||f(W_hat; x) - y||^2 / sum ||y||^2`` over the
calibration batches, minimized by Adam in float32 with the batches taken in order, one per step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch

from tilefuse.ops.vq.reference import dequantize

Format = tuple[torch.Tensor, torch.Tensor, torch.Tensor]       # (codes, codebooks, scales)


def _check_args(quantized, inputs, targets, steps, lr) -> None:
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


def finetune(forward: Callable[[dict[str, torch.Tensor], object], torch.Tensor], quantized: dict[str, Format],
             inputs: Sequence[object], targets: Sequence[torch.Tensor], *, steps: int = 100, lr: float = 1e-4,
             dense: dict[str, torch.Tensor] | None = None, progress: bool = True) -> tuple[dict[str, Format], dict]:
    """Tune the codebooks and scales of ``quantized`` so that ``forward`` matches ``targets``.

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
    progress : one line per tenth of the steps to stderr.

    Returns
    -------
    ``({name: (codes, codebooks, scales)}, info)``: the codes as given, the tuned codebooks and
    scales in their dtypes; ``info``: ``{"error_before", "error_after", "steps", "seconds"}``
    (relative output errors over all batches). The state with the lower error is returned, so
    tuning never makes the calibration error worse.
    """
    _check_args(quantized, inputs, targets, steps, lr)
    start = time.perf_counter()
    fixed = dict(dense or {})
    codes = {name: fmt[0] for name, fmt in quantized.items()}
    books = {name: fmt[1].detach().float().clone().requires_grad_(True) for name, fmt in quantized.items()}
    scales = {name: fmt[2].detach().float().clone().requires_grad_(True) for name, fmt in quantized.items()}

    def weights() -> dict[str, torch.Tensor]:
        return {**fixed, **{name: dequantize(codes[name], books[name], scales[name], dtype=torch.float32)
                            for name in quantized}}

    with torch.no_grad():
        before = relative_error(forward, weights(), inputs, targets)
    optimizer = torch.optim.Adam([*books.values(), *scales.values()], lr=lr)
    ref = [t.float().pow(2).sum().clamp_min(1e-30) for t in targets]
    for step in range(steps):
        i = step % len(inputs)
        optimizer.zero_grad(set_to_none=True)
        loss = (forward(weights(), inputs[i]).float() - targets[i].float()).pow(2).sum() / ref[i]
        loss.backward()
        optimizer.step()
        if progress and (step + 1) % max(1, steps // 10) == 0:
            print(f"tilefuse.finetune step {step + 1}/{steps}: batch loss {loss.item():.5f} "
                  f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    with torch.no_grad():
        after = relative_error(forward, weights(), inputs, targets)
    keep = after < before
    result = {name: (codes[name],
                     (books[name] if keep else quantized[name][1]).detach().to(quantized[name][1].dtype),
                     (scales[name] if keep else quantized[name][2]).detach().to(quantized[name][2].dtype))
              for name in quantized}
    info = {"error_before": before, "error_after": min(after, before), "steps": steps,
            "seconds": round(time.perf_counter() - start, 2)}
    return result, info
