"""``cptune.search``: an Optuna study over the CP space, evaluated on real ranks."""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import optuna

from ..errors import Problem, ValidationError
from .evaluate import SPMDEvaluator, TrialFailed
from .interrupts import Interrupts, SearchInterrupted
from .measure import MeasureSettings, summarize, tokens_per_step
from .memory import PRUNE_FACTOR, predict_peak
from .result import INTERRUPTED, SearchResult, TrialRecord, over_budget_reason, pruned_reason, record_from
from . import racing
from .space import axes, config_from, config_key, invalid_reason, mesh_shapes, pytorch_default
from .workload import Workload

GRID_LIMIT = 64
"""Spaces with at most this many distinct configurations are searched exhaustively; larger ones by TPE."""
DEFAULT_STORAGE = "sqlite:///cptune.db"

Progress = Callable[[TrialRecord, int, int], None]


def get_storage(storage: None | str | optuna.storages.BaseStorage) -> optuna.storages.BaseStorage:
    """None: a local SQLite file; a URL (sqlite, postgresql, ...); or an Optuna storage object."""
    if storage is None:
        storage = DEFAULT_STORAGE
    try:
        return optuna.storages.get_storage(storage)
    except Exception as exc:  # noqa: BLE001 - optuna raises many kinds for a bad URL
        raise ValidationError([Problem("--storage", f"cannot open {storage!r}: {exc}",
                                       "give a URL like sqlite:///cptune.db or postgresql://user@host/db")]) from None


