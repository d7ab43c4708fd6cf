"""Gluon building blocks shared by the families' Gluon kernels (the ``tl`` ones are in
``tl_common.py``; a Gluon kernel cannot call a ``@triton.jit`` function).

* :func:`grouped_tile` -- the grouped (L2-friendly) order of output tiles, the same order as
  ``tl_common.grouped_tile``, for the persistent SwiGLU kernels.
* :func:`slot_barriers` -- the ready / empty mbarrier pairs of a TMA ring of slots.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import fence_async_shared, mbarrier


@gluon.jit
def slot_barriers(STAGES: gl.constexpr, READERS: gl.constexpr):
    """(ready, empty): one mbarrier each per ring slot, initialized and fenced. ``ready[s]`` flips
    when the producer's TMA bytes for slot s have landed (one arrival: the producer's expect);
    ``empty[s]`` when its ``READERS`` consumer partitions have released it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=READERS)
    fence_async_shared()
    return ready, empty


@gluon.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of linear tile ``tile_id``: GROUP_M row tiles sweep the N tiles together, so
    a weight tile loaded by one program is still in L2 when the other GROUP_M - 1 need it."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile_id // group_size) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size) % rows
    pid_n = (tile_id % group_size) // rows
    return pid_m, pid_n
