"""``tilefuse.hf.generate``: decoding with one step captured in a CUDA graph and replayed per token.

A decode step of a Hugging Face model in eager mode is mostly host time (hundreds of module calls,
transformers' mask and cache code); replayed as a CUDA graph it is the kernels' time. This module
runs the whole loop that way, for stock and patched models:

1. **Prefill** (eager): the prompt through ``model(...)`` into a fixed-size cache -- a
   ``transformers.StaticCache``, or for a model patched by :func:`tilefuse.hf.patch_mla` a
   :class:`tilefuse.hf.PagedMLACache` -- and the first new token picked.
2. **Decode**: one step -- ``model(token, position, cache, mask)``, the next token picked (greedy,
   or sampled), EOS bookkeeping -- on static device buffers, captured once per shape and replayed.
   Nothing in the step reads a device value on the host, so the loop issues one replay per token
   and syncs only every ``check_every`` tokens to stop early when every sequence has finished.

Batches of different prompt lengths come left-padded with their ``attention_mask``, as a tokenizer
pads them for ``model.generate``: positions are per request (``cumsum(mask) - 1``), padded slots
stay masked. The static-cache step passes transformers a prepared 4D key mask (bool for ``sdpa``,
additive for ``eager`` attention), so no mask is built, or synced on, per step.

Sampling (``do_sample=True``): temperature, then top-k and top-p filtering, then the Gumbel-max
draw ``argmax(logits + g)``, ``g = -log(-log(u))`` -- the same distribution as a multinomial draw
from the filtered softmax. ``u`` comes from a ``torch.Generator`` seeded with ``seed``, filled
before each replay, so a seed gives the same tokens call after call (not the random stream of
``model.generate``, which draws differently).

Without CUDA the same loop runs step by step, uncaptured (what the CPU tests check against
``model.generate``).
"""

from __future__ import annotations

import inspect

import torch

