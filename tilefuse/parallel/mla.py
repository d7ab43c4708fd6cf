"""``ParallelMLADecodeAttention``: MLA decode with the query heads split over the ranks.

MLA caches one latent vector per token (576 values) shared by every head, so tensor parallelism
replicates the latent cache and splits the heads: rank r runs attention for heads
``r * h .. (r + 1) * h - 1`` (``h = num_heads / world_size``) over the whole cache. No
collective is needed inside attention; the model's output projection (row-parallel over the
heads' values) carries the layer's one all-reduce.

The kernel is chosen by the rows each rank sees, ``s_q * h``, and the chip
(:func:`tilefuse.ops.mla.op.choose_variant`): on an H100/H200 the Gluon kernel takes every row
count; elsewhere (and on an H20 below 64 rows) DeepSeek-V3's 128 heads run the standard kernel
with 64-row head tiles at 1 and 2 ranks, while 8 ranks (16 heads each) or 32 heads over 2 ranks
run the unpadded <= 16-row paths.
"""

from __future__ import annotations

import torch
from torch import nn

from tilefuse.nn.mla import MLADecodeAttention
from tilefuse.parallel.group import Placement, all_gather, placement, split


class ParallelMLADecodeAttention(nn.Module):
    """MLA decode over a replicated paged latent cache, this rank's share of the heads.

    Parameters
    ----------
    num_heads : query heads of the whole layer (all ranks); world_size must divide it.
    softmax_scale, causal : as :class:`tilefuse.nn.MLADecodeAttention`.
    group, rank, world_size : the tensor-parallel group (:func:`tilefuse.parallel.group.placement`).
    gather_output : all-gather the heads, so ``out`` and ``lse`` cover all ``num_heads``.

    ``forward(q, k_cache, block_table, cache_seqlens=None)``: q ``[b, s_q, num_heads / world_size, 576]``
    (this rank's heads, as a column-parallel q projection leaves them) or ``[b, s_q, num_heads, 576]``
    (this rank's heads are taken here); k_cache ``[num_blocks, 64, 1, 576]`` and block_table as for
    :func:`tilefuse.flash_mla_with_kvcache`, the same on every rank. Returns out
    ``[b, s_q, h, 512]`` (q's dtype) and lse ``[b, h, s_q]`` fp32 for this rank's h heads, or for
    all heads with ``gather_output``.
    """

    def __init__(self, num_heads: int, softmax_scale: float | None = None, causal: bool = True, *,
                 group=None, rank: int | None = None, world_size: int | None = None, gather_output: bool = False):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected a positive integer, got {num_heads!r}")
        self.where: Placement = placement(group, rank, world_size)
        local_heads = split(num_heads, self.where.world_size, "num_heads",
                            why="each rank runs num_heads / world_size query heads")
        self.num_heads, self.gather_output = num_heads, gather_output
        self.local = MLADecodeAttention(local_heads, softmax_scale, causal)

    @classmethod
    def from_module(cls, attn: MLADecodeAttention, group=None, *, rank: int | None = None,
                    world_size: int | None = None, gather_output: bool = False) -> ParallelMLADecodeAttention:
        """The shard of a one-device :class:`~tilefuse.nn.MLADecodeAttention` (same scale and masking)."""
        return cls(attn.num_heads, attn.softmax_scale, attn.causal, group=group, rank=rank, world_size=world_size,
                   gather_output=gather_output)

    @property
    def heads(self) -> slice:
        """This rank's query heads, as a slice of ``range(num_heads)``."""
        return self.where.part(self.num_heads)

    def plan(self, cache_seqlens: torch.Tensor, s_q: int = 1) -> ParallelMLADecodeAttention:
        """This step's schedule for this rank's rows (``s_q * num_heads / world_size``); returns self."""
        self.local.plan(cache_seqlens, s_q)
        return self

    def kernel(self, s_q: int = 1, max_blocks: int = 1, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.bfloat16) -> str:
        """The kernel variant this rank's calls run on ``device`` with a ``dtype`` q (``"wgmma"``,
        ``"standard"`` or ``"transposed"``; without a device, the rule of the ``tl`` kernels)."""
        from tilefuse.ops.mla.op import choose_variant

        q = None if device is None else torch.empty(0, dtype=dtype, device=device)
        return choose_variant(s_q * self.local.num_heads, max_blocks, q)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.where.world_size > 1 and isinstance(q, torch.Tensor) and q.dim() == 4
                and q.shape[2] == self.num_heads):
            q = q[:, :, self.heads]
        out, lse = self.local(q, k_cache, block_table, cache_seqlens)
        if self.gather_output:
            out, lse = all_gather(out, self.where, dim=2), all_gather(lse, self.where, dim=1)
        return out, lse

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, local_heads={self.local.num_heads}, rank={self.where.rank}, "
                f"world_size={self.where.world_size}, gather_output={self.gather_output}")
