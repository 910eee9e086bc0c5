"""What the attention ops tell the open session: each CP attention forward that is not a recompute.

The session listens (:func:`forward_listener`) to spot activation checkpointing: a ring or
Ulysses forward that runs under ``torch.utils.checkpoint`` will be recomputed in backward, which
must then run inside the block. The ops call :func:`notify_forward` from their own bodies, which
run in eager and in compiled code alike, so the session sees every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from . import _torch_cp

_FORWARD_LISTENERS: list[Callable[[], None]] = []


def notify_forward() -> None:
    """Tell the listeners a CP attention forward ran, unless it is a recompute inside a backward pass."""
    if not _torch_cp.in_backward():
        for listener in _FORWARD_LISTENERS:
            listener()


@contextlib.contextmanager
def forward_listener(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn`` after each CP attention forward that is not a recompute inside a backward pass."""
    _FORWARD_LISTENERS.append(fn)
    try:
        yield
    finally:
        _FORWARD_LISTENERS.remove(fn)
