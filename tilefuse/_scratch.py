"""Scratch memory for the kernels' split-K fix-ups, safe under any interleaving of launches.

Some kernels need memory that is zero when they start: fp32 partial sums that programs add into
with atomics, and arrival counters (the last program of a tile to arrive finishes it). Every such
kernel leaves the memory it used at zero when it ends (the finishing program re-arms it), so the
next launch that runs *after* it may reuse it without a zeroing launch. Reuse is safe only in that
order, so scratch is handed out by this rule (the concurrency contract of every op):

* Eager calls: one arena per (device, CUDA stream). Work on one stream runs in order, so every
  launch on that stream may share the arena whatever its shape; launches on other streams, other
  threads' streams or other devices never touch it. When an arena grows, the old one goes back to
  PyTorch's caching allocator, which hands that memory out again only to later work on the same
  stream.
* During CUDA-graph capture: every captured call gets memory of its own, kept for the life of the
  process (a graph may be replayed at any time and on any stream; CUDA orders the replays of one
  graph). It is carved from a reserve that eager calls zero ahead of time (``torch.cuda.graph``
  synchronizes the device before capturing). If the reserve runs out during a capture, the call's
  piece is zero-filled inside the graph (one memset node per replay: correct, slightly slower),
  and the next eager call on that device enlarges the reserve.

:func:`workspace` hands out memory with any contents (partial results a launch writes before it
reads them) by the same rule, without the zeroing. Nothing here reads the device: no host sync.

cuBLAS calls (the unfused paths' GEMMs, ``torch._scaled_mm``, the reference on a GPU) go through
:func:`blas`, which gives them the same guarantee for cuBLAS's own workspace; see its docstring.
"""

from __future__ import annotations

import threading

import torch

ALIGN = 256                       # bytes: every piece starts 256-byte aligned
RESERVE_BYTES = 4 << 20           # the first reserve per device; later ones are sized by demand

_lock = threading.Lock()
_arenas: dict[tuple[int, int, bool], torch.Tensor] = {}  # (device index, raw stream, zeroed) -> uint8 arena
_reserves: dict[int, list] = {}                        # device index -> [slab, next free offset]
_kept: list[torch.Tensor] = []                         # slabs handed to captured calls (never freed)
_shortfall: dict[int, int] = {}                        # device index -> bytes a capture lacked


