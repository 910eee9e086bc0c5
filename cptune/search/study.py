"""The Optuna study behind a search: where it lives, its name, what it answers, and its result read back.

Optuna's public API serves everywhere but one place: marking a trial that a dead driver left
RUNNING as interrupted needs a user attribute set on a trial that is not this process's own
``Trial``, which only the storage can do (:func:`_mark_interrupted`, the one private use).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import optuna

from ..config import CPConfig
from ..errors import Problem, ValidationError
from ..models import config_path
from ..workload import Workload
from . import racing
from .measure import tokens_per_step
from .memory import PRUNE_FACTOR
from .records import DOMINATED_ATTR, INTERRUPTED, PLAN_ATTR, TrialRecord, dominating, record_from
from .result import SearchResult
from .settings import MeasureSettings
from ..workload import MEMORY_MARGIN
from .space import pytorch_default

DEFAULT_STORAGE = "sqlite:///cptune.db"


def get_storage(storage: None | str | optuna.storages.BaseStorage,
                must_exist: bool = False) -> optuna.storages.BaseStorage:
    """None: a local SQLite file; a URL (sqlite, postgresql, ...); or an Optuna storage object. ``must_exist``
    (a reader): a SQLite file that is not there is an error, not a new empty database."""
    if storage is None:
        storage = DEFAULT_STORAGE
    if must_exist and isinstance(storage, str) and storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///"):].split("?")[0])
        if str(path) != ":memory:" and not path.is_file():
            raise ValidationError([Problem("storage", f"{storage!r}: there is no file {path}",
                                           "give the storage the search wrote (default sqlite:///cptune.db, in the "
                                           "folder the search ran in)")])
    try:
        return optuna.storages.get_storage(storage)
    except Exception as exc:  # noqa: BLE001 - optuna raises many kinds for a bad URL
        raise ValidationError([Problem("storage", f"cannot open {storage!r}: {exc}",
                                       "give a URL like sqlite:///cptune.db or postgresql://user@host/db")]) from None


def question(workload: Workload, settings: MeasureSettings, env: dict[str, Any], tp: tuple[int, ...] = (1,)
             ) -> dict[str, Any]:
    """What a study answers: the workload (a model's by its config's content too, not only its path), how it
    is measured, and where (``Environment.study()``); with tensor parallelism, the tp degrees its space holds (a
    study's axes cannot change between runs; left out at tp 1, so the studies before it keep their names)."""
    asked = {"workload": workload.question(), "settings": settings.model_dump(mode="json"), "environment": env}
    if workload.model:
        asked["model_config"] = hashlib.sha256(config_path(workload.model).read_bytes()).hexdigest()[:16]
    if tuple(tp) != (1,):
        asked["tp"] = list(tp)
    return asked


def default_study_name(workload: Workload, world_size: int, device_type: str, settings: MeasureSettings,
                       env: dict[str, Any], tp: tuple[int, ...] = (1,)) -> str:
    """Readable, plus a short hash of everything that changes the answer: the whole workload,
    the measurement settings and the environment (torch, cptune, device, ranks per node, nodes), and ``-tpN`` when
    the space holds tensor parallelism up to N (:func:`question`)."""
    kv = f"-kv{workload.kv_heads}" if workload.kv_heads else ""
    step = f"-{workload.step.replace(':', '.')}" if workload.step else ""
    step += f"-{config_path(workload.model).parent.name or 'model'}" if workload.model else ""
    step += ("-compiled" if workload.compile else "") + (f"-ac{workload.ac}" if workload.ac != "none" else "")
    layers = f"-L{workload.layers}" if workload.layers != 1 else ""
    layers += (f"-docs{workload.documents.replace(',', '_')[:24]}" if workload.documents else "") + \
        (f"-w{workload.window}" if workload.window is not None else "")
    digest = hashlib.sha256(json.dumps(question(workload, settings, env, tp), sort_keys=True).encode()).hexdigest()[:8]
    return (f"cptune-{device_type}{world_size}-S{workload.seq_len}-B{workload.batch}-H{workload.heads}{kv}"
            f"-D{workload.head_dim}{layers}-{workload.dtype}-{'causal' if workload.causal else 'full'}{step}"
            + (f"-tp{max(tp)}" if max(tp) > 1 else "") + f"-{digest}")


def open_study(storage, name: str, asked: dict[str, Any], world: int, device: str, budget: int,
               seed: int | None, margin: float = MEMORY_MARGIN) -> optuna.Study:
    """Create or resume study ``name`` for the question ``asked``; another question's study is refused."""
    # Exhaustive search enqueues every open configuration in turn; TPE (with the memory
    # constraint) proposes the rest when the space is large.
    chosen = optuna.samplers.TPESampler(seed=seed)  # reads each trial's "memory" constraint
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=chosen,
                                load_if_exists=True)
    attrs = study.user_attrs
    if attrs.get("workload") is None:
        for key, value in asked.items():
            study.set_user_attr(key, value)
        study.set_user_attr("world_size", world)
        study.set_user_attr("device", device)
    else:
        changes = [f"{field} {old!r} -> {new!r}" for part in ("workload", "settings", "environment")
                   for field, old, new in _changed(attrs.get(part) or {}, asked[part])]
        if attrs.get("world_size") != world:
            changes.append(f"world size {attrs.get('world_size')} -> {world}")
        if attrs.get("tp", [1]) != asked.get("tp", [1]):
            changes.append(f"tensor-parallel degrees {attrs.get('tp', [1])} -> {asked.get('tp', [1])}")
        if changes:
            raise ValidationError([Problem("study_name", f"study {name!r} was measured for another question "
                                           f"({'; '.join(changes)})", "leave --study-name out (each question "
                                           "gets its own study), or give a new name")])
    study.set_user_attr("memory_budget", budget)
    study.set_user_attr("memory_margin", margin)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # One driver per study at a time: a trial still RUNNING was left by a driver that died.
        _mark_interrupted(study, t)
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    return study


