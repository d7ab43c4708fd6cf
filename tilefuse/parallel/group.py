"""Where a tensor-parallel module sits in its process group, and the two collectives it uses.

A :class:`Placement` is ``(group, rank, world_size)``. Built from a ``torch.distributed`` group
(the default group when ``group`` is None), or from an explicit ``rank`` and ``world_size``
(to cut shards without a running group, e.g. to save per-rank checkpoints; such a shard can run
its forward only where no collective is needed: ``world_size == 1``, or partial outputs that the
caller reduces). :func:`split` is the one place that checks that a world size divides a
dimension, so every module's error reads alike and names the argument.

The collectives are plain in-place ``torch.distributed`` calls: NCCL on CUDA tensors (capturable
in CUDA graphs once the communicator exists), gloo on CPU tensors. No host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Placement:
    """This rank's place in a tensor-parallel group.

    group : a ``torch.distributed`` ProcessGroup, or None for the default group.
    rank, world_size : this rank's index in the group and the group's size.
    """

    group: object | None
    rank: int
    world_size: int

    def part(self, size: int) -> slice:
        """This rank's slice of a dimension of ``size`` (a multiple of world_size) cut in equal parts."""
        step = size // self.world_size
        return slice(self.rank * step, (self.rank + 1) * step)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def placement(group=None, rank: int | None = None, world_size: int | None = None) -> Placement:
    """The :class:`Placement` of this process in ``group``.

    Without ``rank``/``world_size``: read from ``torch.distributed`` (rank 0 of 1 when no group is
    initialized). With them (both, or neither): used as given; where a group is initialized its
    size must equal ``world_size``.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank: expected rank and world_size given together or not at all, "
                         f"got rank={rank!r}, world_size={world_size!r}")
    running = dist.is_available() and dist.is_initialized()
    if rank is None:
        if running:
            return Placement(group, dist.get_rank(group), dist.get_world_size(group))
        return Placement(group, 0, 1)
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an integer in [0, world_size={world_size}), got {rank!r}")
    if running and world_size > 1 and dist.get_world_size(group) != world_size:
        raise ValueError(f"world_size: expected the size of the process group ({dist.get_world_size(group)}), "
                         f"got {world_size}")
    return Placement(group, rank, world_size)


def split(size: int, world_size: int, what: str, multiple: int = 1, why: str = "") -> int:
    """``size / world_size``, refusing a world size that does not cut ``size`` into equal parts
    (each a multiple of ``multiple``). ``what`` names the dimension (the argument, e.g.
    ``"num_heads"``); ``why`` says what each rank holds."""
    if size % (world_size * multiple):
        unit = f" parts that are multiples of {multiple}" if multiple > 1 else " equal parts"
        raise ValueError(f"world_size: expected a world size that cuts {what}={size} into{unit}"
                         f"{' (' + why + ')' if why else ''}, got {world_size}")
    return size // world_size


def _need_group(where: Placement, op: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"group: expected an initialized torch.distributed process group for the {op} over "
                         f"world_size={where.world_size} ranks, got none (call torch.distributed.init_process_group, "
                         f"or build the module with world_size=1)")


def all_reduce_(tensor: torch.Tensor, where: Placement) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place (no-op on one rank); returns it."""
    if where.world_size > 1:
        _need_group(where, "all-reduce")
        dist.all_reduce(tensor, group=where.group)
    return tensor


def all_gather(tensor: torch.Tensor, where: Placement, dim: int) -> torch.Tensor:
    """The ranks' ``tensor``s concatenated along ``dim`` in rank order (itself on one rank)."""
    if where.world_size == 1:
        return tensor
    _need_group(where, "all-gather")
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(where.world_size)]
    dist.all_gather(parts, tensor, group=where.group)
    return torch.cat(parts, dim=dim)


def model_placement(model) -> Placement | None:
    """The tensor-parallel group of ``model`` when it spans several ranks: that of its first module
    sharded by :mod:`tilefuse.parallel` (a ``where`` placement), else that of its first DTensor
    weight (a transformers ``tp_plan`` model); None for a one-device model."""
    for module in model.modules():
        where = getattr(module, "where", None)
        if isinstance(where, Placement) and where.world_size > 1:
            return where
    from tilefuse.parallel.hf import _dtensor_class, split_style

    dtensor = _dtensor_class()
    if dtensor is not None:
        for param in model.parameters():
            if isinstance(param, dtensor):
                where = split_style(param)[0]
                return where if where.world_size > 1 else None
    return None


def same_on_every_rank(model, value: int) -> int:
    """``value`` as rank 0 of ``model``'s tensor-parallel group has it (one broadcast, a host sync),
    or ``value`` for a one-device model: what every rank must agree on, such as a sampling seed
    drawn on each (the ranks decode one sequence together, so their tokens must not part)."""
    where = model_placement(model)
    if where is None:
        return value
    _need_group(where, "broadcast")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(where.group) == "nccl" \
        else torch.device("cpu")
    held = torch.tensor([value], dtype=torch.int64, device=device)
    root = dist.get_global_rank(where.group, 0) if where.group is not None else 0
    dist.broadcast(held, src=root, group=where.group)
    return int(held.item())
