"""One sequence length's search: propose configurations, measure them on the ranks, race the leaders.

:func:`run_study` opens the study (:mod:`.study`), then a :class:`_StudyRun` asks Optuna for
configurations until every open one is answered (or ``n_trials`` / ``timeout``), measures each
on the evaluator's ranks (or rules it out without running), and races the leaders within noise.
Configurations are proposed in the plan's order (:mod:`.guide`: best predicted first, recalibrated
after each trial; ``sampler='tpe'`` lets TPE propose instead), and the plan may skip one. A checkpointing mode
is not run once a mode of the same configuration that recomputes less is measured to fit
(:func:`.records.dominating`); ``exhaustive`` runs everything.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import optuna

from .._env import environment
from ..config import CPConfig
from ..workload import Workload
from . import racing
from .evaluate import SPMDEvaluator, TrialFailed
from .guide import Guide
from .interrupts import Interrupts, SearchInterrupted
from .measure import summarize, tokens_per_step
from .memory import PRUNE_FACTOR, predict_peak
from .records import DOMINATED_ATTR, INTERRUPTED, PLAN_ATTR, TrialRecord, dominated_reason, dominating, fits, \
    over_budget_reason, pruned_reason, record_from
from .result import SearchResult
from .settings import SearchSettings
from ..plan import config_from, config_key, invalid_reason, mesh_shapes
from .space import axes, pytorch_default, tp_degrees
from .study import default_study_name, finished, get_storage, open_study, question, records, result_from_study, \
    running

GRID_LIMIT = 64
"""Spaces with at most this many distinct configurations are searched exhaustively; larger ones by TPE."""

Progress = Callable[[TrialRecord, int, int], None]


def run_study(evaluator, workload: Workload, settings: SearchSettings, *, storage, study_name: str | None,
              progress: Progress | None, interrupts: Interrupts) -> SearchResult:
    """Search ``workload`` on the evaluator's ranks in study ``study_name`` (default: named after the question)."""
    world, device = evaluator.world_size, evaluator.device_type
    env = environment(device, world, evaluator.nproc_per_node).study()
    tp = tp_degrees(workload, evaluator.nproc_per_node, world, settings.max_tp)
    name = study_name or default_study_name(workload, world, device, settings.measure, env, tp)
    study = open_study(get_storage(storage), name, question(workload, settings.measure, env, tp), world, device,
                       settings.budget, settings.seed, settings.margin)
    try:
        result = _StudyRun(evaluator, study, workload, settings, progress, interrupts, tp).run(storage)
        interrupts.check()  # held through the race's last bookkeeping: stop before the next length
        return result
    except SearchInterrupted as exc:
        raise SearchInterrupted(exc.signum, name, len(finished(study))) from None


