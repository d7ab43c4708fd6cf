"""Minimal Gluon kernels that tell ``compute-sanitizer --tool racecheck`` artifacts from races.

racecheck reports hazards in tilefuse's warp-specialized kernels (the VQ prefill's
``vq_prefill_ws_kernel``, the MLA decode's cross-warpgroup hand-offs). Each pattern is reduced
here to a kernel with nothing else in it:

* ``no_shared`` -- ``gl.warp_specialize`` with two partitions that share no data at all: each
  stores its own thread indices to global memory. A hazard reported here comes from Triton's
  warp-specialization entry itself (the state it hands to the partitions), not from user code.
* ``handoff`` -- the MLA pattern: the default partition (4 warps) stores a tile to shared memory,
  syncs its own threads (``bar.sync``), then arrives on an mbarrier (one thread, release); the
  worker (4 warps) waits on the mbarrier (acquire) and only then loads the tile. Ordered by the
  PTX memory model: a hazard reported here is the tool not following the mbarrier.
* ``handoff_racy`` -- the same without the worker's wait: a real race, which racecheck must
  report (the control that shows the tool sees races of this shape at all).

Run one case (what ``tests/test_racecheck.py`` does under the sanitizer)::

    compute-sanitizer --tool racecheck python3 -m tilefuse.testing.racecheck handoff

The process exits 1 if the kernel's output is wrong (``handoff_racy`` may or may not be).
"""

from __future__ import annotations

import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import fence_async_shared, mbarrier, thread_barrier

CASES = ("no_shared", "handoff", "handoff_racy")
TILE = gl.constexpr(128)


@gluon.jit
def _store_indices(out_ptr, BASE: gl.constexpr, WARPS: gl.constexpr):
    """out[BASE + t] = BASE + t for each of the partition's 32 * WARPS threads t."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs = gl.arange(0, 32 * WARPS, layout=layout)
    gl.store(out_ptr + BASE + offs, (BASE + offs).to(gl.float32))


@gluon.jit
def ws_no_shared_kernel(out_ptr):
    """Two partitions (4 warps, then 1) that share nothing: out[0:160] = 0..159."""
    gl.warp_specialize([(_store_indices, (out_ptr, 0, 4)), (_store_indices, (out_ptr, 128, 1))], [1], [40])


@gluon.jit
def _write_tile(tile, ready):
    """Default partition: tile (shared) = 0..127, then its 128 threads sync and one arrives."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    tile.store(gl.arange(0, TILE, layout=layout).to(gl.float32))
    thread_barrier()                 # every thread's store is issued before the arrival
    mbarrier.arrive(ready)           # release: one arrival completes the phase


@gluon.jit
def _read_tile(tile, ready, out_ptr, WAIT: gl.constexpr):
    """Worker: wait for the tile (acquire), then out[0:128] = tile."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if WAIT:
        mbarrier.wait(ready, 0)
    offs = gl.arange(0, TILE, layout=layout)
    gl.store(out_ptr + offs, tile.load(layout))


@gluon.jit
def ws_handoff_kernel(out_ptr, WAIT: gl.constexpr):
    """A 128-value tile handed from the default partition to a worker through shared memory and an
    mbarrier (``WAIT=False``: the worker does not wait, a real race)."""
    tile = gl.allocate_shared_memory(gl.float32, [TILE], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    fence_async_shared()
    gl.warp_specialize([(_write_tile, (tile, ready)), (_read_tile, (tile, ready, out_ptr, WAIT))],
                       [4], [128])


def run(case: str) -> bool:
    """Launch ``case`` once on the GPU; True if its output is what the kernel promises."""
    import torch

    if case not in CASES:
        raise ValueError(f"case: expected one of {CASES}, got {case!r}")
    out = torch.full((160,), float("nan"), device="cuda")
    if case == "no_shared":
        ws_no_shared_kernel[(1,)](out, num_warps=4)
        want = torch.arange(160, device="cuda", dtype=torch.float32)
    else:
        ws_handoff_kernel[(1,)](out, WAIT=case == "handoff", num_warps=4)
        out, want = out[:128], torch.arange(128, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    return bool(torch.equal(out, want))


if __name__ == "__main__":
    ok = run(sys.argv[1])
    print(f"{sys.argv[1]}: output {'right' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)
