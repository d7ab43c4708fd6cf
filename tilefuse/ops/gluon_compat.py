"""The one place where Gluon's API differences between Triton releases are bridged.

tilefuse supports Triton 3.6 through 3.9 (``pyproject.toml`` pins the range). Gluon is
experimental and renames things between minor releases; every Gluon kernel imports the Hopper
primitives from here rather than from Triton, so a rename is handled once:

* ``tma_load(desc, coord, barrier, result, pred=True)`` -- TMA copy global -> shared that
  signals ``barrier``: ``tma.async_load`` from Triton 3.7 (3.9 removed the old name),
  ``tma.async_copy_global_to_shared`` before.
* ``tma_store(desc, coord, src)`` -- TMA copy shared -> global: ``tma.async_store`` from 3.7,
  ``tma.async_copy_shared_to_global`` before.

Both names are Triton builtins themselves (not wrappers), so a ``@gluon.jit`` kernel calls them as
it would call Triton's own.
"""

from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

__all__ = ["fence_async_shared", "mbarrier", "tma", "tma_load", "tma_store", "warpgroup_mma", "warpgroup_mma_wait"]