def environment(device_type: str, world_size: int, nproc_per_node: int) -> dict[str, Any]:
    """Where a study's figures come from: measurements from two environments are never ranked together."""
    import torch

    from .. import __version__
    from .measure import device_name

    return {"torch": torch.__version__, "cptune": __version__, "device_type": device_type,
            "device_name": device_name(device_type), "nproc_per_node": nproc_per_node,
            "nnodes": max(1, world_size // max(1, nproc_per_node))}


def _question(workload: Workload, settings: MeasureSettings, env: dict[str, Any]) -> dict[str, Any]:
    return {"workload": workload.model_dump(mode="json"), "settings": settings.model_dump(mode="json"),
            "environment": env}


def default_study_name(workload: Workload, world_size: int, device_type: str,
                       settings: MeasureSettings | None = None, env: dict[str, Any] | None = None) -> str:
    """Readable, plus a short hash of everything that changes the answer: the whole workload,
    the measurement settings and the environment (torch, cptune, device, ranks per node, nodes)."""
    kv = f"-kv{workload.kv_heads}" if workload.kv_heads else ""
    step = f"-{workload.step.replace(':', '.')}" if workload.step else ""
    step += ("-compiled" if workload.compile else "") + (f"-ac{workload.ac}" if workload.ac != "none" else "")
    layers = f"-L{workload.layers}" if workload.layers != 1 else ""
    env = env or environment(device_type, world_size, world_size)
    digest = hashlib.sha256(json.dumps(_question(workload, settings or MeasureSettings(), env),
                                       sort_keys=True).encode()).hexdigest()[:8]
    return (f"cptune-{device_type}{world_size}-S{workload.seq_len}-B{workload.batch}-H{workload.heads}{kv}"
            f"-D{workload.head_dim}{layers}-{workload.dtype}-{'causal' if workload.causal else 'full'}{step}-{digest}")


def _open_study(storage, name: str, question: dict[str, Any], world: int, device: str, budget: int,
                seed: int | None, margin: float = 0.0) -> optuna.Study:
    # Exhaustive search enqueues every open configuration in turn; TPE (with the memory
    # constraint) proposes the rest when the space is large.
    chosen = optuna.samplers.TPESampler(seed=seed)  # reads each trial's "memory" constraint
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=chosen,
                                load_if_exists=True)
    attrs = study.user_attrs
    if attrs.get("workload") is None:
        for key, value in question.items():
            study.set_user_attr(key, value)
        study.set_user_attr("world_size", world)
        study.set_user_attr("device", device)
    else:
        changes = [f"{field} {old!r} -> {new!r}" for part in ("workload", "settings", "environment")
                   for field, old, new in _changed(attrs.get(part) or {}, question[part])]
        if attrs.get("world_size") != world:
            changes.append(f"world size {attrs.get('world_size')} -> {world}")
        if changes:
            raise ValidationError([Problem("--study-name", f"study {name!r} was measured for another question "
                                           f"({'; '.join(changes)})", "leave --study-name out (each question "
                                           "gets its own study), or give a new name")])
    study.set_user_attr("memory_budget", budget)
    study.set_user_attr("memory_margin", margin)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # One driver per study at a time: a trial still RUNNING was left by a driver that died.
        study._storage.set_trial_user_attr(t._trial_id, "reason", INTERRUPTED)
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    return study


def _changed(stored: dict, now: dict) -> list[tuple[str, Any, Any]]:
    return [(k, stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)]


_PREFERENCE = {optuna.trial.TrialState.COMPLETE: 2, optuna.trial.TrialState.FAIL: 1,
               optuna.trial.TrialState.PRUNED: 0}


def _finished(study: optuna.Study, budget: int | None = None) -> dict[str, optuna.trial.FrozenTrial]:
    """The trial that answers each configuration today, by config key.

    Not answered (so run again): a trial interrupted by a stopped search, and one ruled out by
    its predicted peak under an earlier, tighter budget that the current ``budget`` admits.
    Of several, a measurement wins over a failure over a ruling-out, and the latest wins.
    """
    done: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if not t.state.is_finished() or "key" not in a or "duplicate_of" in a:
            continue
        if t.state == optuna.trial.TrialState.FAIL and a.get("reason") == INTERRUPTED:
            continue
        predicted = a.get("predicted_bytes")
        if (budget is not None and t.state == optuna.trial.TrialState.PRUNED and predicted is not None
                and predicted <= PRUNE_FACTOR * budget):
            continue
        previous = done.get(a["key"])
        if previous is None or (_PREFERENCE[t.state], t.number) > (_PREFERENCE[previous.state], previous.number):
            done[a["key"]] = t
    return done


def _run_search(evaluator, workload: Workload, *, budget: int, storage, study_name: str | None,
                n_trials: int | None, timeout: float | None, sampler: str, seed: int | None,
                settings: MeasureSettings, progress: Progress | None, interrupts: Interrupts,
                confirm: bool = True, margin: float = 0.0) -> SearchResult:
    world, device = evaluator.world_size, evaluator.device_type
    storage_obj = get_storage(storage)
    env = environment(device, world, evaluator.nproc_per_node)
    name = study_name or default_study_name(workload, world, device, settings, env)
    study = _open_study(storage_obj, name, _question(workload, settings, env), world, device, budget, seed, margin)
    ax = axes(workload, world, device)
    done = _finished(study, budget)
    open_points: dict[str, dict] = {}  # one parameter set per distinct configuration, in search order
    for p in itertools.product(*ax.as_dict().values()):
        params = dict(zip(ax.as_dict(), p))
        open_points.setdefault(config_key(config_from(params)), params)
    wanted = set(open_points)
    exhaustive = sampler == "grid" or (sampler == "auto" and len(wanted) <= GRID_LIMIT)
    try:
        result = _search_loop(evaluator, study, workload, ax, open_points, wanted, done, budget=budget,
                              n_trials=n_trials, timeout=timeout, exhaustive=exhaustive, settings=settings,
                              progress=progress, confirm=confirm, margin=margin, interrupts=interrupts,
                              name=name, storage=storage)
        interrupts.check()  # held through the race's last bookkeeping: stop before the next length
        return result
    except SearchInterrupted as exc:
        raise SearchInterrupted(exc.signum, name, len(_finished(study))) from None


def _search_loop(evaluator, study, workload, ax, open_points, wanted, done, *, budget, n_trials, timeout,
                 exhaustive, settings, progress, confirm, margin, interrupts, name, storage) -> SearchResult:
    world, device = evaluator.world_size, evaluator.device_type
    with interrupts.immediate():
        baseline = evaluator.baseline([s for s in mesh_shapes(world) if s[1] > 1]) if wanted - set(done) else 0
    started, evaluated, duplicates = time.monotonic(), 0, 0
    while wanted - set(done):
        interrupts.check()
        if n_trials is not None and evaluated >= n_trials:
            break
        if timeout is not None and time.monotonic() - started >= timeout:
            break
        if exhaustive or duplicates >= 10:  # next open configuration (TPE: it kept proposing finished ones)
            open_key = next(k for k in open_points if k not in done)
            study.enqueue_trial(open_points[open_key], skip_if_exists=True)
            duplicates = 0
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, v) for k, v in ax.as_dict().items()}
        config = config_from(params)
        key = config_key(config)
        trial.set_user_attr("key", key)
        trial.set_user_attr("config", config.model_dump(mode="json"))
        if key in done:  # never run a finished configuration twice
            duplicates += 1
            previous = done[key]
            trial.set_user_attr("duplicate_of", previous.number)
            if previous.state == optuna.trial.TrialState.COMPLETE:
                trial.set_user_attr("feasible", previous.user_attrs.get("feasible"))
                trial.set_constraint("memory", previous.user_attrs.get("excess", 0.0))
                study.tell(trial, previous.value)
            else:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        duplicates = 0
        try:
            frozen = _evaluate(evaluator, study, trial, workload, config, budget, baseline, settings, device, margin,
                               interrupts, screen=confirm)
        except SearchInterrupted:
            if not study._storage.get_trial(trial._trial_id).state.is_finished():
                trial.set_user_attr("reason", INTERRUPTED)  # measured again on resume
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        done[key] = frozen
        evaluated += 1
        if progress is not None:
            progress(record_from(frozen, budget, margin), len(set(done) & wanted), len(wanted))
    cut_short = study.user_attrs.get(racing.RACE_ATTR) == racing.RACING  # a stopped search's race
    if confirm and (evaluated or cut_short):
        _race_leaders(evaluator, study, workload, settings, baseline, budget, margin, interrupts)
    return result_from_study(study, budget=budget, margin=margin, evaluated=evaluated,
                             complete=not (wanted - set(done)), storage=storage)