class _StudyRun:
    """The state of one study's search: what is open, what is done, and the ranks' memory baseline."""

    def __init__(self, evaluator, study: optuna.Study, workload: Workload, settings: SearchSettings,
                 progress: Progress | None, interrupts: Interrupts, tp: tuple[int, ...] = (1,)) -> None:
        self.evaluator, self.study, self.workload, self.settings = evaluator, study, workload, settings
        self.progress, self.interrupts = progress, interrupts
        self.axes = axes(workload, evaluator.world_size, evaluator.device_type, tp)
        self.done = finished(study, settings.budget, rerun_skipped=settings.exhaustive, margin=settings.margin)
        self.open_points: dict[str, dict] = {}  # one parameter set per distinct configuration, in search order
        for p in itertools.product(*self.axes.as_dict().values()):
            params = dict(zip(self.axes.as_dict(), p))
            self.open_points.setdefault(config_key(config_from(params), params.get("ac")), params)
        self.wanted = set(self.open_points)
        self.baseline = 0
        self.guide: Guide | None = None

    def _workload(self, ac: str | None) -> Workload:
        return self.workload.model_copy(update={"ac": ac}) if ac else self.workload

    def _start_guide(self) -> None:
        """The plan for this machine, calibrated on what the study measured already (a resumed search)."""
        ev, s = self.evaluator, self.settings
        name = environment(ev.device_type, ev.world_size, ev.nproc_per_node).device_name
        self.guide = Guide(self.workload, ev.device_type, name, ev.nproc_per_node, s.budget, self.baseline)
        for key, t in self.done.items():
            if t.state == optuna.trial.TrialState.COMPLETE and key in self.open_points:
                params = self.open_points[key]
                self.guide.observe(key, config_from(params), params.get("ac"), t.user_attrs.get("step_time_s"),
                                   t.user_attrs.get("peak_bytes"))

    def _next_open(self) -> str:
        """The next open configuration: the plan's best predicted (``sampler='grid'``: the space's own order)."""
        todo = {k: (config_from(p), p.get("ac")) for k, p in self.open_points.items() if k not in self.done}
        if self.guide is None or self.settings.sampler == "grid":
            return next(iter(todo))
        return self.guide.order(todo)[0]

    def _best_measured(self) -> float | None:
        """The best feasible figure so far at the low end of its noise range (a lucky high reading of the
        best must not rule others out)."""
        lows = []
        for t in self.done.values():
            if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("feasible") and t.value:
                r = record_from(t, self.settings.budget, self.settings.margin)
                racing.apply_spread(r, tokens_per_step(self._workload(r.ac), r.config))
                lows.append(racing.noise_range(r)[0])
        return max(lows) if lows else None

    def run(self, storage) -> SearchResult:
        s, world = self.settings, self.evaluator.world_size
        exhaustive = s.sampler == "grid" or (s.sampler == "auto" and len(self.wanted) <= GRID_LIMIT)
        if self.wanted - set(self.done):
            with self.interrupts.immediate():
                self.baseline = self.evaluator.baseline([m for m in mesh_shapes(world) if m[1] > 1])
            self.study.set_user_attr("baseline_bytes", self.baseline)  # what the plan's memory starts from
            self._start_guide()
        started, evaluated, duplicates = time.monotonic(), 0, 0
        while self.wanted - set(self.done):
            self.interrupts.check()
            if s.n_trials is not None and evaluated >= s.n_trials:
                break
            if s.timeout is not None and time.monotonic() - started >= s.timeout:
                break
            planned = s.sampler == "auto" and self.guide is not None and self.guide.dims is not None
            if exhaustive or planned or duplicates >= 10:  # the next open one (TPE: it kept proposing finished ones)
                self._enqueue(self.open_points[self._next_open()])
                duplicates = 0
            trial = self.study.ask()
            params = {k: trial.suggest_categorical(k, v) for k, v in self.axes.as_dict().items()}
            config, ac = config_from(params), params.get("ac")
            key = config_key(config, ac)
            trial.set_user_attr("key", key)
            trial.set_user_attr("config", config.model_dump(mode="json"))
            if ac:
                trial.set_user_attr("ac", ac)
            if key in self.done:  # never run a finished configuration twice
                duplicates += 1
                self._tell_duplicate(trial, self.done[key])
                continue
            duplicates = 0
            try:
                frozen = self._evaluate(trial, config, key, ac)
            except SearchInterrupted:
                if running(self.study, trial.number):
                    trial.set_user_attr("reason", INTERRUPTED)  # measured again on resume
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            self.done[key] = frozen
            if self.guide is not None and frozen.state == optuna.trial.TrialState.COMPLETE:
                self.guide.observe(key, config, ac, frozen.user_attrs.get("step_time_s"),
                                   frozen.user_attrs.get("peak_bytes"))
            evaluated += 1
            if self.progress is not None:
                self.progress(record_from(frozen, s.budget, s.margin), len(set(self.done) & self.wanted),
                              len(self.wanted))
        cut_short = self.study.user_attrs.get(racing.RACE_ATTR) == racing.RACING  # a stopped search's race
        if s.confirm and (evaluated or cut_short):
            self._race_leaders()
        if self.guide is not None and evaluated:  # the table's plan column: the model as finally calibrated
            self.study.set_user_attr(PLAN_ATTR, self.guide.calibrated())
        return result_from_study(self.study, budget=s.budget, margin=s.margin, evaluated=evaluated,
                                 complete=not (self.wanted - set(self.done)), storage=storage)

    def _enqueue(self, params: dict) -> None:
        """Ask for ``params`` next, unless a trial already waits (one a stopped search enqueued: asked first).

        Not optuna's ``skip_if_exists``: it skips params any earlier trial had, and a configuration open again (an
        interrupted trial, a ruling-out a new budget lifts, ``--exhaustive``) has one, so the sampler proposed
        finished configurations, each stored as a duplicate, until it happened on the open one."""
        if not self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            self.study.enqueue_trial(params)

    def _tell_duplicate(self, trial: optuna.Trial, previous: optuna.trial.FrozenTrial) -> None:
        trial.set_user_attr("duplicate_of", previous.number)
        if previous.state == optuna.trial.TrialState.COMPLETE:
            trial.set_user_attr("feasible", previous.user_attrs.get("feasible"))
            trial.set_constraint("memory", previous.user_attrs.get("excess", 0.0))
            self.study.tell(trial, previous.value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def _evaluate(self, trial: optuna.Trial, config: CPConfig, key: str, ac: str | None) -> optuna.trial.FrozenTrial:
        """Run (or rule out) one trial and tell Optuna; returns the trial as stored."""
        state, study, workload, s = optuna.trial.TrialState, self.study, self._workload(ac), self.settings
        reason = invalid_reason(workload, config, self.evaluator.device_type)
        if reason is not None:
            trial.set_user_attr("reason", f"invalid: {reason}")
            return study.tell(trial, state=state.PRUNED)
        by = None if s.exhaustive else dominating(config, ac, self.done, s.budget, s.margin)
        if by is not None:  # a less checkpointed run of it fits: this one cannot be faster
            trial.set_user_attr(DOMINATED_ATTR, by.user_attrs["key"])
            trial.set_user_attr("reason", dominated_reason(by, ac, s.margin, s.budget))
            return study.tell(trial, state=state.PRUNED)
        planned = self.guide.predicted(key, config, ac) if self.guide is not None else None
        if planned is not None:
            trial.set_user_attr("plan_peak_bytes", planned.peak_bytes)
            skip = None if s.exhaustive else self.guide.skip(key, config, ac, self._best_measured())
            if skip is not None:
                trial.set_user_attr("reason", skip)
                trial.set_user_attr("plan_skipped", True)
                trial.set_user_attr("plan_calibration", self.guide.calibration.describe())
                return study.tell(trial, state=state.PRUNED)
        predicted = predict_peak(workload, config, self.baseline) if workload.predictable else \
            planned.peak_bytes if workload.model is not None and planned is not None else None  # the plan's model
        trial.set_user_attr("predicted_bytes", predicted)
        trial.set_user_attr("memory_budget", s.budget)
        if predicted is not None and predicted > PRUNE_FACTOR * s.budget:
            trial.set_user_attr("feasible", False)
            trial.set_user_attr("reason", pruned_reason(predicted, s.budget))
            return study.tell(trial, state=state.PRUNED)
        if isinstance(self.evaluator, SPMDEvaluator):  # a hang ends the torchrun job: record why first
            def timed_out() -> None:
                trial.set_user_attr("reason", f"timed out after {s.trial_timeout:.0f}s; job ended to relaunch")
                study.tell(trial, state=state.FAIL)
            self.evaluator.on_timeout = timed_out
        try:
            with self.interrupts.immediate():
                per_rank = self.evaluator(workload, config, racing.screening(s.measure) if s.confirm else s.measure)
        except TrialFailed as exc:
            trial.set_user_attr("reason", exc.reason)
            trial.set_user_attr("feasible", False)
            return study.tell(trial, state=state.FAIL)
        summary = summarize(per_rank, workload, config, self.baseline)
        feasible = fits(summary["peak_bytes"], s.budget, s.margin)  # worst rank, whole trial, plus the margin
        for k, v in summary.items():
            trial.set_user_attr(k, v)
        excess = float(summary["peak_bytes"] - s.budget) / s.budget
        trial.set_user_attr("feasible", feasible)
        trial.set_user_attr("excess", excess)
        trial.set_constraint("memory", excess)
        if not feasible:
            trial.set_user_attr("reason", over_budget_reason(summary["peak_bytes"], s.budget, s.margin))
        return study.tell(trial, summary["tokens_per_s"])

    def _race_leaders(self) -> None:
        """Race the leader and the configs within its spread in paired rounds (see :mod:`.racing`)."""
        study, workload, s = self.study, self.workload, self.settings
        leader, rivals = racing.contenders(records(study, workload, s.budget, s.margin))
        if leader is None or not rivals:
            study.set_user_attr(racing.RACE_ATTR, None)  # an earlier race no longer holds
            return
        study.set_user_attr(racing.RACE_ATTR, racing.RACING)  # one cut short decides nothing; a resume races again
        brief = racing.race_round(s.measure, workload)

        def measure(record: TrialRecord) -> float | None:
            try:
                with self.interrupts.immediate():
                    per_rank = self.evaluator(self._workload(record.ac), record.config, brief)
            except TrialFailed:
                return None
            summary = summarize(per_rank, workload, record.config, self.baseline)
            extra = dict(study.user_attrs.get(racing.EXTRA_ATTR, {}))
            extra.setdefault(record.key, []).extend(summary["step_times"])
            study.set_user_attr(racing.EXTRA_ATTR, extra)
            return summary["tokens_per_s"]

        default = pytorch_default(workload, self.evaluator.world_size, self.evaluator.device_type)
        study.set_user_attr(racing.RACE_ATTR, racing.race(leader, rivals, lambda r: r.key, measure,
                                                          pick=lambda alive: racing.choose(alive, default)))


__all__ = ["GRID_LIMIT", "Progress", "run_study"]
