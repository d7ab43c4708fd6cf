"""nn modules built on the ops; each family's module is imported on first use."""

import importlib

_PUBLIC = {
    "FusedSwiGLUMLP": "tilefuse.nn.swiglu",
    "VQLinear": "tilefuse.nn.vq",
    "MLADecodeAttention": "tilefuse.nn.mla",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tilefuse.nn' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
