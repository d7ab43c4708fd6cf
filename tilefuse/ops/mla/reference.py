"""MLA decode attention over a paged latent cache in plain PyTorch: the executable spec of
``tilefuse.flash_mla_with_kvcache``.

Layout (FlashMLA's): each cached token is one latent vector of ``d = 576`` values (512 latent +
64 RoPE), stored in pages of 64 tokens; V is the first ``head_dim_v = 512`` values of the same
vector.

* q            ``[b, s_q, h_q, 576]``
* k_cache      ``[num_blocks, 64, h_kv, 576]`` (h_kv = 1)
* block_table  ``[b, max_blocks]`` int32: request i's token t lives in page ``block_table[i, t // 64]``
* cache_seqlens ``[b]`` int32

Query token ``t`` of ``s_q`` (causal) sees keys ``0 .. L - s_q + t``; without causal masking it
sees all ``L``. Slots past a request's length are never read, so NaN there cannot leak. A query
row with no visible key returns out = 0 and lse = +inf.
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64


def mla_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: float | None = None,
                         causal: bool = False, *, compute_dtype: torch.dtype = torch.float32,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [b, s_q, h_q, head_dim_v]`` (q's dtype by default) and ``lse [b, h_q, s_q]`` fp32
    (natural log; fp64 with ``compute_dtype=torch.float64``)."""
    batch, s_q, h_q, head_dim = q.shape
    page_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("inf"), dtype=lse_dtype, device=q.device)
    seqlens = cache_seqlens.tolist()
    for i, length in enumerate(seqlens):
        if length == 0:
            continue
        pages = block_table[i, : (length + page_size - 1) // page_size].long()
        kv = k_cache[pages].reshape(-1, h_kv, head_dim)[:length].to(compute_dtype)   # [L, h_kv, d]
        q_heads = q[i].to(compute_dtype).reshape(s_q, h_kv, h_q // h_kv, head_dim)       # [s_q, h_kv, g, d]
        scores = torch.einsum("skgd,lkd->kgsl", q_heads, kv) * scale                   # [h_kv, g, s_q, L]
        if causal:
            key_pos = torch.arange(length, device=q.device)
            last_visible = length - s_q + torch.arange(s_q, device=q.device)            # [s_q]
            scores = scores.masked_fill(key_pos[None, :] > last_visible[:, None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)                                        # [h_kv, g, s_q]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)                  # empty rows -> 0
        o = torch.einsum("kgsl,lkd->skgd", probs, kv[..., :head_dim_v])
        out[i] = o.reshape(s_q, h_q, head_dim_v)
        lse[i] = row_lse.reshape(h_q, s_q).to(lse_dtype).masked_fill(torch.isneginf(row_lse.reshape(h_q, s_q)),
                                                                     float("inf"))
    return out.to(out_dtype or q.dtype), lse
