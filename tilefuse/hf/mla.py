"""transformers' DeepSeek-V2 / V3 attention over a paged latent cache, decoding through
:func:`tilefuse.flash_mla_with_kvcache`.

* :func:`patch_mla` -- makes every ``DeepseekV2Attention`` / ``DeepseekV3Attention`` of a model
  use a :class:`PagedMLACache` when one is passed as ``past_key_values``; with any other cache (or
  none) the module runs transformers' own forward, unchanged.
* :class:`PagedMLACache` -- the paged latent cache: a ``transformers.Cache`` that ``generate``
  accepts, sized by the user, its block table and lengths on the device.

What runs with a :class:`PagedMLACache` (per layer, ``h`` heads, hidden ``[b, s, H]``):

* **Prefill** (the first forward after the cache was built or reset): transformers' own attention
  forward (the expanded form: ``kv_b_proj`` applied to every cached latent, the model's attention
  implementation and mask), so the prompt's attention is stock's. The latents stock would cache
  (``kv_a_layernorm(c_kv)`` ``[b, s, 512]`` and the RoPE'd ``k_pe`` ``[b, s, 64]``) are taken as it
  hands them to the cache and written into the pages, one 576-wide row per token; tokens whose
  ``attention_mask`` is 0 (left padding) are not written, so each request's pages hold its own
  tokens only.
* **Decode** (every later forward, one or a few tokens per request): the absorbed form.
  ``W_UK`` (the K rows of ``kv_b_proj``) folds into the query, ``q_nope @ W_UK -> [b, s, h, 512]``,
  concatenated with the RoPE'd ``q_pe`` into ``[b, s, h, 576]``; the new tokens' latents are
  written to the pages (one launch for both RoPEs, the query and the cache rows on the Triton
  backend: ``ops.mla.kv.decode_rows``); attention over the pages by ``flash_mla_with_kvcache``
  (causal, the model's softmax scale, DeepSeek-V3's yarn ``mscale`` included): tilefuse's, or that of
  the module given as ``patch_mla(attention=...)`` (any with FlashMLA's API, such as a built
  ``flash_mla``), its split schedule (``get_mla_metadata``) planned once per forward and shared by
  every layer; ``W_UV`` (the V rows of ``kv_b_proj``) maps the ``[b, s, h, 512]`` output to
  ``[b, s, h, v_head_dim]``; then ``o_proj``.
  Steps of more than ``512 // h`` tokens run as several calls of that many tokens (the op takes
  ``s * h <= 512`` query rows), each seeing the keys before it.

The model's ``attention_mask`` is read at the prefill only: ``patch_mla`` hooks the decoder
model's forward to hand the 2D mask to the cache, and to drop it from later forwards (no mask is
built for a decode step). Every token of a decode step is attended, as ``generate`` does (it
appends ones). Positions are the model's own (``position_ids`` as ``generate`` computes them from
the mask), so RoPE matches stock with left padding too.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from tilefuse.ops.mla import op as _tilefuse_attention
from tilefuse.ops.mla.kv import decode_rows
from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE

# model_type -> attention class name (transformers' DeepSeek-V2 and V3 modeling files).
MLA_ATTENTION_CLASSES = {
    "deepseek_v2": "DeepseekV2Attention",
    "deepseek_v3": "DeepseekV3Attention",
}
KV_LORA_RANK = HEAD_DIM_V               # 512: the latent c_kv, also V
ROPE_DIM = HEAD_DIM - HEAD_DIM_V        # 64: the RoPE key shared by all heads
MAX_QUERY_ROWS = 512                    # flash_mla_with_kvcache takes s_q * h_q <= 512
MAX_HEADS = 128
ATTENTION_API = ("get_mla_metadata", "flash_mla_with_kvcache")   # what patch_mla(attention=) calls


def check_mla_config(config, name: str = "model") -> None:
    """``config`` is a DeepSeek-V2/V3 config whose latent fits the op: ``kv_lora_rank`` 512,
    ``qk_rope_head_dim`` 64, 1 to 128 heads. Raises ValueError naming ``name`` and the field."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MLA_ATTENTION_CLASSES:
        raise ValueError(f"{name}: expected config.model_type in {sorted(MLA_ATTENTION_CLASSES)}, got {model_type!r}")
    for field, want in (("kv_lora_rank", KV_LORA_RANK), ("qk_rope_head_dim", ROPE_DIM)):
        got = getattr(config, field, None)
        if got != want:
            raise ValueError(f"{name}: config.{field} must be {want} (flash_mla_with_kvcache caches {KV_LORA_RANK} "
                             f"latent + {ROPE_DIM} RoPE = {HEAD_DIM} values per token), got {got!r}")
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"{name}: config.num_attention_heads must be in [1, {MAX_HEADS}], got {heads!r}")


