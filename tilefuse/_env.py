"""Every environment variable tilefuse reads, read once.

| variable | values | effect |
|---|---|---|
| ``TILEFUSE_BACKEND`` | ``triton``, ``reference`` | force one backend for the whole process (default: the Triton kernels on CUDA tensors, the PyTorch reference elsewhere) |
| ``TILEFUSE_DEBUG`` | ``0`` / ``1`` | checks that read tensor *contents* back to the host (a sync per call): code ranges, block-table pages, MLA metadata against the lengths; off by default |
| ``TILEFUSE_CONFIGS`` | path to a JSON file | launch-config overrides, one section per family (``{"swiglu": ..., "mla": ..., "vq": ...}``, formats in each family's ``configs.py``); used by tuning runs |
| ``TILEFUSE_FLASHMLA`` | ``label=path[,label=path]`` | ``tilefuse bench mla``: FlashMLA builds to time beside tilefuse, each a folder holding a built ``flash_mla`` package (default: ``import flash_mla`` if installed) |
| ``TRITON_INTERPRET`` | ``0`` / ``1`` | Triton's own: run ``@triton.jit`` kernels in its CPU interpreter; must be set before tilefuse is imported |

The values are read when this module is first imported; :func:`reload` reads them again (tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

VARIABLES = ("TILEFUSE_BACKEND", "TILEFUSE_DEBUG", "TILEFUSE_CONFIGS", "TILEFUSE_FLASHMLA", "TRITON_INTERPRET")
BACKENDS = ("triton", "reference")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip() not in ("", "0")


@dataclass(frozen=True)
class Settings:
    backend: str | None = None              # TILEFUSE_BACKEND, validated
    debug: bool = False                     # TILEFUSE_DEBUG
    configs: dict = field(default_factory=dict)   # TILEFUSE_CONFIGS, parsed
    interpret: bool = False                 # TRITON_INTERPRET
    flashmla: tuple = ()                    # TILEFUSE_FLASHMLA, ((label, path), ...)


def _read() -> Settings:
    backend = os.environ.get("TILEFUSE_BACKEND", "").strip().lower() or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"TILEFUSE_BACKEND: expected one of {BACKENDS}, got {backend!r}")
    configs: dict = {}
    path = os.environ.get("TILEFUSE_CONFIGS", "").strip()
    if path:
        try:
            configs = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"TILEFUSE_CONFIGS: expected a readable JSON file, got {path!r} ({exc})") from exc
        if not isinstance(configs, dict):
            raise ValueError(f"TILEFUSE_CONFIGS: expected a JSON object {{family: section}}, got {type(configs).__name__}")
    flashmla = []
    for item in filter(None, os.environ.get("TILEFUSE_FLASHMLA", "").split(",")):
        label, sep, folder = item.partition("=")
        if not sep or not label.strip() or not folder.strip():
            raise ValueError(f"TILEFUSE_FLASHMLA: expected label=path[,label=path], got {item!r}")
        flashmla.append((label.strip(), folder.strip()))
    return Settings(backend=backend, debug=_flag("TILEFUSE_DEBUG"), configs=configs,
                    interpret=_flag("TRITON_INTERPRET"), flashmla=tuple(flashmla))


settings = _read()


def reload() -> Settings:
    """Read the variables again (the families' config tables re-apply their overrides lazily)."""
    global settings
    settings = _read()
    return settings


def active() -> dict[str, str]:
    """The variables set in this process (for result files)."""
    return {name: os.environ[name] for name in VARIABLES if name in os.environ}
