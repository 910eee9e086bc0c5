"""A group of N local ranks that runs functions SPMD-style: the tests' harness and the search's launcher.

``WorkerGroup(n)`` spawns n processes once, each joined to one process group (gloo on CPU,
nccl when ``device="cuda"``), and then runs as many jobs as asked: ``group.run(fn, *args)``
calls ``fn(*args)`` on every rank and returns the per-rank results in rank order. A job
that raises on any rank raises :class:`RankFailure` carrying every rank's exception and
traceback; a job that outlives its timeout, or a rank that dies, kills the whole group and
raises :class:`GroupLost`, and the next ``run`` starts a fresh group. ``close()`` (or
leaving the ``with``) leaves no process behind.

``fn`` must be importable by name (a module-level function), as with any spawned process.

Ranks start from a fork server that has imported torch and cptune once (where the platform has one), so a group
starts in a fraction of a second instead of each rank importing torch afresh (3-4 s of CPU a rank); like a spawned
process, a rank shares nothing else with its parent, imports the parent's main module before its first job and
runs in the parent's environment as it is when the group starts. (Variables torch reads only as it is imported,
such as TORCH_LOGS, are read from the environment of the first group's start.)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from . import _torch_cp
from ._env import process_backend, return_freed_memory
from ._rank import close_rank, init_rank  # noqa: F401  (their home before 0.2; the harness's ranks use them)
from .errors import CPTuneError


class RankFailure(CPTuneError):
    """A job raised on one or more ranks. ``errors``/``tracebacks`` map rank -> what it raised."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        self.errors, self.tracebacks = errors, tracebacks
        first = min(errors)
        text = "\n".join(f"--- rank {r} ---\n{tracebacks[r]}" for r in sorted(tracebacks))
        super().__init__(f"{len(errors)} rank(s) failed; rank {first}: {errors[first]!r}\n{text}")


