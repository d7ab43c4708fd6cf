"""Gluon building blocks shared by the families' Gluon kernels (the ``tl`` ones are in
``tl_common.py``; a Gluon kernel cannot call a ``@triton.jit`` function).

* :func:`grouped_tile` -- the grouped (L2-friendly) order of output tiles, the same order as
  ``tl_common.grouped_tile``, for the persistent SwiGLU kernels.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
