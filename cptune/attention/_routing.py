"""How SDPA calls inside a block reach its attention: the patched ``F.scaled_dot_product_attention``,
a torch-function mode for references bound before the block, and the rule on threads.

What holds: one block per process at a time (a second is refused when it opens), and attention
inside it runs on the block's own thread. ``F.scaled_dot_product_attention`` is patched for the
whole process while the block is open, so a call from another thread (a data-loader worker, a
second model served beside training) would be routed to this block's ring: it is refused with
the fix instead. Autograd's own threads are fine: a backward pass that recomputes an activation
checkpoint calls SDPA from them, and that recompute belongs to the block.

A :class:`Route` carries the block's :class:`~._attend.Setup`; calls go straight to
:func:`~._attend.attend` with it (the block swaps the setup in, never is called back).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_cp
from ..errors import CPTuneError, Problem, ValidationError, raise_if
from ._attend import Setup, attend
from ._hooks import backward_ran, under_checkpoint

SDPA = F.scaled_dot_product_attention
"""torch's own function, as it was before any block patched it."""
FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
"""FlexAttention's operator (its eager path calls it too, from a function it compiles)."""
FLEX_REFUSED = Problem("flex_attention", "was called inside a cptune.context_parallel block, where it would attend over "
                       "this rank's shard only (cptune routes SDPA, not FlexAttention)",
                       "use F.scaled_dot_product_attention inside the block: packed documents and sliding windows go "
                       "to cptune.context_parallel(documents=..., window=...)")
_FLEX_TEXT = f"cptune: {FLEX_REFUSED}"  # a constant: traced code formats no dataclass
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


class Route:
    """Where the open block's SDPA calls go: its setup, which the block may replace (a later ``documents``).
    ``paused``: the block is set aside for a while (cptune's first-step check runs the model as one process inside
    it), and its calls go to torch's own SDPA."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.paused = False

    def sdpa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.paused:
            return SDPA(*args, **kwargs)
        return attend(self.setup, *args, **kwargs)


class SDPAMode(TorchFunctionMode):
    """Catches SDPA calls that bypass the patched ``F.scaled_dot_product_attention`` and sees backward.

    A from-import (``from torch.nn.functional import scaled_dot_product_attention``) binds
    torch's function before the block patches ``F``; the mode routes such calls to the ring.
    A mode is popped while a backward it dispatched runs, so an activation checkpoint's
    recompute would miss it: such calls under checkpointing are refused with the fix.
    """

    def __init__(self, route: Route) -> None:
        super().__init__()
        self.route = route

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if FLEX is not None and func is FLEX:  # a plain exception: FlexAttention traces this call even in eager,
            raise CPTuneError(_FLEX_TEXT)  # and torch.compile wraps it (the block unwraps it)
        if func is SDPA:
            if self.route.paused:
                return func(*args, **kwargs)
            if not torch.compiler.is_compiling() and under_checkpoint():
                raise_if([Problem(
                    "scaled_dot_product_attention", "was called through a reference bound before the block "
                    "(a from-import) inside activation checkpointing, where its recompute cannot be routed "
                    "to the ring", "call it as torch.nn.functional.scaled_dot_product_attention(...) "
                    "(F.scaled_dot_product_attention), which cptune patches for the block")])
            return self.route.sdpa(*args, **kwargs)
        result = func(*args, **kwargs)
        if func in _BACKWARDS:
            backward_ran()
        return result


def check_thread(owner: int) -> None:
    """Refuse SDPA from a thread other than the block's ``owner``, unless autograd runs it (a recompute)."""
    if threading.get_ident() != owner and not _torch_cp.in_backward():
        raise_if([Problem(
            "scaled_dot_product_attention", f"was called from thread {threading.current_thread().name!r} while a "
            "cptune.context_parallel block is open in another thread; cptune routes every SDPA call in the process "
            "to the open block (one block per process at a time, its attention on its own thread)",
            "run this attention on the block's thread, or outside the block (after it closes)")])


def unwrap(exc: BaseException | None) -> CPTuneError | None:
    """cptune's own error inside another one (torch.compile wraps what a traced call raises), to raise instead."""
    seen, cause = set(), exc
    while cause is not None and not isinstance(exc, CPTuneError) and id(cause) not in seen:
        if isinstance(cause, CPTuneError):
            return cause
        if FLEX_REFUSED.message in str(cause):  # traced, it comes back as dynamo's copy of it
            return ValidationError([FLEX_REFUSED])
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


@contextlib.contextmanager
def patched_sdpa(route: Route) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as the block's attention while the block runs.

    torch.compile traces this function (through activation-checkpoint regions too, where it
    does not apply torch-function modes), and eager recomputes call it from autograd's threads.
    """
    owner = threading.get_ident()

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            check_thread(owner)
        return route.sdpa(*args, **kwargs)

    before = F.scaled_dot_product_attention  # torch's, or a block set aside beneath this one (the first-step check)
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before
