"""One configuration's trial as the search reads it back from the study: measured, ruled out, or failed."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import optuna

from ..config import CPConfig
from ..sizes import format_rate, format_size
from ..plan import AC_MODES, config_key
from .memory import PRUNE_FACTOR


@dataclass
class TrialRecord:
    number: int
    config: CPConfig
    state: str  # "ok", "infeasible", "invalid", "failed", "skipped" (by the plan, or dominated)
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_bytes: int | None = None
    predicted_bytes: int | None = None
    peak_per_rank: list[int] | None = None
    feasible: bool | None = None
    reason: str = ""
    measurements: int = 1  # tokens_per_s is the median of this many measurements
    compile_s: float | None = None  # torch.compile time of the first step, kept out of tokens_per_s
    headroom: float | None = None  # (budget - worst peak) / budget, for the current budget
    step_times: list[float] | None = None  # the slowest rank's time per timed step
    tps_low: float | None = None  # tokens/s interquartile range over the steps
    tps_high: float | None = None
    warmup_tps: float | None = None  # tokens/s of the warm-up step (with torch.compile: compiling included)
    ac: str | None = None  # the activation checkpointing it ran with, when the search tries several (--ac auto)
    plan_tps: float | None = None  # the plan's tokens/s, calibrated on all of the study's measured trials
    plan_peak: int | None = None

    @property
    def key(self) -> str:
        return config_key(self.config, self.ac)

    @property
    def label(self) -> str:
        return self.config.label() + (f" ac-{self.ac}" if self.ac else "")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config.model_dump(mode="json")
        d["label"] = self.label
        return d


INTERRUPTED = "the search stopped during this trial"
PLAN_ATTR = "plan_calibrated"
"""Study attribute: the step model calibrated on every measured trial at the end of the last run (``calibration``:
how, ``error``: its worst leave-one-out error, ``tokens_per_s``: config key -> calibrated tokens/s)."""


def fits(peak: int, budget: int, margin: float) -> bool:
    """The feasibility rule: a worst peak x (1 + ``margin``) within ``budget``."""
    return peak * (1 + margin) <= budget


DOMINATED_ATTR = "dominated_by"
"""Trial attribute: the key of the measured configuration that makes this one not worth running (:func:`dominating`)."""


def dominating(config: CPConfig, ac: str | None, done: dict[str, optuna.trial.FrozenTrial], budget: int,
               margin: float) -> optuna.trial.FrozenTrial | None:
    """The measured trial of the same configuration with less activation checkpointing that fits ``budget`` with
    ``margin``, or None. Checkpointing trades time for memory: a mode that recomputes more runs the same step plus
    its recompute (the same kernels, the same communication) and only saves memory, so once a mode that
    recomputes less is measured to fit, the ones that recompute more cannot be faster and are not run."""
    if ac not in AC_MODES:
        return None
    for less in AC_MODES[:AC_MODES.index(ac)]:
        t = done.get(config_key(config, less))
        if t is not None and t.state == optuna.trial.TrialState.COMPLETE:
            peak = t.user_attrs.get("peak_bytes")
            if peak is not None and fits(peak, budget, margin):
                return t
    return None


def dominated_reason(by: optuna.trial.FrozenTrial, ac: str, margin: float, budget: int) -> str:
    a = by.user_attrs
    return (f"skipped: ac-{a.get('ac')} of the same configuration measured {format_rate(by.value)} tokens/s and fits "
            f"(peak {format_size(a['peak_bytes'])}{f' + {margin:.0%} margin' if margin else ''} <= budget "
            f"{format_size(budget)}); ac-{ac} recomputes more of the same step and only saves memory")


def over_budget_reason(peak: int, budget: int, margin: float) -> str:
    with_margin = f" + {margin:.0%} margin" if margin else ""
    return f"measured peak {format_size(peak)}{with_margin} > budget {format_size(budget)}"


def pruned_reason(predicted: int, budget: int) -> str:
    return f"predicted peak {format_size(predicted)} > {PRUNE_FACTOR} x budget {format_size(budget)}; not run"


def record_from(t: optuna.trial.FrozenTrial, budget: int | None = None, margin: float = 0.0) -> TrialRecord:
    """A finished trial, judged against ``budget`` (the current run's; None: as stored when it ran).

    A measured trial is feasible when its worst peak over ranks and repeats, plus ``margin``,
    fits the budget; one ruled out by its predicted peak says so against today's budget.
    """
    a = t.user_attrs
    reason = a.get("reason", "")
    feasible = a.get("feasible")
    peak = a.get("peak_bytes")
    if t.state == optuna.trial.TrialState.COMPLETE and budget is not None and peak is not None:
        feasible = fits(peak, budget, margin)
        reason = "" if feasible else over_budget_reason(peak, budget, margin)
    if t.state == optuna.trial.TrialState.COMPLETE:
        state = "ok" if feasible else "infeasible"
    elif reason.startswith("invalid"):
        state = "invalid"
    elif a.get("plan_skipped") or a.get(DOMINATED_ATTR):
        state = "skipped"
    elif t.state == optuna.trial.TrialState.PRUNED:
        state = "infeasible"
        if budget is not None and a.get("predicted_bytes") is not None:
            reason = pruned_reason(a["predicted_bytes"], budget)
    else:
        state = "failed"
        reason = reason or f"trial ended {t.state.name.lower()} without a reason (driver stopped?)"
    headroom = (budget - peak) / budget if budget and peak is not None else None
    return TrialRecord(number=t.number, config=CPConfig(**a["config"]), state=state,
                       tokens_per_s=t.value if t.state == optuna.trial.TrialState.COMPLETE else None,
                       step_time_s=a.get("step_time_s"), peak_bytes=peak,
                       predicted_bytes=a.get("predicted_bytes"), peak_per_rank=a.get("peak_per_rank"),
                       feasible=feasible, reason=reason, compile_s=a.get("compile_s"), headroom=headroom,
                       step_times=a.get("step_times"), warmup_tps=a.get("warmup_tokens_per_s"), ac=a.get("ac"),
                       plan_peak=a.get("plan_peak_bytes"))
