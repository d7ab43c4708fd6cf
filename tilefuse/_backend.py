"""Backend choice: which implementation a public op runs.

* ``triton``    -- the Triton kernels. The default for CUDA tensors. On CPU tensors it is only
  reachable with ``TRITON_INTERPRET=1`` set *before* tilefuse is imported (Triton decides at
  decoration time whether ``@triton.jit`` compiles or interprets); that is how CPU tests reach
  the kernels.
* ``reference`` -- the plain-PyTorch spec in ``tilefuse/ops/<family>/reference.py``. The default
  for tensors on any other device.

``TILEFUSE_BACKEND=reference|triton`` forces one for the whole process; :func:`force` does the
same for a block of code and can also pin a kernel *variant* (``"small_m"``, ``"transposed"``,
...), which the tests and the benchmark use to run each schedule explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

BACKENDS = ("triton", "reference")
ENV_VAR = "TILEFUSE_BACKEND"

_local = threading.local()


@functools.lru_cache(maxsize=None)
def triton_available() -> tuple[bool, str]:
    """(usable, why not) for the Triton backend on this machine."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return False, f"triton is not importable ({exc})"
    return True, ""


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, cpu_default: int = 4) -> int:
    """Multiprocessors of a CUDA ``device`` (cached: launchers size their grids from it on every
    call); ``cpu_default`` elsewhere, e.g. a few parts so interpreter tests exercise split paths."""
    if device.type != "cuda":
        return cpu_default
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def force(backend: str | None = None, variant: str | None = None):
    """Pin the backend and/or the kernel variant for ops called inside the block.

    >>> with tilefuse.force(variant="large_m"):
    ...     y = tilefuse.swiglu(x, w)
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    saved = getattr(_local, "backend", None), getattr(_local, "variant", None)
    _local.backend, _local.variant = backend or saved[0], variant or saved[1]
    try:
        yield
    finally:
        _local.backend, _local.variant = saved


def forced_variant() -> str | None:
    """The kernel variant pinned by :func:`force`, or None to let the op dispatch by shape."""
    return getattr(_local, "variant", None)


def choose_backend(device: torch.device) -> str:
    """The backend an op runs for tensors on ``device``."""
    backend = getattr(_local, "backend", None) or os.environ.get(ENV_VAR, "").strip().lower() or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{ENV_VAR}: expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    usable, why = triton_available()
    if backend == "triton":
        if not usable:
            raise RuntimeError(f"{ENV_VAR}=triton but {why}")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                f"importing tilefuse to interpret kernels on {device.type} tensors"
            )
        return "triton"
    return "triton" if device.type == "cuda" and usable else "reference"
