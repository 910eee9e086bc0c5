"""Stopping a search cleanly on Ctrl-C (SIGINT) or a scheduler's SIGTERM.

While a trial is being measured the signal stops it at once; anywhere else (Optuna storage
writes, bookkeeping) it is held until the driver reaches a safe point, so the study is never
left half-written. The trial that was running is recorded as interrupted, which a resumed
search measures again (a trial that failed on its own is not retried).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class SearchInterrupted(BaseException):
    """The search was stopped by a signal. ``stored``: trials in the study; ``exit_code``: 128 + signal."""

    def __init__(self, signum: int, study_name: str = "", stored: int = 0) -> None:
        self.signum, self.study_name, self.stored = signum, study_name, stored
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interrupts:
    """Installs SIGINT/SIGTERM handlers for a search (main thread only) and restores them after."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._immediate = False
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self._immediate:
            self._immediate = False
            raise SearchInterrupted(signum)
        self.pending = signum

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def check(self) -> None:
        """A safe point: raise if a signal arrived meanwhile."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise SearchInterrupted(signum)

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """While measuring: a signal stops the trial at once."""
        self.check()
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False
