"""The one place where Gluon's API differences between Triton releases are bridged.

tilefuse supports Triton 3.6 through 3.9 (``pyproject.toml`` pins the range). Gluon is
experimental and renames things between minor releases; every Gluon kernel imports the Hopper
primitives from here rather than from Triton, so a rename is handled once:

* ``tma_load(desc, coord, barrier, result, pred=True)`` -- TMA copy global -> shared that
  signals ``barrier``: ``tma.async_load`` from Triton 3.8 (3.9 removed the old name),
  ``tma.async_copy_global_to_shared`` before.
* ``tma_store(desc, coord, src)`` -- TMA copy shared -> global: ``tma.async_store`` from 3.8,
  ``tma.async_copy_shared_to_global`` before.
* ``cp_async(smem, pointer, mask=None)`` -- cp.async copy global -> shared of a pointer tensor
  (gathers): ``async_copy.async_load`` from 3.9, ``async_copy_global_to_shared`` before; with
  ``cp_commit()`` / ``cp_wait(n)`` (``commit_group`` / ``wait_group``, the same in every release).
* ``thread_barrier()`` -- a barrier of the program's threads (``bar.sync``): ``gl.barrier`` from
  3.7, ``gl.thread_barrier`` before.
* ``smem_reinterpret(smem, dtype, shape, layout)`` -- the same shared-memory bytes viewed with
  another dtype, shape or layout: the descriptor's ``reinterpret`` from 3.9, ``_reinterpret``
  before.

Each is a Triton builtin (Triton's own, or a ``@builtin`` here), so a ``@gluon.jit`` kernel calls
it as it would call Triton's.
"""

from triton.experimental.gluon import language as gl
from triton.language.core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
cp_commit = async_copy.commit_group
cp_wait = async_copy.wait_group


@builtin
def smem_reinterpret(smem, dtype, shape, layout, _semantic=None):
    view = getattr(smem, "reinterpret", None) or smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)

__all__ = ["cp_async", "cp_commit", "cp_wait", "fence_async_shared", "mbarrier", "tma", "tma_load", "tma_store",
           "smem_reinterpret", "thread_barrier", "warpgroup_mma", "warpgroup_mma_wait"]
