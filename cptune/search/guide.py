"""The plan inside a search: trials in predicted order, the model recalibrated after each, and a config skipped
when the calibrated model says, beyond its own measured error, that it cannot fit or cannot come near the best.

The rule (``skip``): once ``MIN_TRIALS`` configurations are measured, the step model is calibrated on
them (:func:`cptune.plan.calibrate`) and its error is the worst leave-one-out relative error over
them, ``e``. A configuration is skipped when its calibrated prediction x (1 + e) is still below
(1 - INDIFFERENCE) x the best measured figure taken at the low end of its noise range (the racing
module's: at least -15 % from few steps), or its calibrated peak x (1 - e_memory) is still above
the budget. It is recorded as "skipped by plan: ..." with the figures; ``--exhaustive`` runs it.
"""

from __future__ import annotations

from ..config import CPConfig
from ..errors import CPTuneError, Problem, ValidationError
from ..plan import Calibration, Point, Prediction, calibrate, predict
from ..plan import dims_from_workload, for_device
from ..sizes import format_rate, format_size
from ..workload import Workload
from .memory import PRUNE_FACTOR
from .racing import INDIFFERENCE
from ..plan import AC_MODES, config_key
from .space import all_configs

MIN_TRIALS = 3
"""Measured trials before the plan may skip anything (its error is a leave-one-out error: 3 at least)."""
SKIPPED = "skipped by plan"


class Guide:
    """Predictions for one study's configurations on the machine at hand, calibrated as trials come in."""

    def __init__(self, workload: Workload, device_type: str, device_name: str, nproc_per_node: int,
                 budget: int, baseline: int) -> None:
        try:
            self.dims = dims_from_workload(workload)
        except (ValidationError, CPTuneError):  # a model the plan cannot read: the search runs unguided
            self.dims = None
        hw = for_device(device_type, device_name)
        self.hw = hw.model_copy(update={"baseline": max(1, int(baseline))}) if baseline else hw
        self.workload, self.nproc_per_node, self.budget = workload, nproc_per_node, budget
        self._raw: dict[str, Prediction] = {}
        self._seen: dict[str, tuple[Prediction, float, int | None]] = {}
        self.calibration = Calibration()

    def raw(self, key: str, config: CPConfig, ac: str | None) -> Prediction | None:
        if self.dims is None:
            return None
        if key not in self._raw:
            w = self.workload.model_copy(update={"ac": ac}) if ac else self.workload
            point = Point(config, w.ac, sync="fsdp" if w.model is not None else "none")  # as steps.py builds them
            self._raw[key] = predict(self.dims, w, point, self.hw, self.nproc_per_node, self.budget,
                                     optimizer=w.model is not None)
        return self._raw[key]

    def predicted(self, key: str, config: CPConfig, ac: str | None) -> Prediction | None:
        raw = self.raw(key, config, ac)
        return None if raw is None else self.calibration.apply(raw)

    def observe(self, key: str, config: CPConfig, ac: str | None, step_s: float | None, peak: int | None) -> None:
        """A measured trial: recalibrate on every one so far."""
        raw = self.raw(key, config, ac)
        if raw is None or not step_s:
            return
        self._seen[key] = (raw, step_s, peak)
        seen = list(self._seen.values())
        self.calibration = calibrate([s[0] for s in seen], [s[1] for s in seen], [s[2] for s in seen])

    def calibrated(self) -> dict | None:
        """The model as calibrated on every trial measured so far, for the study to keep: how, its error, and the
        calibrated tokens/s of every configuration predicted (None before any trial is measured)."""
        if not self.calibration.trials:
            return None
        return {"calibration": self.calibration.describe(), "error": self.calibration.error,
                "trials": self.calibration.trials,
                "tokens_per_s": {key: self.calibration.apply(raw).tokens_per_s for key, raw in self._raw.items()}}

    def order(self, candidates: dict[str, tuple[CPConfig, str | None]]) -> list[str]:
        """Keys by calibrated predicted tokens/s, highest first (unpredictable ones last, in their order)."""
        def score(key: str) -> float:
            p = self.predicted(key, *candidates[key])
            return -(p.tokens_per_s if p is not None else 0.0)
        return sorted(candidates, key=score)

    def skip(self, key: str, config: CPConfig, ac: str | None, best_tps: float | None) -> str | None:
        """Why the calibrated plan rules this configuration out, or None (see the module's rule); ``best_tps``:
        the best measured figure at the low end of its noise range."""
        cal = self.calibration
        if len(self._seen) < MIN_TRIALS or cal.error is None:
            return None
        p = self.predicted(key, config, ac)
        if p is None:
            return None
        err = cal.error
        if best_tps and p.tokens_per_s * (1 + err) < best_tps * (1 - INDIFFERENCE):
            return (f"{SKIPPED}: predicted {format_rate(p.tokens_per_s)} tokens/s, calibrated error {err:.0%}; "
                    f"at best {format_rate(p.tokens_per_s * (1 + err))}, below {1 - INDIFFERENCE:.0%} of the best measured "
                    f"at the low end of its noise ({format_rate(best_tps)})")
        mem_err = cal.memory_error
        if mem_err is not None and p.peak_bytes * (1 - mem_err) > self.budget:
            return (f"{SKIPPED}: predicted peak {format_size(p.peak_bytes)}, calibrated error {mem_err:.0%}; at "
                    f"least {format_size(p.peak_bytes * (1 - mem_err))} > budget {format_size(self.budget)}")
        return None


def unfit_problem(workload: Workload, device_type: str, device_name: str, world: int, nproc_per_node: int,
                  budget: int) -> Problem | None:
    """A model that no configuration of the space fits even sharded over ``world`` ranks, by the plan's memory
    model (FSDP2 over all ranks: parameters, gradients, AdamW states, gathered layers, activations): every
    prediction above PRUNE_FACTOR x ``budget``, the line beyond which a trial is not run. Said before any rank
    builds the model."""
    if workload.model is None:
        return None
    guide = Guide(workload, device_type, device_name, nproc_per_node, budget, 0)
    if guide.dims is None:
        return None
    modes = AC_MODES if workload.ac == "auto" else (None,)
    predictions = [guide.raw(config_key(c, ac), c, ac) for c in all_configs(workload, world, device_type) for ac in modes]
    best = min(predictions, key=lambda p: p.peak_bytes, default=None)
    if best is None or best.peak_bytes <= PRUNE_FACTOR * budget:
        return None
    m = best.memory
    states = m["parameters"] + m["gradients"] + m["optimizer"]
    return Problem("memory_budget", f"{format_size(budget)} per rank cannot hold {workload.model} even sharded over "
                   f"{world} ranks: the smallest predicted peak is {format_size(best.peak_bytes)} "
                   f"({best.point.config.label()}, ac={best.point.ac}; parameters, gradients and AdamW states alone "
                   f"{format_size(states)}), over {PRUNE_FACTOR} x the budget",
                   "run on more ranks (--nproc, or more nodes), shrink the model (--model-override "
                   "num_hidden_layers=N) or the sequence (--seq-len), or give a larger --memory-budget")