MASK_IMPLEMENTATIONS = ("sdpa", "eager")
CAPACITY_STEP = 256             # generators' cache lengths, in steps of this many tokens
GENERATORS_PER_MODEL = 2        # the most recently used (batch, length, sampling) settings kept


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id: int | list[int] | torch.Tensor | None = None,
             pad_token_id: int | torch.Tensor | None = None,
             cuda_graph: bool | None = None, check_every: int = 16) -> torch.Tensor:
    """Continue ``input_ids`` by up to ``max_new_tokens`` tokens, as ``model.generate`` does,
    with the decode step replayed from a CUDA graph.

    Parameters
    ----------
    model : a Hugging Face causal LM (stock, or patched by ``tilefuse.hf.patch_swiglu`` /
        ``patch_vq`` / ``patch_mla``), on the device the ids are on.
    input_ids : [batch, prompt] int64.
    max_new_tokens : >= 1.
    attention_mask : [batch, prompt], 1 for tokens, 0 for left padding (right padding is refused).
    do_sample, temperature, top_k, top_p, seed : greedy by default; sampling as described in the
        module docstring (``seed``: the generator's seed, random when None).
    eos_token_id : an id or a list of ids ending a sequence (an int, a list of ints, or an integer
        tensor of 0 or 1 dimensions; default: the model's generation config); its later tokens are
        ``pad_token_id`` (an int or a 0-d integer tensor; default: the generation config's, else
        the first EOS id, else 0).
    cuda_graph : capture the step (default: on CUDA). The first call of a (batch, length,
        sampling) shape captures (a warm-up prefill and a few steps first); later calls replay.
    check_every : tokens between the host checks for "every sequence has finished" (each a sync).

    Returns
    -------
    [batch, prompt + n] int64: the prompt, then the new tokens; ``n <= max_new_tokens`` is cut
    after the step where every sequence has emitted EOS, as ``model.generate`` cuts it.
    """
    _check_model(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids: expected a [batch, prompt] int64 tensor, got "
                         f"{_describe(input_ids)}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected at least one request and one token, got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids, got "
                             f"{_describe(attention_mask)}")
        mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
            raise ValueError("attention_mask: expected left padding (zeros, then ones up to the last column), "
                             "as a tokenizer with padding_side='left' makes")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1] or None, got {top_p!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every: expected a positive int, got {check_every!r}")
    param = next(model.parameters(), None)
    if param is not None and param.device != input_ids.device:
        raise ValueError(f"input_ids: expected the model's device {param.device}, got {input_ids.device}")
    config = getattr(model, "generation_config", None)
    if eos_token_id is not None:
        eos = _token_ids("eos_token_id", eos_token_id)
    else:
        eos = _token_ids("eos_token_id (model.generation_config's)", getattr(config, "eos_token_id", None),
                         negative=True)
    if pad_token_id is not None:
        pad = _token_ids("pad_token_id", pad_token_id, single=True)
    else:
        pad = _token_ids("pad_token_id (model.generation_config's)", getattr(config, "pad_token_id", None),
                         single=True, negative=True)
    pad = pad[0] if pad else (eos[0] if eos else 0)
    capture = input_ids.is_cuda if cuda_graph is None else bool(cuda_graph)
    if capture and not input_ids.is_cuda:
        raise ValueError("cuda_graph: CUDA graphs need the model and input_ids on a CUDA device")

    batch, prompt_len = input_ids.shape
    sampling = (float(temperature), top_k, top_p) if do_sample else None
    # the cache's length rounded up, so that calls of nearby lengths share one generator (its
    # cache and graph); the capture's warm-up steps need room beyond the prompt too
    needed = prompt_len + max(max_new_tokens, Generator.WARMUP_STEPS + 1)
    capacity = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
    key = (batch, capacity, sampling, tuple(eos), pad, capture)
    per_model = _generators(model)
    gen = per_model.pop(key, None)
    if gen is None:
        while len(per_model) >= GENERATORS_PER_MODEL:      # each holds a whole cache: keep few
            per_model.pop(next(iter(per_model)))
        gen = Generator(model, batch, capacity, sampling=sampling, eos=eos, pad=pad, capture=capture)
    per_model[key] = gen                                     # most recent last
    return gen.run(input_ids, attention_mask, max_new_tokens, seed=seed, check_every=check_every)


def cache_argument(model) -> str:
    """The name under which ``model``'s forward (and ``generate``) takes its cache: ``cache`` in
    transformers after 5.17, ``past_key_values`` before (still accepted there, with a warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generators(model) -> dict:
    """The generators kept for ``model`` (insertion order: least recently used first), on the
    model itself so that they live and die with it."""
    found = model.__dict__.get("_tilefuse_generators")
    if found is None:
        found = model.__dict__["_tilefuse_generators"] = {}
    return found


class Generator:
    """The decode loop on static buffers for one (batch, cache length, sampling, EOS) setting:
    :meth:`prefill`, :meth:`step` (the captured body), :meth:`run`. ``tilefuse.hf.generate``
    keeps one per model and setting; the benchmark drives one directly (``on_token``)."""

    WARMUP_STEPS = 3

    def __init__(self, model, batch: int, max_len: int, *, sampling=None, eos=(), pad: int = 0,
                 capture: bool = False, warmup_steps: int = WARMUP_STEPS):
        self.model, self.batch, self.max_len = model, batch, max_len
        self.sampling, self.pad, self.capture, self.warmup_steps = sampling, pad, capture, warmup_steps
        param = next(model.parameters())
        device = self.device = param.device
        self.dtype = param.dtype            # the model's: the eager attention's additive mask takes it
        self.cache_arg = cache_argument(model)
        from tilefuse.hf.mla import PagedMLACache, is_patched

        self.paged = is_patched(model)
        if self.paged:
            self.cache = PagedMLACache(model, max_batch=batch, max_tokens=max_len)
        else:
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.has_eos = bool(eos)
        self.eos = torch.tensor(list(eos) or [-1], dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)         # the cache slot the step writes
        self.keys = torch.zeros(batch, 1, 1, max_len, dtype=torch.bool, device=device)   # attended slots
        self.use_mask = False
        self.noise = None
        self.generator = torch.Generator(device=device) if sampling is not None else None
        self.graph = None

    # --- the pieces

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token [batch] from the last position's logits [batch, vocab], EOS applied."""
        if self.sampling is None:
            tok = logits.argmax(-1)             # in the logits' dtype: the same pick, no cast pass
        else:
            temperature, top_k, top_p = self.sampling
            x = logits.float() / temperature
            if top_k is not None and top_k < x.shape[-1]:
                kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
                x = x.masked_fill(x < kth, float("-inf"))
            if top_p is not None and top_p < 1:
                sorted_x, order = torch.sort(x, dim=-1, descending=True)
                probs = sorted_x.softmax(-1)
                drop = probs.cumsum(-1) - probs > top_p         # keep the smallest prefix reaching top_p
                x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
            u = self.noise.clamp(1e-20, 1 - 1e-7)
            tok = (x - torch.log(-torch.log(u))).argmax(-1)
        if self.has_eos:
            tok = torch.where(self.finished, torch.full_like(tok, self.pad), tok)
            self.finished |= (tok[:, None] == self.eos[None, :]).any(-1)
        return tok

    def _mask(self):
        """The step's prepared 4D key mask, or None (no padding and no need: transformers' own
        causal mask over the static cache; the paged cache takes none)."""
        if not self.use_mask:
            return None
        if self.impl == "eager":
            return torch.zeros(self.keys.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~self.keys, torch.finfo(self.dtype).min)
        return self.keys

    def step(self) -> None:
        """One decode step on the static buffers (the body of the graph)."""
        if self.use_mask:
            self.keys.index_fill_(3, self.slot, True)
        kwargs = {self.cache_arg: self.cache}
        mask = self._mask()
        if mask is not None:
            kwargs["attention_mask"] = mask
        logits = self.model(input_ids=self.token, position_ids=self.position, use_cache=True, logits_to_keep=1,
                            **kwargs).logits
        self.token.copy_(self._pick(logits[:, -1])[:, None])
        self.position.add_(1)
        self.slot.add_(1)

    def _draw(self) -> None:
        if self.noise is not None:
            self.noise.uniform_(generator=self.generator)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                padded: bool | None = None) -> None:
        """Empty the cache in place (graphs hold its addresses), run the prompt, pick the first token.
        ``padded``: whether ``attention_mask`` has any 0 (read from it when None)."""
        batch, prompt_len = input_ids.shape
        self.cache.reset()
        self.finished.zero_()
        self.slot.fill_(prompt_len)
        if padded is None:
            padded = _padded(attention_mask)
        if padded and not self.paged and self.impl not in MASK_IMPLEMENTATIONS:
            raise ValueError(f"attention_mask: left-padded batches need attn_implementation in "
                             f"{MASK_IMPLEMENTATIONS} (a prepared 4D mask per step), got {self.impl!r}")
        # with a static cache the step always takes a prepared mask once one is needed, so a graph
        # captured for padded prompts also serves unpadded ones (and the reverse is refused below)
        if padded and not self.paged:
            if self.graph is not None and not self.use_mask:
                self.graph = None
            self.use_mask = True
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.keys.zero_()
        self.keys[:, 0, 0, :prompt_len] = mask.bool()
        kwargs = {self.cache_arg: self.cache}
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1, **kwargs).logits[:, -1]
        if self.sampling is not None and self.noise is None:
            self.noise = torch.empty(batch, logits.shape[-1], dtype=torch.float32, device=self.device)
        self._draw()
        self.token.copy_(self._pick(logits)[:, None])
        self.position.copy_(mask.sum(-1, keepdim=True))

    def _capture(self, input_ids, attention_mask, padded: bool) -> None:
        """Warm up on a side stream (lazy allocations, Triton compiles), then capture one step."""
        from tilefuse._launch import capture_graph

        self.prefill(input_ids, attention_mask, padded)
        self.graph, _ = capture_graph(self.step, warmup=self.warmup_steps)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, *,
            seed: int | None = None, check_every: int = 16, on_token=None) -> torch.Tensor:
        """``[batch, prompt + n]``: the prompt and up to ``max_new_tokens`` new tokens (module
        docstring). ``on_token()`` is called after each new token is issued (the benchmark's clock)."""
        batch, prompt_len = input_ids.shape
        if batch != self.batch or prompt_len + max_new_tokens > self.max_len:
            raise ValueError(f"input_ids: a Generator for batch {self.batch} and {self.max_len} tokens got batch "
                             f"{batch} with {prompt_len} + {max_new_tokens} tokens")
        if self.capture and prompt_len + max(max_new_tokens, self.warmup_steps + 1) > self.max_len:
            # the warm-up steps before the capture write ahead of the prompt too
            raise ValueError(f"max_new_tokens: the capture's {self.warmup_steps} warm-up steps need "
                             f"{self.warmup_steps + 1} tokens of room, got {max_new_tokens}")
        if self.generator is not None and seed is None:      # tensor-parallel ranks take rank 0's
            from tilefuse.parallel.group import same_on_every_rank

            seed = same_on_every_rank(self.model, int(torch.randint(2 ** 62, ()).item()))
        padded = _padded(attention_mask)
        if self.capture and (self.graph is None or (padded and not self.use_mask)):
            self._capture(input_ids, attention_mask, padded)
        if self.generator is not None:          # after the capture: its warm-up draws from the stream too
            self.generator.manual_seed(seed)
        out = torch.full((batch, max_new_tokens), self.pad, dtype=torch.long, device=self.device)
        self.prefill(input_ids, attention_mask, padded)
        out[:, 0] = self.token[:, 0]
        if on_token is not None:
            on_token()
        done = 1
        for i in range(1, max_new_tokens):
            if self.has_eos and i % check_every == 0 and bool(self.finished.all()):
                break
            self._draw()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            out[:, i] = self.token[:, 0]
            done = i + 1
            if on_token is not None:
                on_token()
        new = out[:, :done]
        if self.has_eos:
            # as model.generate: cut after the step where the last sequence emitted EOS
            hit = (new[:, :, None] == self.eos[None, None, :]).any(-1)
            if bool(hit.any(-1).all()):
                last = int(hit.float().argmax(-1).max())
                new = new[:, :last + 1]
        return torch.cat([input_ids, new], dim=1)


