"""Kernel launches that cost what the launcher costs.

``kernel[grid](*args, **meta)`` spends tens of microseconds of Python per call in Triton 3.6: it binds
and specializes every argument, hashes the cache key, checks the kernel's globals and builds launch
metadata for profiling hooks. A decode step issues hundreds of launches, so that alone made eager
models slower than stock PyTorch.

:class:`Kernel` wraps a ``@triton.jit`` / ``@gluon.jit`` function. The first call with a given
*plan key* goes through the normal path (compiling if needed) and keeps the compiled kernel; later
calls with that key hand the arguments straight to the compiled kernel's C launcher. The caller's
key must pin everything Triton specializes on: the device, every constexpr, the dtype of every
tensor, which integer arguments equal 1 or are multiples of 16, and which pointers are 16-byte
aligned. The ops build it from their cached call plan (shapes, strides, dtypes, config) and the
pointers' alignment (:func:`aligned`, or ``data_ptr() % 16``).

Under ``TRITON_INTERPRET=1`` (CPU tests), or while a Triton launch hook is installed (profilers),
every call takes the normal path.

:func:`descriptor` makes the host TMA descriptors the TMA kernels take, cached by address and
geometry, so that the encoding the launcher needs (``cuTensorMapEncodeTiled``) is done once per
buffer rather than once per call.
"""

from __future__ import annotations

import functools
import importlib

import torch

from tilefuse import _env


