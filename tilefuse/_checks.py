"""Argument validation shared by the public ops.

Every check raises ``ValueError`` naming the argument, what was expected and what was given, so
bad input fails in Python before any kernel launches (never a CUDA fault or a wrong answer).
Checks only read metadata (dtype, shape, strides, device), so they are safe under
``torch.compile`` tracing and CUDA-graph capture; the ops run them once per argument layout (the
call plans of ``tilefuse._library``), so an eager call pays a dictionary lookup, not the checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT16S = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, value, *, dtypes: Sequence[torch.dtype] | None = None,
                 ndim: int | None = None, min_ndim: int | None = None) -> torch.Tensor:
    """``value`` is a tensor with one of ``dtypes`` and the given rank."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if type(value).__name__ == "DTensor":   # its data pointer is the local shard's, its shape the global one
        raise ValueError(f"{name}: expected a local tensor, got a DTensor of global shape {tuple(value.shape)} "
                         f"(pass .to_local() shards, or build tensor-parallel modules with tilefuse.parallel)")
    if dtypes is not None and value.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {_fmt_dtypes([value.dtype])}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def check_shape(name: str, value: torch.Tensor, expected: Sequence[int | None], what: str = "") -> None:
    """``value.shape`` equals ``expected``; ``None`` entries match any size.

    ``what`` spells the expected shape symbolically, e.g. ``"[2I, H]"``.
    """
    shape = tuple(value.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        want = what or "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {shape}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors live on one device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (like {items[0][0]}), got {t.device}")
    return device


def check_contiguous(name: str, value: torch.Tensor, *, last_dim_only: bool = False) -> None:
    """Row-major layout (or unit stride in the last dimension only)."""
    ok = value.stride(-1) == 1 if last_dim_only else value.is_contiguous()
    if not ok:
        kind = "unit stride in the last dimension" if last_dim_only else "a contiguous tensor"
        raise ValueError(f"{name}: expected {kind}, got strides {tuple(value.stride())}")


def check_multiple(name: str, size: int, multiple: int, what: str) -> None:
    """``size`` (the dimension ``what`` of ``name``) is a multiple of ``multiple``."""
    if size % multiple:
        raise ValueError(f"{name}: expected {what} to be a multiple of {multiple}, got {size}")


def check_choice(name: str, value, choices: Sequence) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def check_float(name: str, value, *, positive: bool = False) -> float:
    """A finite real number (``positive``: > 0); returns it as a Python float."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a finite number, got {value!r}") from None
    if isinstance(value, (bool, str)) or number != number or number in (float("inf"), float("-inf")) \
            or (positive and number <= 0):
        raise ValueError(f"{name}: expected a finite{' positive' if positive else ''} number, got {value!r}")
    return number


def contents_unreadable(*tensors) -> bool:
    """Whether the values of ``tensors`` cannot be read back: while ``torch.compile`` traces (a
    read would be a data-dependent guard), or for meta and fake tensors (shapes only). The ops skip
    their content checks then (``check_contents=True`` / ``TILEFUSE_DEBUG``), and meta / fake
    inputs get the outputs' shapes from the ops' fake implementations."""
    if torch.compiler.is_compiling():
        return True
    functional = torch._is_functional_tensor
    for t in tensors:
        # a plain tensor that is not meta and not a functional wrapper holds real values: the
        # common case answered first, without is_fake (it cost ~3 us a tensor on a decode step's path)
        if type(t) is torch.Tensor and not t.is_meta and not functional(t):
            continue
        if isinstance(t, torch.Tensor) and (t.is_meta or _is_fake(t)):
            return True
    return False


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - a torch without it
        return False
    return is_fake(t)