def _mark_interrupted(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Record on a RUNNING trial of another process that the search stopped during it (measured again on resume).

    The one private Optuna use: a user attribute can be set through the public API only on the
    ``Trial`` this process asked for, and this trial was asked for by a driver that died.
    """
    study._storage.set_trial_user_attr(trial._trial_id, "reason", INTERRUPTED)


def running(study: optuna.Study, number: int) -> bool:
    """Whether trial ``number`` has not been told yet."""
    return any(t.number == number for t in study.get_trials(deepcopy=False,
                                                             states=(optuna.trial.TrialState.RUNNING,)))


def _changed(stored: dict, now: dict) -> list[tuple[str, Any, Any]]:
    return [(k, stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)]


_PREFERENCE = {optuna.trial.TrialState.COMPLETE: 2, optuna.trial.TrialState.FAIL: 1,
               optuna.trial.TrialState.PRUNED: 0}


def finished(study: optuna.Study, budget: int | None = None, rerun_skipped: bool = False,
             margin: float = MEMORY_MARGIN) -> dict[str, optuna.trial.FrozenTrial]:
    """The trial that answers each configuration today, by config key.

    Not answered (so run again): a trial interrupted by a stopped search, one ruled out by
    its predicted peak under an earlier, tighter budget that the current ``budget`` admits, one
    skipped as dominated whose less checkpointed configuration no longer fits ``budget`` with
    ``margin``, and with ``rerun_skipped`` (``--exhaustive``) one the plan skipped or dominated.
    Of several, a measurement wins over a failure over a ruling-out, and the latest wins.
    """
    done: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if not t.state.is_finished() or "key" not in a or "duplicate_of" in a:
            continue
        if t.state == optuna.trial.TrialState.FAIL and a.get("reason") == INTERRUPTED:
            continue
        if rerun_skipped and (a.get("plan_skipped") or a.get(DOMINATED_ATTR)):
            continue
        predicted = a.get("predicted_bytes")
        if (budget is not None and t.state == optuna.trial.TrialState.PRUNED and predicted is not None
                and predicted <= PRUNE_FACTOR * budget):
            continue
        previous = done.get(a["key"])
        if previous is None or (_PREFERENCE[t.state], t.number) > (_PREFERENCE[previous.state], previous.number):
            done[a["key"]] = t
    if budget is not None:  # a dominated config stands only while what dominates it still fits
        for key, t in list(done.items()):
            a = t.user_attrs
            if a.get(DOMINATED_ATTR) and dominating(CPConfig(**a["config"]), a.get("ac"), done, budget, margin) is None:
                del done[key]
    return done


def records(study: optuna.Study, workload: Workload, budget: int, margin: float) -> list[TrialRecord]:
    """Every configuration's record today: judged against ``budget``, its spread from all its step times."""
    extra = study.user_attrs.get(racing.EXTRA_ATTR, {})
    found = [record_from(t, budget, margin) for t in finished(study, budget, margin=margin).values()]
    for r in found:
        racing.apply_spread(r, tokens_per_step(workload, r.config), extra.get(r.key, []))
    return found


def result_from_study(study: optuna.Study, *, budget: int | None = None, margin: float | None = None,
                      evaluated: int = 0, complete: bool = True, storage: Any = None) -> SearchResult:
    """A study's result as a search would report it, judged against ``budget`` (default: its last run's)."""
    a = study.user_attrs
    workload = Workload(**a["workload"])
    world, device = a["world_size"], a["device"]
    budget = budget if budget is not None else a["memory_budget"]
    margin = margin if margin is not None else a.get("memory_margin", 0.0)
    trials = records(study, workload, budget, margin)
    plan = a.get(PLAN_ATTR) or {}
    for r in trials:
        r.plan_tps = plan.get("tokens_per_s", {}).get(r.key)
    tied, race = _equivalent(trials, a.get(racing.RACE_ATTR))  # one config when the measurements separate it
    chosen = racing.choose(tied, pytorch_default(workload, world, device)) if tied else None
    tied = tied if len(tied) > 1 else []
    nproc = (a.get("environment") or {}).get("nproc_per_node", world)
    where = storage if isinstance(storage, str) else DEFAULT_STORAGE if storage is None else type(storage).__name__
    return SearchResult(study_name=study.study_name, storage=where, workload=workload, world_size=world,
                        device=device, nproc_per_node=nproc, memory_budget=budget, trials=trials,
                        evaluated_now=evaluated, complete=complete, memory_margin=margin,
                        chosen=chosen.number if chosen else None, equivalent=[r.number for r in tied], race=race,
                        plan_calibration=plan.get("calibration"))


def _equivalent(trials: list[TrialRecord], race: dict | None) -> tuple[list[TrialRecord], dict | None]:
    """The configurations the last race left standing, and that race; without a race that still
    holds (none run, one cut short, or a survivor no longer feasible under this budget), those
    within noise of the leader by their pooled figures, and None."""
    ok = {r.key: r for r in trials if r.state == "ok" and r.tokens_per_s}
    if race and race.get("survivors") and all(k in ok for k in race["survivors"]):
        return [ok[k] for k in race["survivors"]], race
    leader, rivals = racing.contenders(trials)
    return ([leader, *rivals] if leader else []), None