class GroupLost(CPTuneError):
    """The group had to be killed: a job timed out or a rank died. The next run relaunches it."""


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: 'exit code 1', 'killed by SIGABRT', 'still running'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, threads: int, pg_timeout: float,
            jobs: Any, results: Any, env: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal group: the parent decides
    if hasattr(signal, "pthread_sigmask"):  # the fork server has it blocked (_start_server): what this rank starts
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # gets Ctrl-C as usual
    os.environ.clear()  # the parent's environment as it is now, not the fork server's from when it started
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        return_freed_memory()
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
    results.put((rank, -1, "ready", None))
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            job_id, fn, args, kwargs = job
            try:
                results.put((rank, job_id, "ok", fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
                try:
                    import pickle

                    pickle.dumps(exc)
                except Exception:  # noqa: BLE001
                    exc = RuntimeError(f"{type(exc).__name__}: {exc}")
                results.put((rank, job_id, "error", (exc, traceback.format_exc())))
    finally:
        close_rank()


PRELOAD = ["cptune", "cptune.search.measure", _torch_cp.COMPILER]
"""What the fork server imports once, before it forks a rank: no thread, no device and no process group is
started by these imports, so a forked rank is as clean as a spawned one (and none imports dynamo again: cptune's
own import leaves it to the first call that needs it)."""


def _context() -> Any:
    """The fork server where the platform has one (Linux, macOS), else spawn (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first group of this process
    return ctx


def _start_server(ctx: Any) -> None:
    """Start the fork server unless it runs, with SIGINT blocked, as multiprocessing starts its resource tracker.

    A Ctrl-C reaches the terminal's whole process group. The server ignores it once it has imported its preload,
    but during that import (seconds: torch) it would die of it, with a traceback; blocked, the signal waits in the
    server until it is ignored there. This process gets its own as soon as it unblocks."""
    if ctx.get_start_method() != "forkserver" or not hasattr(signal, "pthread_sigmask"):
        return
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # it unblocks SIGINT when it starts itself: first, outside the block
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held while the ranks are forked, then delivered as if they had come right after.

    A signal raised inside ``Process.start`` after the fork server forked a rank, but before the rank's handle
    exists, would leave a rank no one can kill or wait for (and the parent waits there while the server first
    imports torch). Python runs a handler in the main thread only: in another, there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
           if signal.getsignal(s) is not None}  # None: a handler from C, which Python could not put back
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


def stop_helpers() -> None:
    """Stop the fork server the ranks start from and multiprocessing's resource tracker, and wait until both exit.

    For a program about to exit (``cptune search``, at exit): both outlive a group on purpose, for the next one,
    and otherwise end only after this process has (they ignore Ctrl-C and wait for their pipe to close), so the
    program would return with them still running. Not for a library call: they are the process's, shared with its
    other groups and any multiprocessing user. Does nothing while a process this one started lives (a group not
    closed: they serve it). A later group starts them again."""
    # multiprocessing has no public way to stop either: _stop() (closes the pipe, waits) is what its own tests use
    import gc
    from multiprocessing import forkserver, resource_tracker

    if mp.active_children():
        return
    server, tracker = getattr(forkserver, "_forkserver", None), getattr(resource_tracker, "_resource_tracker", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:  # with its ranks gone it holds nothing; left to exit, its teardown of torch takes a second
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    gc.collect()  # the groups' queues: their semaphores are unlinked now, not left to the tracker to call leaked
    for helper in (server, tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            with contextlib.suppress(ChildProcessError):  # already waited for
                stop()


class WorkerGroup:
    """N local ranks in one process group, reused for many jobs."""

    def __init__(self, nproc: int, *, device: str = "cpu", threads: int = 1, timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        if nproc < 1:
            raise CPTuneError(f"nproc must be at least 1, got {nproc}")
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if main is not None and not os.path.exists(main):  # e.g. `python - <<EOF`: main is '<stdin>'
            raise CPTuneError(f"cannot start the ranks: they are spawned processes, which re-import this program's "
                              f"main module from its file, and {main!r} is not a file. Fix: save the code to a "
                              f".py file and run that (a notebook or python -c also works)")
        self.nproc, self.device, self.threads, self.timeout = nproc, device, threads, timeout
        self.env = dict(env or {})
        self.backend = process_backend(device)
        self._ctx = _context()
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None
        self._job_id = 0
        self.launches = 0
        self.exitcodes: list[int | None] = []  # how each rank of the last closed group exited
        self.error_grace = 10.0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._procs:
            return
        port = free_port()
        self._results = self._ctx.Queue()
        self._jobs = [self._ctx.Queue() for _ in range(self.nproc)]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), **self.env}
        self._procs = [
            self._ctx.Process(target=_worker, daemon=True, name=f"cptune-rank{r}",
                              args=(r, self.nproc, port, self.backend, self.threads, self.timeout,
                                    self._jobs[r], self._results, env))
            for r in range(self.nproc)
        ]
        _start_server(self._ctx)
        with _signals_held():
            for p in self._procs:
                p.start()
        self.launches += 1
        self._collect(-1, self.timeout, "start-up")

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            if p.pid is not None:  # started (a failed start leaves the rest unstarted)
                p.join(timeout=10)
        self._procs = []
        for q in [*self._jobs, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._jobs, self._results = [], None

    def close(self) -> None:
        if not self._procs:
            return
        for q in self._jobs:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self._procs:
            if p.pid is not None:  # started
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.exitcodes = [p.exitcode for p in self._procs]  # None: still running after 10 s, killed now
        unclean = [f"rank {r}: {describe_exit(c)}" for r, c in enumerate(self.exitcodes) if c != 0]
        if unclean:  # every result was already returned; a crash at exit is still a defect to see
            sys.stderr.write(f"cptune: the ranks did not all exit cleanly when closed ({'; '.join(unclean)})\n")
        self.kill()

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- jobs -----------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        self.start()
        self._job_id += 1
        for q in self._jobs:
            q.put((self._job_id, fn, args, kwargs))
        return self._collect(self._job_id, timeout or self.timeout, getattr(fn, "__name__", str(fn)))

    def _collect(self, job_id: int, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.nproc:
            try:
                rank, jid, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self.kill()
                    raise GroupLost(f"{what}: rank(s) {', '.join(f'{r} ({describe_exit(c)})' for r, c in dead)} "
                                    "died; the group was shut down") from None
                if time.monotonic() > deadline:
                    self.kill()
                    if any(st == "error" for st, _ in got.values()):
                        break  # report what the failing ranks raised; the others were stuck
                    raise GroupLost(f"{what}: no result from rank(s) "
                                    f"{sorted(set(range(self.nproc)) - set(got))} after {timeout:.0f}s; "
                                    "the group was shut down") from None
                continue
            if jid == job_id:
                got[rank] = (status, payload)
                if status == "error":  # the other ranks may be stuck in a collective: wait briefly
                    deadline = min(deadline, time.monotonic() + self.error_grace)
        errors = {r: p[0] for r, (s, p) in got.items() if s == "error"}
        if errors:
            raise RankFailure(errors, {r: got[r][1][1] for r in errors})
        return [got[r][1] for r in range(self.nproc)]
