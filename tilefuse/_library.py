"""Custom-op registration shared by the families.

Every public op is a ``torch.ops.tilefuse.<name>`` custom op with a fake (meta) implementation,
so ``torch.compile(fullgraph=True)`` sees through it and CUDA-graph capture works. Eager calls
skip the dispatcher and run the implementation directly: at decode sizes a kernel takes a few
microseconds and the dispatcher's host overhead is of the same order (QuACK measured the same).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch


def tilefuse_op(name: str, *, fake: Callable, mutates_args: Sequence[str] = ()):
    """Register the decorated function as ``torch.ops.tilefuse.<name>``.

    The decorated function must carry full type hints (torch infers the op schema from them).
    The returned callable goes through the registered op while ``torch.compile`` traces and calls
    the function directly otherwise; the op itself is reachable as ``<callable>.op``.
    """

    def decorate(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"tilefuse::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            return fn(*args)

        call.op = op
        return call

    return decorate