def aligned(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """16-byte alignment of each tensor's data pointer (Triton specializes pointers on it)."""
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def specialized(*values: int) -> tuple[tuple[bool, bool], ...]:
    """How Triton specializes integer arguments (equal to 1, a multiple of 16), for compiled-kernel
    keys: two launches that differ here compile to different kernels."""
    return tuple((v == 1, v % 16 == 0) for v in values)


class Kernel:
    """A Triton or Gluon kernel launched through cached compiled handles.

    Call as ``kernel(key, grid, device_index, *args, **meta)`` (or :meth:`launch`, the hot path,
    with the arguments unexpanded): ``args`` are the kernel's leading (run-time) parameters in
    order, tensors first, ``meta`` its remaining parameters by name (constexprs) plus launch
    options (``num_warps``, ``num_stages``).
    """

    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(fn, "__name__", None) or getattr(fn, "_fn_name", repr(fn))
        self._compiled: dict = {}      # plan key -> (launch function, leading args, trailing args, descriptors)

    def __call__(self, key, grid, device_index: int | None, *args, **meta):
        """Convenience form: all run-time arguments positional, tensors first."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        split = next((i for i, a in enumerate(args) if not (a is None or hasattr(a, "data_ptr") or hasattr(a, "base"))),
                     len(args))
        self.launch(key, grid, device_index, args[:split], args[split:], meta)

    def launch(self, key, grid: tuple[int, int, int], device_index: int | None, tensors: tuple, scalars: tuple,
               meta: dict):
        """The hot path. ``grid`` has three entries; the kernel's leading parameters are
        ``tensors`` (tensors or None; tensor descriptors) then ``scalars``; ``meta`` holds the rest
        by name and is only read when ``key`` is new. Tensors go to the C launcher as raw device
        pointers (it would otherwise call ``data_ptr()`` and query the driver for each one: the
        op validated them when it planned the call)."""
        entry = self._compiled.get(key)
        if entry is None or _hooks_installed():
            self._first_launch(key, grid, device_index, (*tensors, *scalars), meta)
            return
        launch, head, tail, descriptors = entry
        if descriptors:
            pointers = []
            for i, t in enumerate(tensors):
                if i in descriptors:
                    pointers += _expanded(t, descriptors[i])
                else:
                    pointers.append(t.data_ptr() if isinstance(t, torch.Tensor) else t)
        else:
            pointers = [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in tensors]
        current = torch.cuda.current_device()
        if device_index is not None and device_index != current:
            with torch.cuda.device(device_index):
                launch(*grid, torch._C._cuda_getCurrentRawStream(device_index), *head, *pointers, *scalars, *tail)
            return
        launch(*grid, torch._C._cuda_getCurrentRawStream(current), *head, *pointers, *scalars, *tail)

    def _first_launch(self, key, grid, device_index, args, meta):
        if len(grid) != 3:   # the cached launcher takes exactly three; Triton's own path pads
            raise TypeError(f"{self.name}: launch grid must have 3 entries, got {grid!r}")
        if device_index is not None and torch.cuda.is_available() and device_index != torch.cuda.current_device():
            with torch.cuda.device(device_index):
                compiled = self.fn[grid](*args, **meta)
        else:
            compiled = self.fn[grid](*args, **meta)
        if _env.settings.interpret or compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        if len(self._compiled) >= 4096:   # one entry per shape: bound it for long-running servers
            self._compiled.clear()
        names = self.fn.arg_names[len(args):]
        missing = [n for n in names if n not in meta]
        if missing:  # pragma: no cover - a launcher bug, caught by the GPU tests
            raise TypeError(f"{self.name}: parameters {missing} must be passed by name")
        launch, head, descriptors = _launcher(compiled, args)
        self._compiled[key] = (launch, head, tuple(meta[n] for n in names), descriptors)

    def compiled(self, key) -> tuple | None:
        """``(launch, head, tail)`` of the kernel compiled for plan ``key``, for a caller that
        marshals the arguments itself (a layer that binds its weights' pointers once): the launch is
        ``launch(gx, gy, gz, raw_stream, *head, *pointers, *scalars, *tail)`` with the kernel's run-time
        arguments as :meth:`launch` orders them, tensors as raw pointers. None until a launch with
        ``key`` went through :meth:`launch`, for kernels that take TMA descriptors, in the
        interpreter, and while a launch hook is installed (the caller then takes :meth:`launch`)."""
        entry = self._compiled.get(key)
        if entry is None or entry[3] or _hooks_installed():
            return None
        return entry[0], entry[1], entry[2]

    def cache_clear(self) -> None:
        self._compiled.clear()


def _launcher(compiled, args: tuple) -> tuple:
    """(launch function, its arguments between the stream and the kernel's own, ``{position:
    metadata}`` of the TMA descriptor arguments it expects expanded) of a compiled kernel.

    Triton 3.6's CUDA launcher object allocates per-launch scratch first when the kernel asks for
    it; kernels that need none (all of tilefuse's) go to its C entry point directly. For kernels
    with TMA descriptor arguments that entry point is a Python wrapper that re-encodes every
    descriptor (``cuTensorMapEncodeTiled``) and walks every argument at each launch; the C function
    under it is called instead, with each descriptor's encoding made once (:func:`_expanded`)."""
    run = compiled.run
    hooks = (compiled.packed_metadata, None, None, None)     # launch metadata and hooks: none
    direct = getattr(run, "launch", None)
    if (direct is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *hooks)
        meta = getattr(compiled.metadata, "tensordesc_meta", None)
        positions = [i for i, a in enumerate(args) if type(a).__name__ == "TensorDescriptor"]
        inner = _wrapped_launch(direct) if positions and meta and len(meta) == len(positions) else None
        if inner is not None:
            return inner, head, dict(zip(positions, meta))
        return direct, head, {}
    return run, (compiled.function, *hooks), {}


def _wrapped_launch(wrapper):
    """The C launch function inside Triton's descriptor-expanding wrapper, or None."""
    for cell in getattr(wrapper, "__closure__", None) or ():
        fn = cell.cell_contents
        if type(fn).__name__ == "builtin_function_or_method" and getattr(fn, "__name__", "") == "launch":
            return fn
    return None


def _expanded(descriptor, meta: dict) -> list:
    """A host TMA descriptor as the C launcher takes it (the encoded ``CUtensorMap``, then the
    shape and strides), encoded on first use and kept on the descriptor object: the ops cache
    their descriptors per tensor address, so each is encoded once."""
    cached = descriptor.__dict__.get("_tilefuse_expanded")
    if cached is None or cached[0] is not meta:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        cached = (meta, make_tensordesc_arg(descriptor, meta))
        descriptor.__dict__["_tilefuse_expanded"] = cached
    return cached[1]


@functools.cache
def optional_kernel(module: str, name: str) -> Kernel | None:
    """:class:`Kernel` of ``module.name``, or None where the module cannot be imported (a Gluon
    kernel under a Triton without Gluon's Hopper module: the op then runs its ``tl`` kernel)."""
    try:
        return Kernel(getattr(importlib.import_module(module), name))
    except ImportError:
        return None


class Address:
    """A TMA descriptor's base: the address and dtype the launcher reads, without a reference
    that would keep a freed tensor alive in :func:`descriptor`'s table."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


_descriptors: dict = {}


def descriptor(t: torch.Tensor, shape, strides, block, gluon: bool = False, offset: int = 0):
    """A host TMA descriptor over ``t``'s memory from element ``offset``: ``shape`` / ``strides``
    (elements, last stride 1), ``block`` the box; ``gluon``: a Gluon descriptor with the default
    NVMMA shared layout of ``block`` in ``t``'s dtype, else a ``tl`` one. On a GPU the descriptor
    is cached by address, dtype and geometry (a buffer freed and another allocated at the same
    address with the same geometry maps to the same bytes, so a hit is always right) and its
    launcher encoding is made on first use (:func:`_expanded`); a caching allocator hands the same
    addresses back call after call, so activations hit too. A hit costs a dict lookup: the layout
    object (~13 us of Python to build) and the encoding are made on a miss only. In the
    interpreter the descriptor holds the tensor itself."""
    shape, strides, block = tuple(shape), tuple(strides), tuple(block)
    if not t.is_cuda:
        return _new_descriptor(t.reshape(-1)[offset:] if offset else t, shape, strides, block, gluon)
    address = t.data_ptr() + offset * t.element_size()
    key = (address, t.dtype, shape, strides, block, gluon)
    found = _descriptors.get(key)
    if found is None:
        if len(_descriptors) >= 4096:      # bounded for long-running servers
            _descriptors.clear()
        found = _descriptors[key] = _new_descriptor(Address(address, t.dtype), shape, strides, block, gluon)
    return found


def _new_descriptor(base, shape, strides, block, gluon: bool):
    if not gluon:
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(base, list(shape), list(strides), list(block))
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
               torch.float8_e4m3fn: gl.float8e4nv, torch.int16: gl.int16}[base.dtype]
    return TensorDescriptor(base, list(shape), list(strides), list(block),
                            gl.NVMMASharedLayout.get_default_for(list(block), element))


_runtime_knobs = None


def _hooks_installed() -> bool:
    """A profiler's launch hooks are installed (they need the normal path's launch metadata)."""
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    return bool(_runtime_knobs.launch_enter_hook.calls or _runtime_knobs.launch_exit_hook.calls)


def capture_graph(fn, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a CUDA graph of ``fn``, the output its replays write): ``fn`` runs ``warmup`` times on a
    side stream first (Triton compiles, workspaces and caches allocated outside the capture), then
    once under capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
