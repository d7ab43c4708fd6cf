"""Backend choice: which implementation a public op runs.

* ``triton``    -- the Triton / Gluon kernels. The default for CUDA tensors of a dtype the kernels
  take (each op says which). On CPU tensors it is only reachable with ``TRITON_INTERPRET=1`` set
  *before* tilefuse is imported (Triton decides at decoration time whether ``@triton.jit``
  compiles or interprets); that is how the CPU tests reach the kernels.
* ``reference`` -- the plain-PyTorch spec in ``tilefuse/ops/<family>/reference.py``. The default
  for tensors on any other device.

``TILEFUSE_BACKEND=reference|triton`` (read once, ``tilefuse._env``) forces one for the whole
process; :func:`force` does the same for a block of code and can also pin a kernel *variant*
(``"small_m"``, ``"transposed"``, ...), which the tests and the benchmark use to run each schedule
explicitly. A pinned variant applies to the family that has it; the other families dispatch as usual.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from tilefuse import _env
from tilefuse._registry import FAMILIES

BACKENDS = _env.BACKENDS
# Kernel variants of each family (the ops dispatch among these; force() accepts any of them).
VARIANTS = {name: family.variants for name, family in FAMILIES.items()}
_ALL_VARIANTS = tuple(dict.fromkeys(v for family in VARIANTS.values() for v in family))

class _Forced(threading.local):
    """This thread's :func:`force` pins, ``(backend, variant, family)``. A class-level default:
    reading an unset attribute of a plain ``threading.local`` through ``getattr(..., default)``
    raises and catches an exception, about 1 us on every op call (the plan keys read it)."""

    state: tuple[str | None, str | None, str | None] = (None, None, None)


_local = _Forced()


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


@functools.lru_cache(maxsize=None)
def gluon_hopper(device: torch.device) -> bool:
    """The Gluon Hopper kernels can run on ``device``: an sm_90 GPU (TMA, WGMMA), kernels compiled
    rather than interpreted. (Each op also needs its Gluon kernel importable: ``_launch.optional_kernel``.)"""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] == 9


def tl_status(device: torch.device, min_major: int, need: str) -> str:
    """"ok" where a family's ``tl`` kernels run on ``device`` (a GPU of compute capability
    ``min_major`` or above, whose feature ``need`` names; or the interpreter), else why not."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return "ok" if major >= min_major else f"needs sm_{min_major}0+ ({need}), this GPU is sm_{major}{minor}"
    if interpreting():
        return "ok (Triton interpreter)"
    return "CPU: reference path (set TRITON_INTERPRET=1 to interpret the kernels)"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _env.settings.interpret


@contextlib.contextmanager
def force(backend: str | None = None, variant: str | None = None, family: str | None = None):
    """Pin the backend and/or a kernel variant for ops called inside the block. A variant name two
    families share (``"decode"``: vq and swiglu_fp8) pins it in both, unless ``family`` names one.

    >>> with tilefuse.force(variant="large_m"):
    ...     y = tilefuse.swiglu(x, w)
    >>> with tilefuse.force(variant="decode", family="vq"):
    ...     y = tilefuse.vq_matmul(x, codes, codebooks, scales)
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if family is not None and family not in VARIANTS:
        raise ValueError(f"family: expected one of {tuple(VARIANTS)}, got {family!r}")
    allowed = VARIANTS[family] if family is not None else _ALL_VARIANTS
    if variant is not None and variant not in allowed:
        raise ValueError(f"variant: expected one of {allowed}, got {variant!r}")
    saved = _local.state
    pinned = (variant, family) if variant is not None else saved[1:]
    _local.state = (backend or saved[0], *pinned)
    try:
        yield
    finally:
        _local.state = saved


def forced_variant(family: str) -> str | None:
    """The variant of ``family`` pinned by :func:`force`, or None to let the op dispatch by shape."""
    _, variant, pinned_family = _local.state
    if pinned_family is not None and pinned_family != family:
        return None
    return variant if variant in VARIANTS[family] else None


def forced_state() -> tuple[str | None, str | None, str | None]:
    """(backend, variant, family) pinned by :func:`force` on this thread: part of the ops' plan keys."""
    return _local.state


def choose_backend(device: torch.device) -> str:
    """The backend an op runs for tensors on ``device``."""
    backend = _local.state[0] or _env.settings.backend
    if backend == "reference":
        return "reference"
    if backend == "triton":
        usable, why = triton_available()
        if not usable:
            raise RuntimeError(f"TILEFUSE_BACKEND=triton but {why}")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"TILEFUSE_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                f"importing tilefuse to interpret kernels on {device.type} tensors"
            )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available()[0] else "reference"


def check_interpretable(name: str, dtype: torch.dtype) -> None:
    """Refuse bf16 in Triton's CPU interpreter, which multiplies bf16 ``tl.dot`` operands as raw
    16-bit integers (garbage results): fp16 and fp32 are interpreted correctly."""
    if dtype == torch.bfloat16 and interpreting():
        raise ValueError(f"{name}: bfloat16 is not supported in Triton's CPU interpreter (TRITON_INTERPRET=1 "
                         f"computes bf16 tl.dot wrongly); use float16 or float32, or the reference backend")
