"""What the attention ops record for the open block: each CP attention forward that is not a recompute.

The block reads a :class:`ForwardRecord` to spot activation checkpointing: a ring or Ulysses
forward that runs under ``torch.utils.checkpoint`` will be recomputed in backward, which must then
run inside the block. The ops call :func:`notify_forward` from their own bodies, which run in eager
and in compiled code alike, so every call is recorded. Data flows up as a record the block reads;
nothing here calls the block.

The masked ring also counts the bytes it sends (:func:`counting`), for benchmarks and tests to read.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from .. import _torch_cp

_CHECKPOINT_FILES = (os.path.join("torch", "utils", "checkpoint.py"),)


@dataclass
class ForwardRecord:
    """Since the last backward: whether a CP attention forward ran, and whether one ran under checkpointing."""

    since_backward: bool = False
    checkpointed: bool = False


_RECORDS: list[ForwardRecord] = []


@dataclass
class Traffic:
    """Bytes this rank's masked ring sent to other ring ranks (key/value blocks and their gradients) while open."""

    sent: int = 0


_TRAFFIC: list[Traffic] = []


def count_sent(nbytes: int) -> None:
    for traffic in _TRAFFIC:
        traffic.sent += nbytes


def counting() -> contextlib.AbstractContextManager[Traffic]:
    """The masked ring's bytes sent by this rank while the context is open."""
    return _listed(_TRAFFIC, Traffic())


@contextlib.contextmanager
def _listed(listeners: list, item):
    """``item`` in ``listeners`` while the context is open."""
    listeners.append(item)
    try:
        yield item
    finally:  # by identity: records are dataclasses, and a block's record may equal another's (a nested check's)
        del listeners[next(i for i, x in enumerate(listeners) if x is item)]


def under_checkpoint() -> bool:
    """Whether torch.utils.checkpoint is running the caller (a forward it will recompute)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILES):
            return True
        frame = frame.f_back
    return False


def notify_forward() -> None:
    """Record a CP attention forward, unless it is a recompute inside a backward pass."""
    if not _torch_cp.in_backward():
        for record in _RECORDS:
            record.since_backward = True
            if not record.checkpointed and under_checkpoint():  # one stack walk until the next backward
                record.checkpointed = True


def backward_ran() -> None:
    """A backward pass ran: what was recorded is consumed."""
    for record in _RECORDS:
        record.since_backward = record.checkpointed = False


def recording() -> contextlib.AbstractContextManager[ForwardRecord]:
    """A record of the CP attention forwards that run while the context is open."""
    return _listed(_RECORDS, ForwardRecord())
