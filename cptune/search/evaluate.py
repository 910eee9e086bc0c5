"""How a trial's configuration reaches the ranks: a local group cptune launched, or the user's torchrun job.

Both evaluators take a configuration and return every rank's measurement, or raise a
:class:`~cptune.CPTuneError` saying why the trial failed. The driver is the same for both.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..config import CPConfig
from ..errors import CPTuneError
from ..launch import GroupLost, RankFailure, WorkerGroup
from .measure import baseline_on_rank, check_on_rank, measure_on_rank
from .settings import MeasureSettings
from ..workload import Workload

MeasureFn = Callable[[Workload, CPConfig, MeasureSettings], dict]


class TrialFailed(CPTuneError):
    """A trial raised on a rank, hung, or lost a rank. ``reason`` is one line for the study."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(reason + (f"\n{detail}" if detail else ""))


def _refusal(errors: dict[int, BaseException]) -> CPTuneError:
    """A rank's cptune error as it was (the first-step check's refusal by name), else the failure in a line."""
    rank = min(errors)
    if isinstance(errors[rank], CPTuneError):
        return errors[rank]
    return TrialFailed(f"rank {rank}: {_one_line(errors[rank])} during the first-step check")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class LocalEvaluator:
    """Ranks on this machine, launched once and relaunched after a hang or a lost rank."""

    def __init__(self, nproc: int, device: str, trial_timeout: float, measure: MeasureFn = measure_on_rank,
                 env: dict[str, str] | None = None) -> None:
        self.world_size, self.device_type, self.nproc_per_node = nproc, device, nproc
        self.trial_timeout, self.measure = trial_timeout, measure
        self.group = WorkerGroup(nproc, device=device, timeout=max(120.0, trial_timeout), env=env)

    def baseline(self, mesh_shapes) -> int:
        return max(self.group.run(baseline_on_rank, mesh_shapes))

    def check(self, workload: Workload) -> str | None:
        """The model's first-step check on the ranks (:func:`.measure.check_on_rank`); a refusal raised here."""
        try:
            return self.group.run(check_on_rank, workload, timeout=self.trial_timeout)[0]
        except RankFailure as exc:
            raise _refusal(exc.errors) from None
        except GroupLost as exc:
            raise TrialFailed(str(exc).splitlines()[0] + " during the first-step check") from None

    def __call__(self, workload: Workload, config: CPConfig, settings: MeasureSettings) -> list[dict]:
        try:
            return self.group.run(self.measure, workload, config, settings, timeout=self.trial_timeout)
        except RankFailure as exc:
            rank = min(exc.errors)
            raise TrialFailed(f"rank {rank}: {_one_line(exc.errors[rank])}", exc.tracebacks[rank]) from None
        except GroupLost as exc:
            raise TrialFailed(str(exc).splitlines()[0] + "; the ranks were relaunched") from None

    def close(self) -> None:
        self.group.close()

    def abort(self) -> None:
        """Stop the ranks now (an interrupted search): killed and waited for, no waiting for the trial."""
        self.group.kill()


class SPMDEvaluator:
    """Inside the user's torchrun job: rank 0 drives, broadcasts each config, and gathers results.

    The other ranks call :meth:`follow` and serve until rank 0 calls :meth:`close`. A trial
    that outlives ``trial_timeout`` makes rank 0 record it as failed and exit, so torchrun
    tears the job down; relaunched (``--max-restarts``), the search resumes past it.
    """

    def __init__(self, trial_timeout: float, measure: MeasureFn = measure_on_rank,
                 on_timeout: Callable[[], None] | None = None) -> None:
        self.world_size = dist.get_world_size()
        self.nproc_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.trial_timeout, self.measure, self.on_timeout = trial_timeout, measure, on_timeout

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _serve(self, message: tuple) -> Any:
        kind, *args = message
        try:
            work = {"baseline": baseline_on_rank, "check": check_on_rank}.get(kind, self.measure)
            reply = ("ok", work(*args))
        except CPTuneError as exc:  # said as it is (the first-step check's refusal)
            reply = ("refused", exc)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the trial
            reply = ("error", (_one_line(exc), traceback.format_exc()))
        replies = [None] * self.world_size if dist.get_rank() == 0 else None
        dist.gather_object(reply, replies, dst=0)
        return replies

    def follow(self) -> None:
        """Serve rank 0's trials until it closes. A signal ends this rank by the signal itself: rank 0 owns the
        study and records the trial; this rank has nothing to save, and a Python-level exit (KeyboardInterrupt)
        would tear the interpreter down under gloo's threads. A driver that is gone is an error in one line."""
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            while True:
                try:
                    message = self._broadcast(None)
                except RuntimeError as exc:  # rank 0 left without closing (killed, timed out)
                    raise CPTuneError(f"rank {dist.get_rank()}: rank 0, which drives the search, is gone "
                                      f"({_one_line(exc)}); this rank stops too. The study keeps what rank 0 "
                                      "stored: rerun the same torchrun command to resume") from None
                if message is None:
                    return
                self._serve(message)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _ask(self, message: tuple) -> list:
        self._broadcast(message)
        timer = threading.Timer(self.trial_timeout, self._timed_out)
        timer.daemon = True
        timer.start()
        try:
            replies = self._serve(message)
        finally:
            timer.cancel()
        refused = {r: rep[1] for r, rep in enumerate(replies) if rep[0] == "refused"}
        if refused and message[0] == "check":
            raise _refusal(refused)
        errors = [(r, rep[1] if rep[0] == "error" else (_one_line(rep[1]), "")) for r, rep in enumerate(replies)
                  if rep[0] in ("error", "refused")]
        if errors:
            rank, (line, detail) = errors[0]
            raise TrialFailed(f"rank {rank}: {line}", detail)
        return [rep[1] for rep in replies]

    def _timed_out(self) -> None:
        if self.on_timeout is not None:
            self.on_timeout()
        os._exit(124)

    def baseline(self, mesh_shapes) -> int:
        return max(self._ask(("baseline", mesh_shapes)))

    def check(self, workload: Workload) -> str | None:
        return self._ask(("check", workload))[0]

    def __call__(self, workload: Workload, config: CPConfig, settings: MeasureSettings) -> list[dict]:
        return self._ask(("measure", workload, config, settings))

    def close(self) -> None:
        self._broadcast(None)

    def abort(self) -> None:
        """Under torchrun the other ranks are torchrun's to stop; rank 0 records the trial and exits."""
