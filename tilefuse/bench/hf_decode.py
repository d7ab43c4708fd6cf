"""Greedy decoding of Hugging Face causal LMs and its timing, for ``tilefuse bench model``.

* :func:`generate_eager` -- ``model.generate`` greedy with its default dynamic cache (what most users run).
* :class:`GraphDecoder` -- a static cache, one decode step captured in a CUDA graph, replayed per token.
* :class:`Clock`, :func:`prefill_ms` -- timestamps on the device timeline (CUDA events; the wall clock on a CPU).
* :func:`perplexity`, :func:`forced_argmax`, :func:`agreement` -- quality and token agreement.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

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
def generate_eager(model, prompt: torch.Tensor, new_tokens: int, clock: Clock | None = None) -> torch.Tensor:
    """``model.generate`` greedy, default (dynamic) cache, no EOS stop: ``[batch, new_tokens]`` ids.
    With a ``clock``, it is marked after each new token."""
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([_criteria_class()(clock)]) if clock is not None else None
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0, stopping_criteria=criteria)
    return out[:, prompt.shape[1]:]


class GraphDecoder:
    """Greedy decoding with a ``transformers.StaticCache``: eager prefill, then one decode step
    captured in a CUDA graph and replayed per token.

    The step reads the static buffers ``token`` ``[batch, 1]`` (int64, the last token) and
    ``position`` ``[batch, 1]`` (its position), runs ``model(input_ids=token, position_ids=position,
    past_key_values=cache)``, writes the argmax back into ``token`` and advances ``position``, all
    on the device: no host sync per token. The cache keeps its write index in a device tensor of
    its own (transformers 5.x: ``StaticLayer.cumulative_length``, advanced in place by each update),
    so a replay appends at the right slot, and the attention mask covers the whole static length
    with the unwritten slots masked.

    Capture-safe by construction: every tensor the step touches exists before capture (the cache
    is allocated by the prefill, the kernels' workspaces by the warm-up steps), and the step has no
    ``.item()``, no host copies and no Python branch on tensor values. Without CUDA (or with
    ``capture=False``) the same step runs eagerly, which is how the CPU tests check the route
    against ``generate()``.
    """

    def __init__(self, model, batch: int, max_len: int, capture: bool, warmup_steps: int = 3):
        from transformers import StaticCache

        self.model, self.max_len = model, max_len
        device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.capture, self.warmup_steps = capture, warmup_steps
        self.graph = None

    def step(self) -> None:
        """One greedy decode step on the static buffers (the body of the graph)."""
        logits = self.model(input_ids=self.token, position_ids=self.position, past_key_values=self.cache,
                            use_cache=True, logits_to_keep=1).logits
        self.token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.position.add_(1)

    def prefill(self, prompt: torch.Tensor) -> None:
        """Empty the cache (in place: the graph holds its addresses), run the prompt, set ``token``."""
        self.cache.reset()
        logits = self.model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.position.fill_(prompt.shape[1])

    def _capture(self, prompt: torch.Tensor) -> None:
        """Warm up on a side stream (lazy allocations, Triton compiles), then capture one step."""
        self.prefill(prompt)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_steps):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        # the warm-up and the capture moved the cache on; decode() starts again from a prefill

    @torch.no_grad()
    def decode(self, prompt: torch.Tensor, new_tokens: int, clock: Clock | None = None) -> torch.Tensor:
        """Greedy ``[batch, new_tokens]`` continuation of ``prompt`` ``[batch, P]`` (P + new_tokens
        must fit the cache). With a ``clock``, it is marked after each new token."""
        needed = prompt.shape[1] + max(new_tokens, self.warmup_steps + 1)     # the warm-up writes ahead too
        if needed > self.max_len:
            raise ValueError(f"prompt: {prompt.shape[1]} tokens + {new_tokens} new need a cache of {needed}, "
                             f"got max_len={self.max_len}")
        if self.capture and self.graph is None:
            self._capture(prompt)
        out = torch.empty(prompt.shape[0], new_tokens, dtype=torch.long, device=self.token.device)
        self.prefill(prompt)
        out[:, 0] = self.token[:, 0]
        if clock is not None:
            clock.mark()
        for i in range(1, new_tokens):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            out[:, i] = self.token[:, 0]
            if clock is not None:
                clock.mark()
        return out


@torch.no_grad()
def prefill_ms(model, prompt: torch.Tensor, device: torch.device, reps: int = 3) -> float:
    """Median time of ``model(prompt)`` with a fresh dynamic cache (the first call is a warm-up)."""
    times = []
    for _ in range(reps + 1):
        clock = Clock(device, 2)
        clock.mark()
        model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        clock.mark()
        times.extend(clock.intervals_ms())
    return statistics.median(times[1:])


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
