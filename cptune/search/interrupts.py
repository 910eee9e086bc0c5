"""Stopping a search cleanly on Ctrl-C (SIGINT) or a scheduler's SIGTERM.

While a trial is being measured the signal stops it at once; anywhere else (Optuna storage
writes, bookkeeping, starting or closing the ranks, writing a recipe) it is held until the
driver reaches a safe point, so the study is never left half-written. A held signal is never
dropped: leaving the :class:`Interrupts` window raises it at the latest. The trial that was
running is recorded as interrupted, which a resumed search measures again (a trial that failed
on its own is not retried). Windows nest: an inner one (the library's ``search``) takes over a
signal the outer one (the CLI) held, and hands back one it held when an error ends it.

A signal that lands while a finalizer runs (a weakref callback, ``__del__``: the storage's SQLAlchemy
has them, and any garbage collection runs them) raises there, and Python drops an exception raised in
a finalizer: the window's ``sys.unraisablehook`` catches that one and delivers the signal again, so a
measurement still stops at once (its peers may be gone; waiting on them would hang the rank).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


def _inside(frame: Any, code: Any) -> bool:
    """Whether ``frame`` or one of its callers runs ``code``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class SearchInterrupted(BaseException):
    """The search was stopped by a signal. ``stored``: trials in the study; ``exit_code``: 128 + signal."""

    def __init__(self, signum: int, study_name: str = "", stored: int = 0) -> None:
        self.signum, self.study_name, self.stored = signum, study_name, stored
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def after(self, results) -> SearchInterrupted:
        """This interruption, named after the last of ``results`` (SearchResults) when it came once
        every study was stored (closing the ranks, printing): resuming prints the result at once."""
        if self.study_name or not results:
            return self
        return SearchInterrupted(self.signum, results[-1].study_name, len(results[-1].trials))

    def message(self, command: str) -> str:
        """The one line a user sees: what was stopped, what is kept, and the command that resumes."""
        name = signal.Signals(self.signum).name
        if not self.study_name:
            return f"cptune search: stopped by {name} before any trial was stored; rerun with: {command}"
        return (f"cptune search: stopped by {name} with {self.stored} trial(s) stored in study {self.study_name}; "
                f"resume with: {command}")


class Interrupts:
    """Installs SIGINT/SIGTERM handlers for a search (main thread only) and restores them after."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._measuring = False  # inside immediate()
        self._immediate = False  # a signal raises now (once: a second one while it unwinds is held)
        self._old: dict[int, Any] = {}
        self._old_hook: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.pending = signum  # held until it is seen leaving the window (below), or raised at the next safe point
        if self._immediate and not _inside(frame, Interrupts._unraisable.__code__):
            self._immediate = False
            raise SearchInterrupted(signum)

    def _unraisable(self, unraisable: Any) -> None:
        """Our stop, raised inside a finalizer and dropped there: delivered again once the finalizer has
        returned (from a helper thread, until it has got out), while the measurement is still running."""
        if not isinstance(unraisable.exc_value, SearchInterrupted):
            self._old_hook(unraisable)
        elif self._measuring and self.pending is not None:
            self._immediate = True
            threading.Thread(target=self._deliver, args=(self.pending,), daemon=True).start()

    def _deliver(self, signum: int) -> None:
        while self._immediate and self._measuring:
            _thread.interrupt_main(signum)  # the handler runs at the main thread's next instruction
            time.sleep(0.001)

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
            self._old_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            outer = self._outer()
            if outer is not None and outer.pending is not None:  # held by the outer window: ours now
                self.pending, outer.pending = outer.pending, None
        return self

    def _outer(self) -> Interrupts | None:
        owner = getattr(self._old.get(signal.SIGINT), "__self__", None)
        return owner if isinstance(owner, Interrupts) else None

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        outer = self._outer()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old:
            sys.unraisablehook, self._old_hook = self._old_hook, None
        self._old.clear()
        if exc_type is None:
            self.check()  # a signal held to the end still stops the caller
        elif outer is not None and self.pending is not None and outer.pending is None:
            outer.pending = self.pending  # an error is on its way out: the outer window decides
        self.pending = None

    def check(self) -> None:
        """A safe point: raise if a signal arrived meanwhile."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise SearchInterrupted(signum)

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """While measuring: a signal stops the trial at once."""
        self.check()
        self._measuring = self._immediate = True
        try:
            yield
        except SearchInterrupted:
            self.pending = None  # it got out: nothing is held
            raise
        finally:
            self._measuring = self._immediate = False