def mla_softmax_scale(config) -> float:
    """The attention scale of DeepSeek's MLA: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
    times ``mscale ** 2`` under yarn RoPE scaling, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``
    (1 when ``factor <= 1`` or ``mscale_all_dim`` is 0). RoPE parameters are read from
    ``config.rope_parameters`` (transformers 5) or ``config.rope_scaling``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        factor, mscale_all_dim = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


# ------------------------------------------------------------------------------------ the cache


class _Step:
    """One forward's cache writes and attention schedules, shared by every layer: ``slots`` are the
    flat page rows the ``[b * s]`` new tokens go to, ``lens`` the requests' lengths after them."""

    __slots__ = ("prefill", "batch", "q_len", "slots", "lens", "layers", "schedules")

    def __init__(self, prefill: bool, batch: int, q_len: int, slots: torch.Tensor, lens: torch.Tensor):
        self.prefill, self.batch, self.q_len, self.slots, self.lens = prefill, batch, q_len, slots, lens
        self.layers: set[int] = set()
        self.schedules: dict[tuple[int, int, int], tuple] = {}

    def schedule(self, rows: int, trim: int, attention=_tilefuse_attention) -> tuple:
        """Lengths without the step's last ``trim`` tokens, and ``attention.get_mla_metadata``'s
        split schedule for ``rows`` query rows per request (planned once per step, then shared by the
        layers: tilefuse's tensors, or FlashMLA main's schedule object that its first call fills)."""
        key = (id(attention), rows, trim)
        found = self.schedules.get(key)
        if found is None:
            lens = self.lens - trim if trim else self.lens
            found = self.schedules[key] = (lens, *attention.get_mla_metadata(lens, rows, 1))
        return found


_NOTHING = object()


