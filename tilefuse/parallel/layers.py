"""Tensor-parallel wrappers around tilefuse's modules: each holds this rank's shard as an ordinary
module (``nn.Linear``, :class:`~tilefuse.nn.VQLinear`, :class:`~tilefuse.nn.FusedSwiGLUMLP`) of
plain tensors, so the kernels run on the shard unchanged, and adds the one collective the layout
needs. Build them from full modules with :func:`tilefuse.parallel.sharding`.

* :class:`ColumnParallel` -- output features split: this rank's rows of W. Input replicated,
  output this rank's slice of the features (``gather_output=True``: all of them, one all-gather).
* :class:`RowParallel` -- input features split: this rank's columns of W. Input this rank's
  slice (a full input is sliced here), output the sum over ranks: one all-reduce.
* :class:`ParallelSwiGLUMLP` -- the fused gate/up projection on this rank's slice of the
  intermediate size (column-parallel: its gate rows and the matching up rows) feeding its
  columns of the down projection (row-parallel): one all-reduce per MLP, nothing between.

A bias of a row-parallel layer lives on rank 0 only, inside rank 0's local module (the kernels
add it to the fp32 accumulator), so the sum over ranks carries it once; with
``reduce_results=False`` the partial outputs still sum to the layer's output, for a caller that
reduces them itself (fused with a residual add, say).
"""

from __future__ import annotations

import torch
from torch import nn

from tilefuse.parallel.group import Placement, all_gather, all_reduce_


class _Sharded(nn.Module):
    """Common part: the local module and where this rank sits."""

    def __init__(self, local: nn.Module, where: Placement):
        super().__init__()
        self.local = local
        self.where = where

    @property
    def rank(self) -> int:
        return self.where.rank

    @property
    def world_size(self) -> int:
        return self.where.world_size

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world_size={self.world_size}"


class ColumnParallel(_Sharded):
    """A linear layer whose output features are split over the ranks.

    local : this rank's rows: an ``nn.Linear`` or ``VQLinear`` with ``out_features / world_size``
        outputs (rank r holds outputs ``r * n .. (r + 1) * n - 1``).
    gather_output : all-gather the ranks' outputs into the full ``[..., out_features]``.

    ``x: [..., in_features]`` (the same on every rank) -> ``[..., out_features / world_size]``
    (or ``[..., out_features]`` gathered), x's dtype.
    """

    def __init__(self, local: nn.Module, where: Placement, *, gather_output: bool = False):
        super().__init__(local, where)
        self.gather_output = gather_output
        self.in_features = local.in_features
        self.out_features = local.out_features * where.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return all_gather(y, self.where, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_output={self.gather_output}"


class RowParallel(_Sharded):
    """A linear layer whose input features are split over the ranks.

    local : this rank's columns: an ``nn.Linear`` or ``VQLinear`` with ``in_features / world_size``
        inputs, with the layer's bias on rank 0 only.
    reduce_results : all-reduce (sum) the partial outputs; False returns this rank's partial sum.

    ``x: [..., in_features / world_size]`` (this rank's slice, as a column-parallel layer leaves
    it) or ``[..., in_features]`` (sliced here) -> ``[..., out_features]``, x's dtype.
    """

    def __init__(self, local: nn.Module, where: Placement, *, reduce_results: bool = True):
        super().__init__(local, where)
        self.reduce_results = reduce_results
        self.in_features = local.in_features * where.world_size
        self.out_features = local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and x.shape[-1] == self.in_features:
            x = x[..., self.where.part(self.in_features)]
        y = self.local(x)
        return all_reduce_(y, self.where) if self.reduce_results else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reduce_results={self.reduce_results}"


class ParallelSwiGLUMLP(_Sharded):
    """``y = down_proj(silu(x Wg^T) * (x Wu^T))`` with the intermediate size split over the ranks.

    local : a :class:`~tilefuse.nn.FusedSwiGLUMLP` of ``intermediate_size / world_size``: this
        rank's gate rows and the matching up rows (the fused kernel runs on them as on any MLP),
        and the matching columns of ``down_proj`` (its bias on rank 0 only).
    reduce_results : all-reduce the partial outputs of ``down_proj`` (the MLP's one collective).

    ``x: [..., H]`` (the same on every rank) -> ``[..., H]``, x's dtype.
    """

    def __init__(self, local: nn.Module, where: Placement, *, reduce_results: bool = True):
        super().__init__(local, where)
        self.reduce_results = reduce_results
        self.hidden_size = local.hidden_size
        self.intermediate_size = local.intermediate_size * where.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return all_reduce_(y, self.where) if self.reduce_results else y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, reduce_results={self.reduce_results}")