def result_from_study(study: optuna.Study, *, budget: int | None = None, margin: float | None = None,
                      evaluated: int = 0, complete: bool = True, storage: Any = None) -> SearchResult:
    """A study's result as a search would report it, judged against ``budget`` (default: its last run's)."""
    a = study.user_attrs
    workload = Workload(**a["workload"])
    world, device = a["world_size"], a["device"]
    budget = budget if budget is not None else a["memory_budget"]
    margin = margin if margin is not None else a.get("memory_margin", 0.0)
    trials = _records(study, workload, budget, margin)
    tied, race = _equivalent(trials, a.get(racing.RACE_ATTR))  # one config when the measurements separate it
    chosen = racing.choose(tied, pytorch_default(workload, world, device)) if tied else None
    tied = tied if len(tied) > 1 else []
    nproc = (a.get("environment") or {}).get("nproc_per_node", world)
    where = storage if isinstance(storage, str) else DEFAULT_STORAGE if storage is None else type(storage).__name__
    return SearchResult(study_name=study.study_name, storage=where, workload=workload, world_size=world,
                        device=device, nproc_per_node=nproc, memory_budget=budget, trials=trials,
                        evaluated_now=evaluated, complete=complete, memory_margin=margin,
                        chosen=chosen.number if chosen else None, equivalent=[r.number for r in tied], race=race)


def _equivalent(trials: list[TrialRecord], race: dict | None) -> tuple[list[TrialRecord], dict | None]:
    """The configurations the last race left standing, and that race; without a race that still
    holds (none run, one cut short, or a survivor no longer feasible under this budget), those
    within noise of the leader by their pooled figures, and None."""
    ok = {config_key(r.config): r for r in trials if r.state == "ok" and r.tokens_per_s}
    if race and race.get("survivors") and all(k in ok for k in race["survivors"]):
        return [ok[k] for k in race["survivors"]], race
    leader, rivals = racing.contenders(trials)
    return ([leader, *rivals] if leader else []), None