def _check_model(model) -> None:
    """``model`` is a Hugging Face causal LM as far as the loop needs: a ``torch.nn.Module`` with a
    ``config`` (the static cache is built from it) and parameters (they give the device)."""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(f"model: expected a Hugging Face causal LM (a torch.nn.Module with a .config, called as "
                         f"model(input_ids=..., position_ids=..., past_key_values=...)), got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError(f"model: expected a Hugging Face causal LM with parameters, got a "
                         f"{type(model).__name__} without any")


def _token_ids(name: str, value, *, single: bool = False, negative: bool = False) -> list[int]:
    """Token ids as a list of ints: ``value`` an int, an integer tensor of 0 or 1 dimensions, or a
    list / tuple of ints (one id where ``single``); None gives []. Anything else (a string, a
    float, a negative id unless ``negative``: configs that mark "none" by -1) raises ValueError
    naming ``name``."""
    if value is None:
        return []
    items = value
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool or value.dim() > 1:
            items = None
        else:
            items = value.reshape(-1).tolist()
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = [int(v) if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() else v
                 for v in value]
    else:
        items = None
    if (items is None or not all(isinstance(v, int) and not isinstance(v, bool) and (negative or v >= 0)
                                 for v in items) or (single and len(items) != 1)):
        what = "a token id (an int >= 0 or a 0-d integer tensor)" if single else \
            "token ids (an int >= 0, a 0-d or 1-d integer tensor, or a list of ints)"
        got = _describe(value) if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{name}: expected {what}, got {got}")
    return items


def _padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether ``attention_mask`` marks any padding (a host sync)."""
    return attention_mask is not None and not bool(attention_mask.bool().all())


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
