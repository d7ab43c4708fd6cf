"""``MLADecodeAttention``: the paged-cache MLA decode call of one layer, as a module.

Thin on purpose: the projections (q absorption, output up-projection) stay in the model; this
holds the attention settings and the per-step schedule, which every layer of a step can share.

>>> attn = MLADecodeAttention(num_heads=16)
>>> attn.plan(cache_seqlens, s_q=1)             # once per decode step (CUDA-graph capturable)
>>> out, lse = attn(q, k_cache, block_table)    # q: [b, 1, 16, 576] -> out: [b, 1, 16, 512]
"""

from __future__ import annotations

import torch
from torch import nn

from tilefuse.ops.mla.op import flash_mla_with_kvcache, get_mla_metadata
from tilefuse.ops.mla.reference import HEAD_DIM_V


class MLADecodeAttention(nn.Module):
    """MLA decode over a paged latent cache (FlashMLA layout: pages of 64 tokens x 576 values).

    Parameters
    ----------
    num_heads : h_q, query heads on this device (1 to 128).
    softmax_scale : default ``576 ** -0.5``.
    causal : query token t of s_q sees keys ``0 .. L - s_q + t``.
    """

    def __init__(self, num_heads: int, softmax_scale: float | None = None, causal: bool = True):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or not 1 <= num_heads <= 128:
            raise ValueError(f"num_heads: expected an integer in [1, 128], got {num_heads!r}")
        self.num_heads = num_heads
        self.softmax_scale = softmax_scale
        self.causal = causal
        self._plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def plan(self, cache_seqlens: torch.Tensor, s_q: int = 1) -> MLADecodeAttention:
        """Compute the split schedule for this step's lengths (``[b]`` int32); returns self."""
        meta, splits = get_mla_metadata(cache_seqlens, s_q * self.num_heads, 1)
        self._plan = (cache_seqlens, meta, splits)
        return self

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [b, s_q, h_q, 576]; k_cache: [num_blocks, 64, 1, 576]; block_table: [b, max_blocks] int32.

        Returns out [b, s_q, h_q, 512] (q's dtype) and lse [b, h_q, s_q] fp32. Without
        ``cache_seqlens`` the lengths and schedule of the last :meth:`plan` are used.
        """
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] != self.num_heads:
            raise ValueError(f"q: expected {self.num_heads} heads (num_heads of this module) in dim 2 of "
                             f"[b, s_q, h_q, 576], got shape {tuple(q.shape)}")
        if cache_seqlens is not None:
            self.plan(cache_seqlens, q.shape[1])
        if self._plan is None:
            raise ValueError("cache_seqlens: expected a tensor, or a call to plan() first, got None")
        lens, meta, splits = self._plan
        return flash_mla_with_kvcache(q, k_cache, block_table, lens, HEAD_DIM_V, meta, splits,
                                      softmax_scale=self.softmax_scale, causal=self.causal)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, softmax_scale={self.softmax_scale}, causal={self.causal}"
