"""Greedy decoding of Hugging Face causal LMs and its timing, for ``tilefuse bench model``.

* :func:`generate_eager` -- ``model.generate`` greedy with its default dynamic cache (what most users run).
* :class:`GraphDecoder` -- ``tilefuse.hf.generate``'s loop (a static cache, one decode step captured in a
  CUDA graph, replayed per token), greedy, without EOS.
* :class:`Clock`, :func:`prefill_times` -- timestamps on the device timeline (CUDA events; the wall clock on a CPU).
* :func:`perplexity`, :func:`forced_argmax`, :func:`agreement` -- quality and token agreement.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from tilefuse.hf.decode import Generator, cache_argument

class Clock:
    """Timestamps on the device's timeline: CUDA events on a GPU (read back once, at the end),
    ``time.perf_counter`` on a CPU. ``intervals_ms()`` gives the times between consecutive marks."""

    def __init__(self, device: torch.device, marks: int):
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else []
        self.times: list[float] = []
        self.count = 0

    def mark(self) -> None:
        if self.cuda:
            self.events[self.count].record()
        else:
            self.times.append(time.perf_counter())
        self.count += 1

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            marks = self.events[:self.count]
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]


def _criteria_class():
    from transformers import StoppingCriteria

    class MarkEveryToken(StoppingCriteria):
        """Marks a :class:`Clock` after every generated token; never stops generation."""

        def __init__(self, clock: Clock):
            self.clock = clock

        def __call__(self, input_ids, scores, **kwargs):
            self.clock.mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return MarkEveryToken


@torch.no_grad()
def generate_eager(model, prompt: torch.Tensor, new_tokens: int, clock: Clock | None = None,
                   cache=None) -> torch.Tensor:
    """``model.generate`` greedy, default (dynamic) cache or ``cache`` (``past_key_values``: a
    ``PagedMLACache`` for a ``patch_mla`` model), no EOS stop: ``[batch, new_tokens]`` ids. With a
    ``clock``, it is marked after each new token."""
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([_criteria_class()(clock)]) if clock is not None else None
    extra = {} if cache is None else {cache_argument(model): cache}
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0, stopping_criteria=criteria, **extra)
    return out[:, prompt.shape[1]:]


class GraphDecoder(Generator):
    """Greedy decoding as the benchmark times it: :class:`tilefuse.hf.decode.Generator` (the loop
    of ``tilefuse.hf.generate``: a ``transformers.StaticCache``, or a ``PagedMLACache`` for a model
    patched by ``patch_mla``; eager prefill, then one decode step captured in a CUDA graph and
    replayed per token, no host sync per token) without EOS, returning the new tokens alone.
    Without CUDA (or with ``capture=False``) the same step runs eagerly, which is how the CPU
    tests check the route against ``generate()``."""

    def __init__(self, model, batch: int, max_len: int, capture: bool, warmup_steps: int = 3):
        super().__init__(model, batch, max_len, capture=capture, warmup_steps=warmup_steps)

    @torch.no_grad()
    def decode(self, prompt: torch.Tensor, new_tokens: int, clock: Clock | None = None) -> torch.Tensor:
        """Greedy ``[batch, new_tokens]`` continuation of ``prompt`` ``[batch, P]`` (P + new_tokens
        must fit the cache). With a ``clock``, it is marked after each new token."""
        needed = prompt.shape[1] + max(new_tokens, self.warmup_steps + 1)     # the warm-up writes ahead too
        if needed > self.max_len:
            raise ValueError(f"prompt: {prompt.shape[1]} tokens + {new_tokens} new need a cache of {needed}, "
                             f"got max_len={self.max_len}")
        out = self.run(prompt, None, new_tokens, on_token=clock.mark if clock is not None else None)
        return out[:, prompt.shape[1]:]


def alternating(first, second, round_index: int) -> list:
    """The models of one round of a paired measurement, in turn: ``first`` then ``second`` in even
    rounds, the other way round in odd ones (so a drift of the machine's speed falls on both
    alike); None (no partner) left out."""
    order = (first, second) if round_index % 2 == 0 else (second, first)
    return [m for m in order if m is not None]


@torch.no_grad()
def prefill_times(model, prompt: torch.Tensor, device: torch.device, reps: int = 3, paired=None,
                  cache=None) -> dict:
    """``model(prompt)`` with a fresh cache (``cache(model)``'s, for a model that decodes over its
    own cache such as a ``patch_mla`` model's ``PagedMLACache``; else transformers' dynamic one),
    timed three ways (the first call a warm-up):
    ``prefill_ms``, the median between CUDA events around the forward (the device's timeline:
    kernels and the gaps where it waits for the host); ``prefill_wall_ms``, the median wall clock
    with a synchronize after the forward; and on a GPU ``prefill_kernel_ms``, the kernels' own time,
    the median over ``reps`` more forwards (``torch.profiler``: the sum of each one's CUDA kernels'
    durations, what the kernels did whatever the host did).

    With ``paired`` (the stock model, resident beside ``model``) every timed forward of ``model``
    has one of ``paired`` next to it, in alternating order, and its figures come back as
    ``stock_ms_paired`` and ``stock_kernel_ms_paired``: the GPU's clocks drift by a few percent
    between runs minutes apart, enough to misjudge two equal sets of kernels."""
    def forward(which):
        own = None if cache is None else cache(which)
        extra = {} if own is None else {cache_argument(which): own}
        which(input_ids=prompt, use_cache=True, logits_to_keep=1, **extra)

    events: dict = {m: [] for m in alternating(model, paired, 0)}
    walls: list[float] = []
    for rep in range(reps + 1):
        for which in alternating(model, paired, rep):
            clock = Clock(device, 2)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            clock.mark()
            forward(which)
            clock.mark()
            if rep:                                     # the first round warms up
                events[which].extend(clock.intervals_ms())
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep and which is model:
                walls.append((time.perf_counter() - start) * 1e3)
    out = {"prefill_ms": statistics.median(events[model]), "prefill_wall_ms": statistics.median(walls)}
    if paired is not None:
        out["stock_ms_paired"] = statistics.median(events[paired])
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        totals: dict = {m: [] for m in alternating(model, paired, 0)}
        for rep in range(reps):
            for which in alternating(model, paired, rep):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    forward(which)
                    torch.cuda.synchronize()
                totals[which].append(sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0))
                                         for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")))
        out["prefill_kernel_ms"] = statistics.median(totals[model]) / 1e3
        if paired is not None:
            out["stock_kernel_ms_paired"] = statistics.median(totals[paired]) / 1e3
    return out


def windows(ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``ids [T]`` cut into consecutive ``[1, size]`` windows (the last may be shorter)."""
    return [ids[i:i + size][None] for i in range(0, ids.numel(), size)]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of ``ids [T]`` (first token of each unscored)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows(ids, window):
        if chunk.shape[1] < 2:
            continue
        chunk = chunk.to(device)
        logits = model(input_ids=chunk, use_cache=False).logits[0].float()
        total += F.cross_entropy(logits[:-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(total / count)


@torch.no_grad()
def forced_argmax(model, prompt: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: ``model``'s greedy choice at every generated position ``[batch, n]`` (CPU),
    given ``prompt`` ``[batch, P]`` and ``reference``'s earlier tokens, in one full forward."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt, reference[:, :-1]], 1).to(device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                   logits_to_keep=reference.shape[1]).logits
    return logits.argmax(-1).cpu()


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of equal tokens, mean fraction before the first difference) of two ``[batch, n]``."""
    same = a == b
    prefix = same.long().cumprod(1).sum(1).float() / same.shape[1]
    return round(same.float().mean().item(), 4), round(prefix.mean().item(), 4)
