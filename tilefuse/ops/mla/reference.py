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
        kv = k_cache[pages].reshape(-1, h_kv, head_dim)[:length].to(compute_dtype)   # [L, h_kv, d]
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
