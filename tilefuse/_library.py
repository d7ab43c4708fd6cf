"""Custom-op registration shared by the families.

Every public op is a ``torch.ops.tilefuse.<name>`` custom op with a fake (meta) implementation,
so ``torch.compile(fullgraph=True)`` sees through it and CUDA-graph capture works, and with a
backward formula (or a clear refusal) registered through ``torch.library.register_autograd``.
Eager calls that need no gradient skip the dispatcher and run the implementation directly: at
decode sizes a kernel takes a few microseconds and the dispatcher's host overhead is of the same
order (QuACK measured the same).

Each op caches a *call plan* per argument layout (:class:`PlanCache`, keyed by :func:`plan_key`):
the validation, the backend, the kernel variant, its config, grid and scalar arguments, computed
once; an eager call then costs a dictionary lookup, the output allocation and the launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def tilefuse_op(name: str, *, fake: Callable, mutates_args: Sequence[str] = (),
                backward: Callable | None = None, setup_context: Callable | None = None):
    """Register the decorated function as ``torch.ops.tilefuse.<name>`` and return the op.

    The decorated function must carry full type hints (torch infers the op schema from them).
    The public functions call the op only when :func:`use_dispatcher` says so, and their
    implementation directly otherwise.
    """

    def decorate(fn: Callable):
        op = torch.library.custom_op(f"tilefuse::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return decorate


def use_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through the registered op: while ``torch.compile`` traces, and when
    an input requires a gradient (so the registered backward applies)."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def plan_key(*tensors: torch.Tensor | None):
    """The layout of the tensor arguments (class, shape, dtype, device, strides) plus the thread's
    ``force()`` state: what an op's cached call plan depends on. None for non-tensors (the op
    then validates from scratch and raises). The class keeps a tensor subclass (a DTensor shard)
    from reusing a plain tensor's plan without being validated."""
    from tilefuse._backend import forced_state

    try:
        # (a list comprehension, not a generator: ~1 us less per call on a decode step's path)
        return tuple([None if t is None else (type(t), t.shape, t.dtype, t.device, t.stride()) for t in tensors]) \
            + forced_state()
    except (AttributeError, TypeError):
        return None


class PlanCache(dict):
    """An op's call plans by :func:`plan_key` (bounded: cleared when full)."""

    limit = 4096

    def remember(self, key, plan):
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = plan
        return plan


def no_backward(op_name: str, what: str) -> Callable:
    """A backward that refuses clearly (ops without gradients, e.g. decode attention)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"{op_name}: {what} has no backward; call it under torch.no_grad() or "
                           f"torch.inference_mode(), or detach its inputs")

    return backward