def _round(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


_views: dict = {}     # (device index, stream, sizes, zeroed) -> views (eager calls)


def zeroed(device: torch.device, *sizes: tuple[int, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Zeroed 1-D tensors of ``(numel, dtype)`` each, on ``device``, under the contract above.

    The kernel that receives them must leave them zero when it ends. Eager calls get the same
    views for the same stream and sizes (cached: a lookup, no tensor ops on the hot path).
    """
    return _hand_out(device, sizes, zero=True)


def workspace(device: torch.device, *sizes: tuple[int, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """1-D tensors of ``(numel, dtype)`` with any contents (a kernel writes before it reads them),
    under the same contract as :func:`zeroed`: one arena per (device, stream) for eager calls,
    cached views; fresh memory per captured call (the graph's pool)."""
    return _hand_out(device, sizes, zero=False)


def _hand_out(device: torch.device, sizes, zero: bool) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.is_current_stream_capturing():
            return _carve(_capture_piece(device, index, _total(sizes), zero), sizes)
        stream = torch._C._cuda_getCurrentRawStream(index)
    else:                           # the CPU interpreter: no streams, no graphs
        index = stream = -1
    key = (index, stream, sizes, zero)
    views = _views.get(key)
    if views is None:
        if zero and index >= 0 and (index in _shortfall or index not in _reserves):
            _top_up_reserve(device, index)
        if len(_views) >= 4096:
            _views.clear()
        # the views keep their arena alive if it is replaced later: still this stream's (and zero)
        views = _views[key] = _carve(_arena(device, index, stream, _total(sizes), zero), sizes)
    return views


def _total(sizes) -> int:
    return max(sum(_round(n * dtype.itemsize) for n, dtype in sizes), ALIGN)


def _carve(buf: torch.Tensor, sizes) -> tuple[torch.Tensor, ...]:
    out, offset = [], 0
    for n, dtype in sizes:
        out.append(buf[offset:offset + n * dtype.itemsize].view(dtype))
        offset += _round(n * dtype.itemsize)
    return tuple(out)


def _arena(device: torch.device, index: int, stream: int, nbytes: int, zero: bool) -> torch.Tensor:
    key = (index, stream, zero)
    buf = _arenas.get(key)
    if buf is None or buf.numel() < nbytes:
        # grown geometrically; a zeroed arena is zeroed once here and kept zero by the kernels
        size = max(nbytes, 2 * buf.numel() if buf is not None else 0, 64 << 10)
        buf = _arenas[key] = (torch.zeros if zero else torch.empty)(size, dtype=torch.uint8, device=device)
    return buf


def _top_up_reserve(device: torch.device, index: int) -> None:
    with _lock:
        need = max(RESERVE_BYTES, 2 * _shortfall.pop(index, 0))
        slab = _reserves.get(index)
        if slab is not None and slab[0].numel() - slab[1] >= need:
            return
        if slab is not None:
            _kept.append(slab[0])          # pieces of it belong to captured graphs
        _reserves[index] = [torch.zeros(need, dtype=torch.uint8, device=device), 0]


def _capture_piece(device: torch.device, index: int, nbytes: int, zero: bool) -> torch.Tensor:
    if zero:
        with _lock:
            slab = _reserves.get(index)
            if slab is not None and slab[0].numel() - slab[1] >= nbytes:
                piece = slab[0][slab[1]:slab[1] + nbytes]
                slab[1] += nbytes
                return piece
            _shortfall[index] = _shortfall.get(index, 0) + nbytes
            _views.clear()          # the next eager call takes the slow path and enlarges the reserve
    # the graph's pool; zeroed: zero-filled per replay (the reserve ran out)
    piece = (torch.zeros if zero else torch.empty)(nbytes, dtype=torch.uint8, device=device)
    _kept.append(piece)
    return piece


# ----------------------------------------------------------------------------- cuBLAS
def blas(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` -- a call that runs cuBLAS or cuBLASLt (``F.linear``, ``torch.mm``,
    ``torch._scaled_mm``, a matmul in a reference) -- under the contract above.

    PyTorch gives cuBLAS a workspace per (cuBLAS handle, stream), kept between calls. Eager calls
    are safe under that rule (one stream runs in order), but a graph keeps the workspace address
    it was captured with, and ``torch.cuda.graph`` captures every graph on one shared stream
    unless told otherwise: two graphs captured by one thread then hold the same workspace, and
    replaying them at once on two streams lets their split-K GEMMs overwrite each other's partial
    sums (wrong outputs, no error). So while a capture is under way, this drops PyTorch's cached
    cuBLAS workspaces (``torch._C._cuda_clearCublasWorkspaces``, as ``torch.compile``'s CUDA-graph
    trees do around a recording) before the call, so the call allocates a fresh one on the
    capturing stream, i.e. from the graph's private memory pool, and again after it, so no later
    call (of this graph or another) reuses that address through the cache. Memory: one cuBLAS
    workspace (32 MiB on Hopper by default, ``CUBLAS_WORKSPACE_CONFIG``) per captured graph that
    runs such a call, in the graph's pool: later calls in the same capture take the freed block
    again (in stream order), and it is released with the graph. The drop is process-wide: an eager
    cuBLAS call on another stream at that moment keeps its workspace for the launch under way (the
    block goes back to that stream's free memory, reused only by work queued after it) and
    allocates a new one on its next call. Graphs that share a pool (``pool=``)
    share it, as they share all their memory (PyTorch allows that only for graphs replayed one
    after the other). Eager calls pay one capture-status query; after a capture they re-create
    their per-stream workspaces once. While ``torch.compile`` traces, ``fn`` is traced as it is
    (Inductor's CUDA-graph trees drop the cached workspaces around each recording). No host sync.
    """
    if not torch.compiler.is_compiling() and _capturing(args):
        _drop_cublas_workspaces()
        try:
            return fn(*args, **kwargs)
        finally:
            _drop_cublas_workspaces()
    return fn(*args, **kwargs)


def _capturing(args) -> bool:
    """A CUDA graph is being captured on the current stream of the first tensor argument's device."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.is_cuda and torch.cuda.is_current_stream_capturing()
    return False


def _drop_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
