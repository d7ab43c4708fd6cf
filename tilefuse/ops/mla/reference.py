"""MLA decode attention over a paged latent cache in plain PyTorch: the executable spec of
``tilefuse.flash_mla_with_kvcache``.

Layout (FlashMLA's): each cached token is one latent vector of ``d = 576`` values (512 latent +
64 RoPE), stored in pages of ``page`` tokens (FlashMLA's 64; 16, 32, 128 and 256 too); V is the
first ``head_dim_v = 512`` values of the same vector.

* q            ``[b, s_q, h_q, 576]``
* k_cache      ``[num_blocks, page, h_kv, 576]`` (h_kv = 1)
* block_table  ``[b, max_blocks]`` int32: request i's token t lives in page ``block_table[i, t // page]``
* cache_seqlens ``[b]`` int32, each in ``[0, page max_blocks]``

Query token ``t`` of ``s_q`` (causal) sees keys ``0 .. L - s_q + t``; without causal masking it
sees all ``L``. Rules the kernels follow too:

* Only the first ``ceil(L / page)`` pages of a request are read, and slots past ``L`` never: NaN
  there cannot leak. Those pages must lie in ``[0, num_blocks)`` (checked here: ``ValueError``).
* A query row with no visible key returns out = 0 and lse = +inf.
* NaN in an input that reaches an output propagates: a NaN in a query head or in a visible key
  gives NaN in that head's output and lse (never a silent 0).
* Probabilities are renormalised by their sum, so every output row is a convex combination of
  visible V rows (no overflow beyond them, whatever the scale of the scores).
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64                        # FlashMLA's page; the kernels schedule work in chunks of it
PAGE_SIZES = (16, 32, 64, 128, 256)   # the cache page sizes the kernels take
HEAD_DIM = 576        # 512 latent + 64 RoPE values per cached token
HEAD_DIM_V = 512      # V: the latent part


def check_page_shape(name: str, cache: torch.Tensor, width: int) -> None:
    """``cache`` is ``[num_blocks, page, 1, width]`` with ``page`` in :data:`PAGE_SIZES` (one KV
    head); raises ValueError naming ``name`` otherwise (the other checks are the callers')."""
    if cache.dim() != 4 or cache.shape[1] not in PAGE_SIZES or cache.shape[2] != 1:
        raise ValueError(f"{name}: expected [num_blocks, page, 1, {width}] with page in {PAGE_SIZES}, got shape "
                         f"{tuple(cache.shape)}")


def check_block_table(block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_blocks: int,
                      page_size: int = PAGE_SIZE) -> None:
    """The pages each request reads (the first ``ceil(L / page_size)`` entries) lie in
    ``[0, num_blocks)``. Reads the tensors (a host sync on a GPU)."""
    if block_table.numel() == 0:
        return
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size \
        < cache_seqlens.to(block_table.device)[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"block_table: expected pages in [0, num_blocks={num_blocks}) below each request's "
                         f"length, got {int(block_table[i, j])} at [{i}, {j}]")


def mla_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: float | None = None,
                         causal: bool = False, *, compute_dtype: torch.dtype = torch.float32,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [b, s_q, h_q, head_dim_v]`` (q's dtype by default) and ``lse [b, h_q, s_q]`` fp32
    (natural log; fp64 with ``compute_dtype=torch.float64``)."""
    batch, s_q, h_q, head_dim = q.shape
    num_blocks, page_size, h_kv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("inf"), dtype=lse_dtype, device=q.device)
    seqlens = cache_seqlens.tolist()
    capacity = block_table.shape[1] * page_size
    if any(n < 0 or n > capacity for n in seqlens):
        raise ValueError(f"cache_seqlens: expected lengths in [0, {capacity}] (block_table has "
                         f"{block_table.shape[1]} pages of {page_size}), got [{min(seqlens)}, {max(seqlens)}]")
    check_block_table(block_table, cache_seqlens, num_blocks, page_size)
    for i, length in enumerate(seqlens):
        if length == 0:
            continue
        pages = block_table[i, : (length + page_size - 1) // page_size].long()
        rows = k_cache[pages]
        if rows.shape[-1] == FP8_KV_BYTES:                     # an FP8 cache: its dequantized values
            rows = dequantize_kv_reference(rows, torch.float32)
        kv = rows.reshape(-1, h_kv, head_dim)[:length].to(compute_dtype)   # [L, h_kv, d]
        q_heads = q[i].to(compute_dtype).reshape(s_q, h_kv, h_q // h_kv, head_dim)       # [s_q, h_kv, g, d]
        scores = torch.einsum("skgd,lkd->kgsl", q_heads, kv) * scale                   # [h_kv, g, s_q, L]
        visible = torch.ones(s_q, length, dtype=torch.bool, device=q.device)
        if causal:
            key_pos = torch.arange(length, device=q.device)
            last_visible = length - s_q + torch.arange(s_q, device=q.device)            # [s_q]
            visible = key_pos[None, :] <= last_visible[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        # Softmax with the row maximum taken out (a row with no visible key: max -inf, weights 0)
        # and renormalised by the weights' own sum; NaN scores propagate through max and sum.
        row_max = scores.amax(dim=-1, keepdim=True)
        empty = torch.isneginf(row_max)
        weights = torch.exp(scores - torch.where(empty, 0.0, row_max))
        total = weights.sum(dim=-1, keepdim=True)
        o = torch.einsum("kgsl,lkd->skgd", weights / torch.where(empty, 1.0, total), kv[..., :head_dim_v])
        row_lse = torch.where(empty, float("inf"), row_max + torch.log(total)).squeeze(-1)   # [h_kv, g, s_q]
        out[i] = o.reshape(s_q, h_q, head_dim_v)
        lse[i] = row_lse.reshape(h_q, s_q).to(lse_dtype)
    return out.to(out_dtype or q.dtype), lse


# ----------------------------------------------------------------------------- FP8 latent cache
# FlashMLA's FP8 layout (DeepSeek-V3.2): 656 bytes per token = the 512 latent ("NoPE") values as
# e4m3, 4 fp32 scales (one per 128 values: value = e4m3 x scale), then the 64 RoPE values as
# bf16, unquantized. FlashMLA holds it as a float8_e4m3fn tensor [..., 656] (the bytes viewed as
# e4m3); tilefuse takes that or uint8.
FP8_KV_BYTES = 656
FP8_GROUP = 128
FP8_MAX = 448.0       # the largest finite e4m3 value
FP8_MIN_SCALE = 1e-4  # scales are at least this, rounded up to a power of two (2^-13)


def check_finite_latent(latent: torch.Tensor) -> None:
    """Raise ``ValueError`` where ``latent`` holds an inf or NaN (reads it: a host sync)."""
    if not bool(torch.isfinite(latent).all()):
        raise ValueError("latent: expected finite values (an inf or NaN makes its group's FP8 scale meaningless)")


def _toward_zero_within(values: torch.Tensor, bits: torch.dtype, top: float) -> torch.Tensor:
    """``values`` (e4m3 or bf16) with each magnitude above ``top`` stepped one code toward zero
    (the codes of one sign are ordered by magnitude: one less in the integer view ``bits``)."""
    over = values.float().abs() > top
    return torch.where(over, values.view(bits) - 1, values.view(bits)).view(values.dtype)


def quantize_kv_reference(latent: torch.Tensor, *, check: bool = False) -> torch.Tensor:
    """``latent [..., 576]`` (fp32 / bf16 / fp16) -> ``[..., 656]`` uint8 in the FP8 layout: per
    group of 128 latent values the scale is ``amax / 448`` rounded up to a power of two, at least
    2^-13 (FlashMLA's and DeepSeek-V3.2's convention: a UE8M0-representable scale, so codes times
    scale is exact), codes ``e4m3(x / scale)`` (round to nearest), the RoPE part rounded to
    bf16. An fp16 latent dequantizes within fp16's range: a code or RoPE value that rounding took
    past 65504 (65504 itself rounds to 65536 both ways) is the next one toward zero instead.
    A non-finite value makes its group NaN (the RoPE part keeps it); ``check`` raises
    ``ValueError`` for one instead (a host sync)."""
    if latent.shape[-1] != HEAD_DIM:
        raise ValueError(f"latent: expected [..., {HEAD_DIM}] (512 latent + 64 RoPE), got shape {tuple(latent.shape)}")
    x = latent.float()
    if check:
        check_finite_latent(x)
    lead = x.shape[:-1]
    groups = x[..., :HEAD_DIM_V].reshape(*lead, HEAD_DIM_V // FP8_GROUP, FP8_GROUP)
    amax = groups.abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / FP8_MAX, FP8_MIN_SCALE))))
    codes = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rope = x[..., HEAD_DIM_V:].to(torch.bfloat16)
    if latent.dtype == torch.float16:
        top = torch.finfo(torch.float16).max
        codes = _toward_zero_within(codes, torch.uint8, top / scale[..., None])   # (scale: a power of two)
        rope = _toward_zero_within(rope, torch.int16, top)
    return torch.cat([codes.reshape(*lead, HEAD_DIM_V).view(torch.uint8),
                      scale.contiguous().view(torch.uint8).reshape(*lead, 4 * 4),
                      rope.contiguous().view(torch.uint8).reshape(*lead, 2 * (HEAD_DIM - HEAD_DIM_V))], dim=-1)


def dequantize_kv_reference(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., 656]`` (uint8, or float8_e4m3fn as FlashMLA holds it) -> ``[..., 576]`` in
    ``dtype``: ``e4m3 x scale`` per 128-value group (in fp32, then rounded to ``dtype``), the RoPE
    part as stored (bf16)."""
    if packed.shape[-1] != FP8_KV_BYTES or packed.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"k_cache: expected [..., {FP8_KV_BYTES}] uint8 or float8_e4m3fn (FlashMLA's FP8 layout), "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    raw = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    lead = raw.shape[:-1]
    codes = raw[..., :HEAD_DIM_V].contiguous().view(torch.float8_e4m3fn).float()
    scale = raw[..., HEAD_DIM_V:HEAD_DIM_V + 16].contiguous().view(torch.float32)
    rope = raw[..., HEAD_DIM_V + 16:].contiguous().view(torch.bfloat16).float()
    nope = (codes.reshape(*lead, HEAD_DIM_V // FP8_GROUP, FP8_GROUP) * scale[..., None]).reshape(*lead, HEAD_DIM_V)
    return torch.cat([nope, rope], dim=-1).to(dtype)


def mla_sparse_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                                softmax_scale: float | None = None, *, topk_length: torch.Tensor | None = None,
                                attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
                                extra_indices: torch.Tensor | None = None,
                                extra_topk_length: torch.Tensor | None = None,
                                compute_dtype: torch.dtype = torch.float32,
                                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse (top-k) MLA decode, DeepSeek-V3.2's: each query token attends to the cached tokens
    its indices name. Returns ``out [b, s_q, h_q, 512]`` (q's dtype by default) and ``lse [b, h_q,
    s_q]`` fp32 (natural log; fp64 with ``compute_dtype=torch.float64``).

    * ``q [b, s_q, h_q, 576]``; ``k_cache [num_blocks, page, 1, 576]`` in a floating dtype, or
      ``[.., 656]`` in the FP8 layout (dequantized here).
    * ``indices [b, s_q, topk]`` int: ``page * page_size + offset`` of each attended token; -1,
      and any index outside the cache, attends to nothing. ``topk_length [b]``: only the first
      ``topk_length[i]`` indices of request i count.
    * ``extra_k_cache`` / ``extra_indices`` / ``extra_topk_length``: more tokens, from a second
      cache, in the same softmax.
    * ``attn_sink [h_q]`` fp32: a per-head logit that joins the softmax's denominator only: the
      output is scaled by ``exp(lse) / (exp(lse) + exp(sink))`` (+inf: the output is 0); the
      returned lse is the tokens' own.
    * A row that attends to no token returns out = 0 and lse = +inf. Tokens not attended are
      never read into a result: NaN there cannot leak.
    """
    batch, s_q, h_q, head_dim = q.shape
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32

    def gather(cache, idx, length):
        rows = cache.reshape(-1, cache.shape[-1])
        valid = (idx >= 0) & (idx < rows.shape[0])
        if length is not None:
            valid &= torch.arange(idx.shape[-1], device=idx.device)[None, None, :] < length.view(-1, 1, 1)
        picked = rows[torch.where(valid, idx, 0).long()]                    # [b, s_q, k, width]
        if picked.shape[-1] == FP8_KV_BYTES:
            picked = dequantize_kv_reference(picked, torch.float32)
        picked = torch.where(valid[..., None], picked.to(compute_dtype), 0.0)   # unattended rows: 0, never NaN
        return picked, valid

    kv, valid = gather(k_cache, indices, topk_length)
    if extra_k_cache is not None:
        kv2, valid2 = gather(extra_k_cache, extra_indices, extra_topk_length)
        kv, valid = torch.cat([kv, kv2], 2), torch.cat([valid, valid2], 2)
    scores = torch.einsum("bshd,bskd->bshk", q.to(compute_dtype), kv) * scale          # [b, s_q, h_q, k]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)                                                 # [b, s_q, h_q]
    empty = torch.isneginf(lse)
    weights = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("bshk,bskd->bshd", weights, kv[..., :HEAD_DIM_V])
    if attn_sink is not None:
        sink = attn_sink.to(compute_dtype).view(1, 1, h_q)
        out = out * torch.sigmoid(lse - sink)[..., None]          # exp(lse) / (exp(lse) + exp(sink))
    out = torch.where(empty[..., None], 0.0, out)
    lse = torch.where(empty, float("inf"), lse)
    return out.to(out_dtype or q.dtype), lse.transpose(1, 2).to(lse_dtype).contiguous()
