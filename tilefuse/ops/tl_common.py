"""``tl`` building blocks shared by the families' Triton kernels.

* :func:`grouped_tile` -- the grouped (L2-friendly) order of output tiles, for the persistent
  SwiGLU kernel and the VQ prefill kernel.
* :func:`arrive` -- the split-K arrival: a program publishes its partial results, takes a ticket,
  and learns whether it is the last of its tile (the one that finishes it).
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile ``tile_id``: GROUP_M row-tiles sweep the N tiles together, so
    a weight tile loaded by one program is still in L2 when the other GROUP_M - 1 programs of its
    group need it."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile_id // group_size) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size) % rows
    pid_n = (tile_id % group_size) // rows
    return pid_m, pid_n


@triton.jit
def arrive(counter_ptr, count, expected):
    """Add ``count`` to the tile's counter after every thread's partial-result stores/atomics are
    issued (CTA barrier, then an acq_rel atomic: release of this program's partials, acquire of
    the others'). True for the program whose arrival completes ``expected``; that program reads
    the partials and must re-arm the counter to 0."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, count, sem="acq_rel") + count == expected