def _records(study, workload: Workload, budget: int, margin: float) -> list[TrialRecord]:
    """Every configuration's record today: judged against ``budget``, its spread from all its step times."""
    extra = study.user_attrs.get(racing.EXTRA_ATTR, {})
    records = [record_from(t, budget, margin) for t in _finished(study, budget).values()]
    for r in records:
        racing.apply_spread(r, tokens_per_step(workload, r.config), extra.get(config_key(r.config), []))
    return records


def _race_leaders(evaluator, study, workload, settings, baseline, budget, margin, interrupts) -> None:
    """Race the leader and the configs within its spread in paired rounds (see :mod:`.racing`)."""
    leader, rivals = racing.contenders(_records(study, workload, budget, margin))
    if leader is None or not rivals:
        study.set_user_attr(racing.RACE_ATTR, None)  # an earlier race no longer holds
        return
    study.set_user_attr(racing.RACE_ATTR, racing.RACING)  # one cut short decides nothing; a resume races again
    brief = racing.race_round(settings, workload)

    def measure(record: TrialRecord) -> float | None:
        try:
            with interrupts.immediate():
                per_rank = evaluator(workload, record.config, brief)
        except TrialFailed:
            return None
        summary = summarize(per_rank, workload, record.config, baseline)
        extra = dict(study.user_attrs.get(racing.EXTRA_ATTR, {}))
        extra.setdefault(config_key(record.config), []).extend(summary["step_times"])
        study.set_user_attr(racing.EXTRA_ATTR, extra)
        return summary["tokens_per_s"]

    default = pytorch_default(workload, evaluator.world_size, evaluator.device_type)
    study.set_user_attr(racing.RACE_ATTR, racing.race(leader, rivals, config_key, measure,
                                                      pick=lambda alive: racing.choose(alive, default)))


def _frozen(study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    return study._storage.get_trial(trial._trial_id)  # the trial just told, as stored


def _evaluate(evaluator, study, trial, workload, config, budget, baseline, settings, device, margin: float,
              interrupts: Interrupts, screen: bool):
    """Run (or rule out) one trial and tell Optuna; returns the frozen trial."""
    state = optuna.trial.TrialState
    reason = invalid_reason(workload, config, device)
    if reason is not None:
        trial.set_user_attr("reason", f"invalid: {reason}")
        study.tell(trial, state=state.PRUNED)
        return _frozen(study, trial)
    predicted = predict_peak(workload, config, baseline) if workload.predictable else None
    trial.set_user_attr("predicted_bytes", predicted)
    trial.set_user_attr("memory_budget", budget)
    if predicted is not None and predicted > PRUNE_FACTOR * budget:
        trial.set_user_attr("feasible", False)
        trial.set_user_attr("reason", pruned_reason(predicted, budget))
        study.tell(trial, state=state.PRUNED)
        return _frozen(study, trial)
    if isinstance(evaluator, SPMDEvaluator):  # a hang ends the torchrun job: record why first
        def timed_out() -> None:
            trial.set_user_attr("reason", f"timed out after {evaluator.trial_timeout:.0f}s; job ended to relaunch")
            study.tell(trial, state=state.FAIL)
        evaluator.on_timeout = timed_out
    try:
        with interrupts.immediate():
            per_rank = evaluator(workload, config, racing.screening(settings) if screen else settings)
    except TrialFailed as exc:
        trial.set_user_attr("reason", exc.reason)
        trial.set_user_attr("feasible", False)
        study.tell(trial, state=state.FAIL)
        return _frozen(study, trial)
    summary = summarize(per_rank, workload, config, baseline)
    feasible = summary["peak_bytes"] * (1 + margin) <= budget  # worst rank, whole trial, plus the margin
    for k, v in summary.items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("feasible", feasible)
    trial.set_user_attr("excess", float(summary["peak_bytes"] - budget) / budget)
    trial.set_constraint("memory", float(summary["peak_bytes"] - budget) / budget)
    if not feasible:
        trial.set_user_attr("reason", over_budget_reason(summary["peak_bytes"], budget, margin))
    study.tell(trial, summary["tokens_per_s"])
    return _frozen(study, trial)


__all__ = ["get_storage", "default_study_name", "environment", "result_from_study"]
