"""``cptune.search``: an Optuna study over the CP space, evaluated on real ranks."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import optuna
import torch.distributed as dist

from ..errors import Problem, ValidationError
from .evaluate import LocalEvaluator, MeasureFn, SPMDEvaluator, TrialFailed
from .measure import MeasureSettings, measure_on_rank, summarize
from .memory import PRUNE_FACTOR, default_budget, format_size, parse_size, predict_peak
from .result import SearchResult, TrialRecord, record_from
from .space import axes, config_from, config_key, invalid_reason, mesh_shapes
from .workload import Workload

GRID_LIMIT = 64
"""Spaces with at most this many distinct configurations are searched exhaustively; larger ones by TPE."""
DEFAULT_STORAGE = "sqlite:///cptune.db"
CONFIRM_MARGIN = 0.10
"""When the two fastest feasible configs are this close, both are measured once more."""

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


def default_study_name(workload: Workload, world_size: int, device_type: str) -> str:
    kv = f"-kv{workload.kv_heads}" if workload.kv_heads else ""
    step = f"-{workload.step.replace(':', '.')}" if workload.step else ""
    step += ("-compiled" if workload.compile else "") + (f"-ac{workload.ac}" if workload.ac != "none" else "")
    return (f"cptune-{device_type}{world_size}-S{workload.seq_len}-B{workload.batch}-H{workload.heads}{kv}"
            f"-D{workload.head_dim}-{workload.dtype}-{'causal' if workload.causal else 'full'}{step}")


def _open_study(storage, name: str, workload: Workload, world: int, device: str, budget: int,
                seed: int | None) -> optuna.Study:
    # Exhaustive search enqueues every open configuration in turn; TPE (with the memory
    # constraint) proposes the rest when the space is large.
    chosen = optuna.samplers.TPESampler(seed=seed)  # reads each trial's "memory" constraint
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=chosen,
                                load_if_exists=True)
    stored = study.user_attrs.get("workload")
    if stored is None:
        study.set_user_attr("workload", workload.model_dump(mode="json"))
        study.set_user_attr("world_size", world)
        study.set_user_attr("device", device)
    elif stored != workload.model_dump(mode="json") or study.user_attrs.get("world_size") != world:
        raise ValidationError([Problem("--study-name", f"study {name!r} was made for another workload or world "
                                       f"size ({stored}, world {study.user_attrs.get('world_size')})",
                                       "use a new --study-name, or the workload and --nproc the study was made for")])
    study.set_user_attr("memory_budget", budget)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # One driver per study at a time: a trial still RUNNING was left by a driver that died.
        study._storage.set_trial_user_attr(t._trial_id, "reason", "the search stopped during this trial")
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    return study


def _finished(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    done = {}
    for t in study.get_trials(deepcopy=False):
        if t.state.is_finished() and "key" in t.user_attrs and "duplicate_of" not in t.user_attrs:
            done.setdefault(t.user_attrs["key"], t)
    return done


def _run_search(evaluator, workload: Workload, *, budget: int, storage, study_name: str | None,
                n_trials: int | None, timeout: float | None, sampler: str, seed: int | None,
                settings: MeasureSettings, progress: Progress | None, confirm: bool = True) -> SearchResult:
    world, device = evaluator.world_size, evaluator.device_type
    storage_obj = get_storage(storage)
    name = study_name or default_study_name(workload, world, device)
    study = _open_study(storage_obj, name, workload, world, device, budget, seed)
    ax = axes(workload, world, device)
    done = _finished(study)
    open_points: dict[str, dict] = {}  # one parameter set per distinct configuration, in search order
    for p in itertools.product(*ax.as_dict().values()):
        params = dict(zip(ax.as_dict(), p))
        open_points.setdefault(config_key(config_from(params)), params)
    wanted = set(open_points)
    exhaustive = sampler == "grid" or (sampler == "auto" and len(wanted) <= GRID_LIMIT)
    baseline = evaluator.baseline([s for s in mesh_shapes(world) if s[1] > 1]) if wanted - set(done) else 0
    started, evaluated, duplicates = time.monotonic(), 0, 0
    while wanted - set(done):
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
        frozen = _evaluate(evaluator, study, trial, workload, config, budget, baseline, settings, device)
        done[key] = frozen
        evaluated += 1
        if progress is not None:
            progress(record_from(frozen), len(set(done) & wanted), len(wanted))
    if evaluated and not workload.step and confirm:
        _confirm_close_call(evaluator, study, workload, settings, baseline)
    trials = [record_from(t) for t in _finished(study).values()]
    confirmations = study.user_attrs.get("confirmations", {})
    for r in trials:
        extra = confirmations.get(config_key(r.config), [])
        if r.state == "ok" and extra:
            r.tokens_per_s = statistics.median([r.tokens_per_s, *extra])
            r.measurements += len(extra)
    return SearchResult(study_name=name, storage=storage if isinstance(storage, str) else
                        DEFAULT_STORAGE if storage is None else type(storage).__name__, workload=workload, world_size=world, device=device,
                        nproc_per_node=evaluator.nproc_per_node, memory_budget=budget, trials=trials,
                        evaluated_now=evaluated, complete=not (wanted - set(done)))


def _confirm_close_call(evaluator, study, workload, settings, baseline: int) -> None:
    """If the two fastest feasible configs are within CONFIRM_MARGIN, measure each once more.

    One noisy measurement should not decide between near-equals; the pooled median does.
    The extra figures live in the study's "confirmations" attribute (finished trials are final).
    """
    ok = sorted((record_from(t) for t in _finished(study).values()), key=lambda r: -(r.tokens_per_s or 0))
    ok = [r for r in ok if r.state == "ok"]
    if len(ok) < 2 or ok[1].tokens_per_s < (1 - CONFIRM_MARGIN) * ok[0].tokens_per_s:
        return
    extra = dict(study.user_attrs.get("confirmations", {}))
    for r in ok[:2]:
        try:
            summary = summarize(evaluator(workload, r.config, settings), workload, r.config, baseline)
        except TrialFailed:
            continue
        extra.setdefault(config_key(r.config), []).append(summary["tokens_per_s"])
    study.set_user_attr("confirmations", extra)


def _frozen(study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    return study._storage.get_trial(trial._trial_id)  # the trial just told, as stored


def _evaluate(evaluator, study, trial, workload, config, budget, baseline, settings, device):
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
        trial.set_user_attr("reason", f"predicted peak {format_size(predicted)} > {PRUNE_FACTOR} x budget "
                                      f"{format_size(budget)}; not run")
        study.tell(trial, state=state.PRUNED)
        return _frozen(study, trial)
    if isinstance(evaluator, SPMDEvaluator):  # a hang ends the torchrun job: record why first
        def timed_out() -> None:
            trial.set_user_attr("reason", f"timed out after {evaluator.trial_timeout:.0f}s; job ended to relaunch")
            study.tell(trial, state=state.FAIL)
        evaluator.on_timeout = timed_out
    try:
        per_rank = evaluator(workload, config, settings)
    except TrialFailed as exc:
        trial.set_user_attr("reason", exc.reason)
        trial.set_user_attr("feasible", False)
        study.tell(trial, state=state.FAIL)
        return _frozen(study, trial)
    summary = summarize(per_rank, workload, config, baseline)
    feasible = summary["peak_bytes"] <= budget
    for k, v in summary.items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("feasible", feasible)
    trial.set_user_attr("excess", float(summary["peak_bytes"] - budget) / budget)
    trial.set_constraint("memory", float(summary["peak_bytes"] - budget) / budget)
    if not feasible:
        trial.set_user_attr("reason", f"measured peak {format_size(summary['peak_bytes'])} > budget "
                                      f"{format_size(budget)}")
    study.tell(trial, summary["tokens_per_s"])
    return _frozen(study, trial)


def search(
    workload: Workload | dict | None = None,
    *,
    nproc: int | None = None,
    memory_budget: str | int | None = None,
    storage: None | str | optuna.storages.BaseStorage = None,
    study_name: str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float = 300.0,
    sampler: str = "auto",
    seed: int | None = 0,
    settings: MeasureSettings | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    measure: MeasureFn = measure_on_rank,
    confirm: bool = True,
) -> SearchResult | None:
    """Find the fastest configuration that fits in ``memory_budget`` for ``workload``, measured on real ranks.

    Outside torch.distributed, launches ``nproc`` local ranks (gloo on CPU, nccl with
    ``device='cuda'``) and drives the study from this process. With ``confirm``, a close call
    between the two fastest feasible configs is measured once more before choosing. Inside a torchrun job (the
    process group already initialized), every rank must call it: rank 0 drives and gets the
    result, the other ranks serve trials and get None.
    """
    workload = workload if isinstance(workload, Workload) else Workload(**(workload or {}))
    settings = settings or MeasureSettings()
    if sampler not in ("auto", "grid", "tpe"):
        raise ValidationError([Problem("sampler", f"unknown sampler {sampler!r}", "use 'auto', 'grid' or 'tpe'")])
    kwargs: dict[str, Any] = dict(storage=storage, study_name=study_name, n_trials=n_trials, timeout=timeout,
                                  sampler=sampler, seed=seed, settings=settings, progress=progress, confirm=confirm)
    if dist.is_initialized():
        evaluator = SPMDEvaluator(trial_timeout, measure)
        if dist.get_rank() != 0:
            evaluator.follow()
            return None
    else:
        device = device or "cpu"
        if device not in ("cpu", "cuda"):
            raise ValidationError([Problem("--device", f"unknown device {device!r}", "use cpu or cuda")])
        if nproc is None:
            import torch

            nproc = torch.cuda.device_count() if device == "cuda" else 2
        if nproc < 1:
            raise ValidationError([Problem("--nproc", f"{nproc} ranks", "use --nproc 1 or more")])
        evaluator = LocalEvaluator(nproc, device, trial_timeout, measure)
    try:
        budget = parse_size(memory_budget) if memory_budget is not None else \
            default_budget(evaluator.device_type, evaluator.nproc_per_node)
        return _run_search(evaluator, workload, budget=budget, **kwargs)
    finally:
        evaluator.close()


__all__ = ["search", "get_storage", "default_study_name"]
