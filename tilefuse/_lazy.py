"""Package attributes imported on first use, so ``import tilefuse`` (and its subpackages) stays
cheap and side-effect free."""

from __future__ import annotations

import importlib
import sys


def lazy_attribute(package: str, public: dict[str, str], name: str):
    """The package attribute ``name`` that ``public`` maps to a module: that module itself where it
    is ``package.name`` (a subpackage), else its attribute ``name``. A package's
    ``__getattr__(name)`` returns this. The value is then set on the package, so later lookups
    (``tilefuse.swiglu(...)`` in a decode loop) are plain attribute reads, not an import call."""
    if name not in public:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(public[name])
    value = module if module.__name__ == f"{package}.{name}" else getattr(module, name)
    setattr(sys.modules[package], name, value)
    return value
