"""Cases for MLA decode, shared by the tests and ``tilefuse bench mla``.

``SHAPES`` ((batch, h_q, context) of the benchmark grid), ``make_case()`` (queries and a paged cache),
``reference_fp64()`` (the spec in fp64), plus FlashMLA's FLOP and byte counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE


# (batch, h_q, context): DeepSeek-V2/V3 decode with 16 heads per GPU (128 over 8) and all 128
SHAPES = [(batch, h_q, ctx) for batch in (16, 32, 64) for h_q in (16, 32, 64, 128)
          for ctx in (1024, 4096, 16384, 65536)]


@dataclass
class MLACase:
    q: torch.Tensor              # [b, s_q, h_q, 576]
    k_cache: torch.Tensor        # [num_blocks, 64, 1, 576]
    block_table: torch.Tensor    # [b, max_blocks] int32, shuffled pages
    cache_seqlens: torch.Tensor  # [b] int32

    def args(self):
        return self.q, self.k_cache, self.block_table, self.cache_seqlens


def paged_cache(seqlens: list[int], dtype: torch.dtype, device, *, extra_blocks: int = 0,
                nan_tail: bool = True, shuffle: bool = True, max_blocks: int | None = None,
                page_size: int = PAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding ``seqlens[i]`` random tokens for request i, on shuffled pages of
    ``page_size`` tokens.

    Slots past each length are NaN (``nan_tail``) so a kernel that reads them fails; pages a
    request does not use are NaN too. Values are N(0, 1) like FlashMLA's tests.
    """
    batch = len(seqlens)
    need = max([(n + page_size - 1) // page_size for n in seqlens] + [1])
    max_blocks = max(max_blocks or need, need)
    num_blocks = batch * max_blocks + extra_blocks
    # drawn in fp32 a few thousand pages at a time: a whole fp32 temporary of a large serving mix
    # (256 requests up to 128K tokens) would need about twice the cache itself on the GPU
    k_cache = torch.empty(num_blocks, page_size, 1, HEAD_DIM, dtype=dtype, device=device)
    for first in range(0, num_blocks, 4096):
        last = min(first + 4096, num_blocks)
        k_cache[first:last] = torch.randn(last - first, page_size, 1, HEAD_DIM, dtype=torch.float32, device=device)
    order = torch.randperm(num_blocks) if shuffle else torch.arange(num_blocks)
    block_table = order[: batch * max_blocks].view(batch, max_blocks).to(torch.int32).to(device)
    if nan_tail:
        used = torch.zeros(num_blocks, page_size, dtype=torch.bool)
        table = block_table.cpu()
        for i, n in enumerate(seqlens):
            for t in range(0, n, page_size):
                page = int(table[i, t // page_size])
                used[page, : min(page_size, n - t)] = True
        k_cache[~used.to(device)] = float("nan")
    return k_cache, block_table


def make_case(seqlens: list[int], s_q: int, h_q: int, dtype: torch.dtype, device, **cache_kw) -> MLACase:
    """Queries and a paged cache for one decode step of ``len(seqlens)`` requests."""
    batch = len(seqlens)
    q = torch.randn(batch, s_q, h_q, HEAD_DIM, dtype=torch.float32, device=device).to(dtype)
    k_cache, block_table = paged_cache(seqlens, dtype, device, **cache_kw)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return MLACase(q, k_cache, block_table, lens)


def reference_fp64(case: MLACase, causal: bool, softmax_scale: float | None = None):
    """(out, lse) of the spec in fp64 on the case's inputs."""
    from tilefuse.ops.mla.reference import mla_decode_reference

    return mla_decode_reference(*case.args(), HEAD_DIM_V, softmax_scale, causal, compute_dtype=torch.float64)


def flops_bytes(seqlens: list[int], s_q: int, h_q: int, elem_bytes: int = 2) -> tuple[float, float]:
    """FlashMLA's counts: FLOPs = 2 s_q sum(L) h_q (576 + 512); bytes = (sum(L) 576 + b s_q h_q (576 + 512)) * 2."""
    total = float(sum(seqlens))
    flops = 2.0 * s_q * total * h_q * (HEAD_DIM + HEAD_DIM_V)
    nbytes = (total * HEAD_DIM + len(seqlens) * s_q * h_q * (HEAD_DIM + HEAD_DIM_V)) * elem_bytes
    return flops, nbytes


def sparse_indices(seqlens: list[int], s_q: int, topk: int, block_table: torch.Tensor, page: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [b, s_q, topk] int32, topk_length [b] int32)``: each query token's top-k as an
    indexer gives it, ``min(topk, L)`` distinct positions of its request drawn at random (as cache
    slots ``page * page_size + offset``), then -1; ``topk_length`` = the count of valid ones."""
    table = block_table.cpu().long()
    idx = torch.full((len(seqlens), s_q, topk), -1, dtype=torch.int32)
    for i, n in enumerate(seqlens):
        k = min(topk, n)
        if k == 0:
            continue
        pos = torch.rand(s_q, n, generator=gen).argsort(-1)[:, :k]
        idx[i, :, :k] = (table[i, pos // page] * page + pos % page).int()
    lengths = torch.tensor([min(topk, n) for n in seqlens], dtype=torch.int32)
    return idx.to(block_table.device), lengths.to(block_table.device)
