"""Custom-op registration shared by the families.

Every public op is a ``torch.ops.tilefuse.<name>`` custom op with a fake (meta) implementation,
so ``torch.compile(fullgraph=True)`` sees through it and CUDA-graph capture works, and with a
backward formula (or a clear refusal) registered through ``torch.library.register_autograd``.
Eager calls that need no gradient skip the dispatcher and run the implementation directly: at
decode sizes a kernel takes a few microseconds and the dispatcher's host overhead is of the same
order (QuACK measured the same).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch


def tilefuse_op(name: str, *, fake: Callable, mutates_args: Sequence[str] = (),
                backward: Callable | None = None, setup_context: Callable | None = None):
    """Register the decorated function as ``torch.ops.tilefuse.<name>``.

    The decorated function must carry full type hints (torch infers the op schema from them).
    The returned callable goes through the registered op while ``torch.compile`` traces and when
    an input requires a gradient (so the registered ``backward`` applies), and calls the function
    directly otherwise; the op itself is reachable as ``<callable>.op``.
    """

    def decorate(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"tilefuse::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return op(*args)
            return fn(*args)

        call.op = op
        return call

    return decorate


def no_backward(op_name: str, what: str) -> Callable:
    """A backward that refuses clearly (ops without gradients, e.g. decode attention)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"{op_name}: {what} has no backward; call it under torch.no_grad() or "
                           f"torch.inference_mode(), or detach its inputs")

    return backward