class PagedMLACache(Cache):
    """A paged latent cache for a DeepSeek-V2/V3 model patched by :func:`patch_mla`, in
    FlashMLA's layout, that ``model.generate(..., past_key_values=cache)`` accepts.

    Parameters
    ----------
    model : the DeepSeek model (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, their base
        models) or its config. ``kv_lora_rank`` must be 512 and ``qk_rope_head_dim`` 64.
    max_batch : the most requests per forward (>= 1).
    max_tokens : tokens per request (>= 1; rounded up to whole pages of 64). A forward is refused
        when the tokens fed since the prefill, padding included, would pass it: the padded prompt
        width plus the new tokens of ``generate`` must fit.
    dtype, device : of the pages; default the model's (its first attention's ``kv_a_layernorm``
        weight), or ``torch.get_default_dtype()`` and the CPU for a config. Must be what the model
        computes in (the latents are written as they are, never converted).

    Device state (allocated here, at fixed addresses, never reallocated: a decode step that reads
    and advances it can be captured in a CUDA graph and replayed):

    * ``latent_pages`` ``[num_layers, num_blocks + 1, 64, 1, 576]``: layer ``l``'s ``k_cache``
      for :func:`tilefuse.flash_mla_with_kvcache` is ``latent_pages[l]``. Row = ``kv_a_layernorm(c_kv)``
      (512) then the RoPE'd ``k_pe`` (64). Page ``num_blocks`` of each layer takes the writes that
      have no place (padding tokens, tokens past ``max_tokens``) and is never read.
    * ``block_table`` ``[max_batch, pages_per_request]`` int32: request ``i`` owns pages
      ``i * pages_per_request ...``; the op reads the table, so rows may be pointed elsewhere.
    * ``cache_seqlens`` ``[max_batch]`` int32: each request's cached tokens (its padding excluded),
      advanced on the device by every forward; the first ``b`` entries serve a batch of ``b``.

    Per forward, the first layer works out the new tokens' page slots, advances ``cache_seqlens``
    and plans ``get_mla_metadata`` on the device; every layer then writes its latents and reuses
    the plan. Nothing in a decode step reads the device from the host.

    On the host the cache counts the tokens of each forward, padding included (what transformers'
    dynamic cache reports): ``get_seq_length()``, which sizes the model's mask and its default
    positions, and the ``max_tokens`` check (ValueError before a forward that would not fit).
    That count advances with eager forwards only: a loop that replays a captured step passes its
    own ``position_ids``. :meth:`reset` empties the cache in place for the next prompt (``generate``
    does not: build a cache per call, or reset it between calls); the next forward is a prefill.

    Not supported (ValueError naming the argument): beam search (``num_beams`` > 1), cropping
    (assisted generation), batch reordering or expansion; a model that is not patched
    (``past_key_values``).
    """

    def __init__(self, model, max_batch: int, max_tokens: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        config = getattr(model, "config", model)
        check_mla_config(config, "model")
        for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if dtype is None or device is None:
            default_dtype, default_device = _model_dtype_device(model)
            dtype = dtype if dtype is not None else default_dtype
            device = device if device is not None else default_device
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        super().__init__(layers=[])
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.pages_per_request = -(-max_tokens // PAGE_SIZE)
        self.num_blocks = max_batch * self.pages_per_request
        device = torch.device(device)
        self.latent_pages = torch.zeros(self.num_layers, self.num_blocks + 1, PAGE_SIZE, 1, HEAD_DIM, dtype=dtype,
                                        device=device)
        self.block_table = torch.arange(self.num_blocks, dtype=torch.int32, device=device).view(
            max_batch, self.pages_per_request)
        self.cache_seqlens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self._spill = self.num_blocks * PAGE_SIZE      # first row of the never-read page
        self._seen = 0                                 # tokens per row of the forwards so far, padding included
        self._batch: int | None = None
        self._step: _Step | None = None
        self._mask = _NOTHING

    def __repr__(self):
        return (f"{type(self).__name__}(num_layers={self.num_layers}, max_batch={self.max_batch}, "
                f"max_tokens={self.max_tokens}, dtype={self.latent_pages.dtype}, device={self.latent_pages.device})")

    def __len__(self):
        return self.num_layers

    # --- what transformers asks of a cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens per row of the eager forwards since the last reset, padding included."""
        return self._seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        """(kv_length, kv_offset) of the model's mask: the past tokens and the new ones, as
        transformers' dynamic cache gives them (the mask serves the prefill's stock attention)."""
        return self._seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_tokens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self._batch if self._batch is not None else self.max_batch

    def reset(self) -> None:
        """Empty every request, in place (addresses kept for captured graphs); the next forward is a prefill."""
        self.cache_seqlens.zero_()
        self._seen, self._batch, self._step, self._mask = 0, None, None, _NOTHING

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise ValueError("past_key_values: a PagedMLACache needs a model patched by tilefuse.hf.patch_mla "
                         "(its attention writes the pages itself)")

    def reorder_cache(self, beam_idx):
        raise ValueError("num_beams: a PagedMLACache serves greedy and sampled decoding (one beam per request)")

    def batch_repeat_interleave(self, repeats):
        raise ValueError("past_key_values: a PagedMLACache cannot be expanded; build one of max_batch >= the "
                         "expanded batch and run the prompt through it")

    def batch_select_indices(self, indices):
        raise ValueError("past_key_values: a PagedMLACache cannot select requests")

    def crop(self, *args, **kwargs):
        raise ValueError("past_key_values: a PagedMLACache cannot be cropped (assisted generation)")

    # --- what the patched attention uses

    def stage_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Hand the next forward's ``attention_mask`` to the cache (``patch_mla`` hooks the model to
        do it): a prefill writes only the tokens where the ``[b, tokens]`` mask is nonzero; later
        forwards ignore it. Without a staged mask every token is written."""
        self._mask = attention_mask

    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s pages, ``[num_blocks + 1, 64, 1, 576]``."""
        return self.latent_pages[layer_idx]

    def forward_plan(self, layer_idx: int, batch: int, q_len: int) -> _Step:
        """The plan of the forward that layer ``layer_idx`` is in: a new one at the first layer of a
        forward (after a staged mask, or when the layer comes round again), else the current one."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx: expected an integer in [0, {self.num_layers}) (the cache's layers), "
                             f"got {layer_idx!r}")
        plan = self._step
        if self._mask is not _NOTHING or plan is None or layer_idx in plan.layers:
            plan = self._step = self._begin(batch, q_len)
        elif (batch, q_len) != (plan.batch, plan.q_len):
            raise ValueError(f"hidden_states: expected [{plan.batch}, {plan.q_len}, hidden] like the forward's "
                             f"earlier layers, got batch {batch} and {q_len} tokens")
        plan.layers.add(layer_idx)
        return plan

    def _begin(self, batch: int, q_len: int) -> _Step:
        mask, self._mask = self._mask, _NOTHING
        prefill = self._seen == 0
        if batch > self.max_batch:
            raise ValueError(f"max_batch: the cache serves up to {self.max_batch} requests, the forward has {batch}")
        if not prefill and batch != self._batch:
            raise ValueError(f"past_key_values: the cache holds {self._batch} requests, the forward has {batch} "
                             f"(reset() it before another batch)")
        if self._seen + q_len > self.max_tokens:
            raise ValueError(f"max_tokens: the cache holds {self.max_tokens} tokens per request, the forward would "
                             f"bring it to {self._seen + q_len} ({self._seen} cached + {q_len} new)")
        device = self.cache_seqlens.device
        lens = self.cache_seqlens[:batch]
        offsets = torch.arange(q_len, device=device)[None, :]
        valid = None
        if prefill and mask is not None and mask is not _NOTHING:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < q_len:
                shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"attention_mask: expected a [batch={batch}, tokens >= {q_len}] padding mask (or "
                                 f"None) with a PagedMLACache, got {shape}")
            valid = mask[:, -q_len:].to(device) != 0
            offsets = valid.cumsum(1) - 1
        slot = lens[:, None].long() + offsets                                   # [b, s] position in the request
        pages = self.block_table[:batch].gather(1, torch.div(slot, PAGE_SIZE, rounding_mode="floor")
                                                .clamp_(0, self.pages_per_request - 1))
        rows = pages.long() * PAGE_SIZE + slot % PAGE_SIZE
        keep = slot < self.pages_per_request * PAGE_SIZE
        if valid is not None:
            keep &= valid
            lens.add_(valid.sum(1, dtype=torch.int32))
        else:
            lens.add_(q_len)
        rows = torch.where(keep, rows, self._spill)
        self._seen += q_len
        self._batch = batch
        return _Step(prefill, batch, q_len, rows.view(-1), lens)

    def check_rows(self, layer_idx: int, latent: torch.Tensor) -> None:
        """The new latents are in the pages' dtype and on their device (ValueError otherwise)."""
        pages = self.latent_pages[layer_idx]
        if latent.dtype != pages.dtype or latent.device != pages.device:
            raise ValueError(f"past_key_values: the cache holds {pages.dtype} on {pages.device}, the model "
                             f"computes {latent.dtype} on {latent.device} (build the cache with the model's "
                             f"dtype= and device=)")

    def write(self, layer_idx: int, plan: _Step, latent: torch.Tensor) -> None:
        """Write layer ``layer_idx``'s new latents ``[b, s, 576]`` to the slots of ``plan``."""
        self.check_rows(layer_idx, latent)
        self.latent_pages[layer_idx].view(-1, HEAD_DIM).index_copy_(0, plan.slots, latent.reshape(-1, HEAD_DIM))

    def attend(self, layer_idx: int, plan: _Step, q: torch.Tensor, softmax_scale: float,
               attention=_tilefuse_attention) -> torch.Tensor:
        """Causal MLA attention of ``q`` ``[b, s, h, 576]`` (the step's new tokens, already written)
        over layer ``layer_idx``'s pages: ``[b, s, h, 512]``, by ``attention`` (a module with
        FlashMLA's API; tilefuse's by default). More than ``512 // h`` tokens go in chunks of that
        many, each with the lengths cut at its last token."""
        batch, q_len, heads, _ = q.shape
        pages, table = self.latent_pages[layer_idx], self.block_table[:batch]
        chunk = max(1, MAX_QUERY_ROWS // heads)
        outs = []
        for start in range(0, q_len, chunk):
            stop = min(q_len, start + chunk)
            lens, meta, splits = plan.schedule((stop - start) * heads, q_len - stop, attention)
            part = q if stop - start == q_len else q[:, start:stop]
            if attention is not _tilefuse_attention:
                part = part.contiguous()       # FlashMLA takes a dense q
            outs.append(attention.flash_mla_with_kvcache(part, pages, table, lens, HEAD_DIM_V, meta, splits,
                                                         softmax_scale=softmax_scale, causal=True)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _model_dtype_device(model) -> tuple[torch.dtype, torch.device]:
    """dtype and device of the first MLA attention's ``kv_a_layernorm`` weight (norm weights stay in
    the compute dtype when projections are quantized), else the defaults."""
    if isinstance(model, nn.Module):
        for module in model.modules():
            norm = getattr(module, "kv_a_layernorm", None)
            weight = getattr(norm, "weight", None)
            if isinstance(weight, torch.Tensor):
                return weight.dtype, weight.device
    return torch.get_default_dtype(), torch.device("cpu")


# --------------------------------------------------------------------------------- the attention


class _LatentTap(DynamicCache):
    """Stands in for the cache in transformers' own attention forward (the prefill): keeps the
    latents the model would cache and hands them back unchanged."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.latent, self.k_pe = key_states, value_states
        return key_states, value_states


class PagedMLAAttention:
    """Mixed into a patched model's DeepSeek attention class (``patch_mla``): with a
    :class:`PagedMLACache` the prefill runs the class's own forward and records its latents, a
    decode step runs :meth:`_paged_decode`; with any other cache the class's own forward runs."""

    _cache_param = "past_key_values"     # the name of the cache argument of the patched class's forward
    _mla_attention = _tilefuse_attention  # the decode attention (patch_mla's attention=)
    _arg_names: tuple[str, ...] = ()     # its positional parameters after hidden_states

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if args:
            kwargs = {**dict(zip(self._arg_names, args)), **kwargs}
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, PagedMLACache):
            return super().forward(hidden_states, **kwargs)
        batch, q_len = hidden_states.shape[:2]
        plan = cache.forward_plan(self.layer_idx, batch, q_len)
        if plan.prefill:
            tap = _LatentTap()
            call = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
            call[self._cache_param] = tap
            out = super().forward(hidden_states, **call)
            latent = torch.cat((tap.latent.reshape(batch, q_len, KV_LORA_RANK),
                                tap.k_pe.reshape(batch, q_len, ROPE_DIM)), dim=-1)
            cache.write(self.layer_idx, plan, latent)
            return out
        position_embeddings = kwargs.get("position_embeddings")
        if position_embeddings is None:
            raise ValueError("position_embeddings: expected the model's rotary embeddings of the new tokens, got None")
        return self._paged_decode(hidden_states, position_embeddings, cache, plan), None

    def _paged_decode(self, hidden_states: torch.Tensor, position_embeddings, cache: PagedMLACache,
                      plan: _Step) -> torch.Tensor:
        """Absorbed MLA: ``hidden_states`` ``[b, s, H]`` -> the attention block's output ``[b, s, H]``."""
        batch, q_len, _ = hidden_states.shape
        nope, v_dim = self._mla_dims
        w_kv = self.kv_b_proj.weight
        heads = w_kv.shape[0] // (nope + v_dim)
        w_kv = w_kv.view(heads, nope + v_dim, KV_LORA_RANK)            # per head: W_UK rows, then W_UV rows
        q_nope, q_pe, c_kv, k_pe = self._mla_inputs(hidden_states, heads)
        rows = batch * q_len
        # W_UK folded into the query: a strided batched GEMM over the heads, no reshaping copy
        q_lat = torch.bmm(q_nope.reshape(rows, heads, nope).transpose(0, 1), w_kv[:, :nope])        # [h, b*s, 512]
        cache.check_rows(self.layer_idx, c_kv)
        q = _decode_rows(q_lat, q_pe, k_pe, c_kv, position_embeddings, self._mla_interleaved, plan.slots,
                         cache.k_cache(self.layer_idx))
        if q is None:       # the same in PyTorch ops: RoPE, the cache rows written, the query assembled
            q_pe, k_pe = _rotate(q_pe, k_pe[:, :, None], position_embeddings, self._mla_interleaved)
            cache.write(self.layer_idx, plan, torch.cat((c_kv, k_pe[:, :, 0]), dim=-1))
            q = torch.cat((q_lat.view(heads, batch, q_len, KV_LORA_RANK).permute(1, 2, 0, 3), q_pe), dim=-1)
        out = cache.attend(self.layer_idx, plan, q, self._mla_scale, self._mla_attention)          # [b, s, h, 512]
        out = torch.bmm(out.permute(2, 0, 1, 3).reshape(heads, rows, KV_LORA_RANK),
                        w_kv[:, nope:].transpose(1, 2))                                             # [h, b*s, v]
        return self.o_proj(out.permute(1, 0, 2).reshape(batch, q_len, heads * v_dim))

    def _mla_inputs(self, hidden_states: torch.Tensor, heads: int):
        """The projections of the new tokens, as the model computes them, before RoPE: ``q_nope``
        ``[b, s, h, nope]``, ``q_pe`` ``[b, s, h, 64]``, the normalised ``c_kv`` ``[b, s, 512]`` and
        ``k_pe`` ``[b, s, 64]`` (views of the projections' outputs)."""
        batch, q_len, _ = hidden_states.shape
        nope, _ = self._mla_dims
        if getattr(self, "q_a_proj", None) is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(batch, q_len, heads, nope + ROPE_DIM).split((nope, ROPE_DIM), dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split((KV_LORA_RANK, ROPE_DIM), dim=-1)
        return q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe


def _decode_rows(q_lat, q_pe, k_pe, c_kv, position_embeddings, interleaved: bool, slots, pages):
    """``ops.mla.kv.decode_rows`` with the model's rotations as that kernel takes them (the rotation
    :func:`_rotate` applies), or None where it does not run."""
    if isinstance(position_embeddings, torch.Tensor):
        if not position_embeddings.is_complex():
            return None                  # _rotate raises the error
        turn = torch.view_as_real(position_embeddings)
        cos, sin, mode = turn[..., 0], turn[..., 1], "complex"
    else:
        cos, sin = position_embeddings
        mode = "pairs" if interleaved else "halves"
    return decode_rows(q_lat, q_pe, k_pe, c_kv, cos, sin, mode, slots, pages)


def _rotate(q: torch.Tensor, k: torch.Tensor, position_embeddings, interleaved: bool):
    """RoPE on ``q`` ``[b, s, h, 64]`` and ``k`` ``[b, s, 1, 64]`` as the DeepSeek models apply it.

    * DeepSeek-V2 (``position_embeddings`` complex ``[b, s, 32]``, ``e^(i theta)``): value pairs
      ``(x[2j], x[2j+1])`` rotated as complex numbers in fp32, the result interleaved again.
    * DeepSeek-V3 (``(cos, sin)``, each ``[b, s, 64]`` holding the 32 angles twice): with
      ``rope_interleave`` the pairs ``(x[2j], x[2j+1])`` are rotated and the result laid out as
      all first members then all second members; without, the halves ``(x[j], x[j+32])`` are.
    """
    if isinstance(position_embeddings, torch.Tensor):
        if not position_embeddings.is_complex():
            raise ValueError("position_embeddings: expected (cos, sin) or complex rotations, got a real tensor")
        turn = position_embeddings[:, :, None]
        return _rotate_complex(q, turn), _rotate_complex(k, turn)
    cos, sin = position_embeddings
    cos, sin = cos[:, :, None], sin[:, :, None]
    if interleaved:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
    return _rotate_halves(q, cos, sin), _rotate_halves(k, cos, sin)


def _rotate_complex(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = turn.real, turn.imag
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


_PAGED_CLASSES: dict[type, type] = {}


def _paged_class(base: type) -> type:
    """``base`` with :class:`PagedMLAAttention` mixed in (one class per base)."""
    cls = _PAGED_CLASSES.get(base)
    if cls is None:
        params = list(inspect.signature(base.forward).parameters.values())[2:]      # after self, hidden_states
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        names = {p.name for p in params}
        cls = type(f"PagedMLA{base.__name__}", (PagedMLAAttention, base), {
            "__module__": __name__, "_arg_names": positional,
            "_cache_param": "cache" if "cache" in names else "past_key_values"})
        _PAGED_CLASSES[base] = cls
    return cls


# ------------------------------------------------------------------------------------- patching


def check_attention(attention, name: str = "attention"):
    """``attention`` (None: tilefuse's) as the object the patched attention calls: it must expose
    FlashMLA's API, callables ``get_mla_metadata(cache_seqlens, rows, 1)`` and
    ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, metadata, splits,
    softmax_scale=, causal=)``, as ``tilefuse``, ``tilefuse.ops.mla.op`` or a built ``flash_mla``
    do. Raises ValueError naming ``name``."""
    if attention is None:
        return _tilefuse_attention
    missing = [fn for fn in ATTENTION_API if not callable(getattr(attention, fn, None))]
    if missing:
        what = getattr(attention, "__name__", None) or type(attention).__name__
        raise ValueError(f"{name}: expected None (tilefuse's) or a module with FlashMLA's API (callable "
                         f"{' and '.join(ATTENTION_API)}, e.g. a built flash_mla), got {what!r} without "
                         f"{', '.join(missing)}")
    return attention


def attention_of(model: nn.Module):
    """The attention implementation the patched MLA modules of ``model`` call (the module given to
    :func:`patch_mla`, or ``tilefuse.ops.mla.op``); None when nothing is patched."""
    return next((mod._mla_attention for mod in model.modules() if isinstance(mod, PagedMLAAttention)), None)


def patch_mla(model: nn.Module, attention=None) -> int:
    """Make every DeepSeek MLA attention of ``model`` run over a :class:`PagedMLACache`, in place.

    ``attention``: the decode attention to call, None for tilefuse's
    (:func:`tilefuse.flash_mla_with_kvcache`, :func:`tilefuse.get_mla_metadata`), or any module or
    object with FlashMLA's API (:func:`check_attention`), such as a built ``flash_mla`` (to run
    FlashMLA inside the same model). Either way the split schedule is planned once per forward
    and shared by every layer.

    ``model.config.model_type`` (``deepseek_v2`` or ``deepseek_v3``) picks the attention class from
    :data:`MLA_ATTENTION_CLASSES`. Each such module keeps its weights, names and state dict; its
    class gains the paged path (:class:`PagedMLAAttention`), taken only when the cache passed in is
    a :class:`PagedMLACache` (this module's docstring says what runs). A forward pre-hook on the
    decoder model (``model.base_model``) hands each forward's 2D ``attention_mask`` to such a cache.
    Idempotent: a second call patches no module and returns 0; it sets the attention
    implementation of the patched modules to its ``attention``.

    >>> patch_mla(model)
    >>> cache = PagedMLACache(model, max_batch=ids.shape[0], max_tokens=ids.shape[1] + 64)
    >>> out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

    Returns the number of attention modules patched. Raises ValueError naming ``attention`` for an
    object without FlashMLA's API, and (naming ``model`` and the config field) for a model that is
    not DeepSeek-V2/V3, whose ``kv_lora_rank`` is not 512 or ``qk_rope_head_dim`` not 64, with
    more than 128 heads, with no attention module to patch, or whose ``kv_b_proj`` weight is not a
    plain floating-point matrix (the absorbed form multiplies by its slices).
    """
    impl = check_attention(attention)
    config = getattr(model, "config", None)
    check_mla_config(config, "model")
    cls_name = MLA_ATTENTION_CLASSES[config.model_type]
    targets = [mod for mod in model.modules() if type(mod).__name__ == cls_name]
    if not targets and not any(isinstance(mod, PagedMLAAttention) for mod in model.modules()):
        raise ValueError(f"model: expected {cls_name} modules (config.model_type {config.model_type!r}), found none")
    scale = mla_softmax_scale(config)
    for attn in targets:
        w_kv = getattr(getattr(attn, "kv_b_proj", None), "weight", None)
        if (not isinstance(w_kv, torch.Tensor) or w_kv.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                                    torch.float64)
                or w_kv.shape[1] != KV_LORA_RANK):
            what = f"{w_kv.dtype} {tuple(w_kv.shape)}" if isinstance(w_kv, torch.Tensor) else type(w_kv).__name__
            raise ValueError(f"model: {cls_name}.kv_b_proj.weight must be a float [heads * (qk_nope_head_dim + "
                             f"v_head_dim), {KV_LORA_RANK}] matrix, got {what}")
        if type(w_kv).__name__ == "DTensor":      # transformers' tp_plan: the global shape, local shards
            raise ValueError(f"model: {cls_name}.kv_b_proj.weight is a DTensor (a model loaded with tp_plan); "
                             f"use tilefuse.parallel.hf.patch_mla, which cuts the attention to this rank's heads")
    _hook_attention_mask(model)
    for attn in targets:
        attn.__class__ = _paged_class(type(attn))
        attn._mla_dims = (int(config.qk_nope_head_dim), int(config.v_head_dim))
        attn._mla_scale = float(getattr(attn, "scaling", scale))
        attn._mla_interleaved = bool(getattr(config, "rope_interleave", False))
    for attn in model.modules():
        if isinstance(attn, PagedMLAAttention):
            attn._mla_attention = impl
    return len(targets)


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch_mla` patched ``model`` (its attention then decodes only over a
    :class:`PagedMLACache`)."""
    return getattr(getattr(model, "base_model", model), "_tilefuse_mla_hook", None) is not None


def _hook_attention_mask(model: nn.Module) -> None:
    """A forward pre-hook on the decoder model that hands its ``attention_mask`` to a
    :class:`PagedMLACache` passed with it (once per model). After the prefill the model gets no
    mask: the paged attention reads none, so transformers' mask code (a host sync per step when a
    2D mask has padding, and a ``[b, 1, s, past + s]`` mask) is skipped."""
    if is_patched(model):
        return
    base = getattr(model, "base_model", model)
    params = inspect.signature(base.forward).parameters.values()
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if "attention_mask" not in names:
        raise ValueError(f"model: expected the decoder model ({type(base).__name__}) to take attention_mask")
    at = names.index("attention_mask")

    def stage(module, args, kwargs):
        values = {**dict(zip(names, args)), **kwargs}
        cache = values.get("cache", values.get("past_key_values"))
        if not isinstance(cache, PagedMLACache):
            return None
        mask = values.get("attention_mask")
        cache.stage_attention_mask(mask)
        if mask is None or cache.get_seq_length() == 0:
            return None
        if len(args) > at:
            args = (*args[:at], None, *args[at + 1:])
        else:
            kwargs = {**kwargs, "attention_mask": None}
        return args, kwargs

    base._tilefuse_mla_hook = base.register_forward_pre_hook(stage, with_kwargs=True)
