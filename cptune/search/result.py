"""What a search returns: every trial of the study, ranked, and the best feasible configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sizes import format_rate, format_size
from ..workload import Workload
from .racing import INDIFFERENCE, TIE_RULE, summary
from .records import TrialRecord


@dataclass
class SearchResult:
    study_name: str
    storage: str | None
    workload: Workload
    world_size: int
    device: str
    nproc_per_node: int
    memory_budget: int
    trials: list[TrialRecord] = field(default_factory=list)
    memory_margin: float = 0.0
    chosen: int | None = None  # the trial picked: the fastest, or by the tie rule among equivalents
    equivalent: list[int] = field(default_factory=list)  # trials the measurements cannot tell apart
    race: dict | None = None  # the paired race that decided (see racing.race), by config key
    evaluated_now: int = 0
    complete: bool = False
    plan_calibration: str | None = None  # how the plan column's model was calibrated (None: no plan column)
    check: str | None = None  # a --model's first-step check, run before the trials (None: a proven family, or none)

    @property
    def ranked(self) -> list[TrialRecord]:
        """Feasible trials fastest first, then the rest."""
        def order(r: TrialRecord) -> tuple:
            return (r.state != "ok", -(r.tokens_per_s or 0.0), r.number)
        return sorted(self.trials, key=order)

    @property
    def best(self) -> TrialRecord | None:
        if self.chosen is not None:
            return next(r for r in self.trials if r.number == self.chosen)
        ok = [r for r in self.trials if r.state == "ok"]
        return max(ok, key=lambda r: r.tokens_per_s) if ok else None

    @property
    def tie(self) -> list[TrialRecord]:
        return [r for r in self.trials if r.number in self.equivalent]

    def why_nothing(self) -> str:
        if not self.trials:
            return "no trial ran (raise --n-trials or --timeout)"
        lines = [f"  {r.label}: {r.state} ({r.reason})" for r in self.ranked]
        states = {r.state for r in self.trials}
        if states == {"invalid"}:
            head = f"no configuration is valid for {self.workload.describe()} on {self.world_size} ranks"
        elif states <= {"failed", "invalid"}:
            head = "every configuration that ran failed (see each reason below)"
        elif "infeasible" in states:
            margin = f" with a {self.memory_margin:.0%} margin" if self.memory_margin else ""
            head = f"no configuration fits the memory budget {format_size(self.memory_budget)}{margin}"
        else:
            head = "no configuration finished yet (raise --n-trials or --timeout)"
        if not self.complete:
            head += f" among the {len(self.trials)} tried so far (the others are untried: raise --n-trials or --timeout)"
        return head + ":\n" + "\n".join(lines)

    def table(self) -> str:
        compiled = self.workload.compile
        extra = f" {'compile':>8}" if compiled else ""
        head = (f"{'#':>3}  {'config':<34} {'tokens/s':>10} {'plan':>10} {'IQR':>15} {'n':>3} {'peak':>10} {'headroom':>8} "
                f"{'predicted':>10}{extra}  {'feasible':<8} reason")
        lines = [head, "-" * len(head)]
        for r in self.ranked:
            tps = format_rate(r.tokens_per_s) if r.tokens_per_s else "-"
            plan = format_rate(r.plan_tps) if r.plan_tps else "-"
            spread = f"{format_rate(r.tps_low)}-{format_rate(r.tps_high)}" if r.tps_low is not None else "-"
            feasible = {True: "yes", False: "no", None: "-"}[r.feasible]
            comp = (f" {r.compile_s:>7.1f}s" if r.compile_s is not None else f" {'-':>8}") if compiled else ""
            room = f"{r.headroom:.0%}" if r.headroom is not None else "-"
            mark = "*" if r.number in self.equivalent else " "
            lines.append(f"{r.number:>3}{mark} {r.label:<34} {tps:>10} {plan:>10} {spread:>15} {r.measurements:>3} "
                         f"{format_size(r.peak_bytes):>10} {room:>8} "
                         f"{format_size(r.predicted_bytes or r.plan_peak):>10}{comp}  {feasible:<8} {r.reason}")
        return "\n".join(lines)

    LEGEND = ("dpX·cpY: X data-parallel replicas x Y context-parallel ranks; allgather/alltoall: the ring's rotate "
              "method; ulysses: all-to-all over heads; hybrid uK×rN: Ulysses groups of K ranks, a ring of N; lb: "
              "causal load balancing; flash on CPU: cptune's CPU ring kernel; tokens/s: the whole world, median "
              "over n timed steps; IQR: its interquartile range; plan: the step model's tokens/s, calibrated on all "
              "of this study's measured trials (how, and its error, under the table); *: equivalent to the best (within "
              f"{INDIFFERENCE:.0%} after paired race rounds); peak: the worst rank; headroom: budget left; "
              "predicted: the memory model's peak (the proxy's, else the plan's)")

    def plan_note(self) -> str | None:
        if self.plan_calibration is None:
            return None
        return (f"the plan column is the step model calibrated on this study's measured trials: "
                f"{self.plan_calibration}")

    def tie_note(self) -> str | None:
        if not self.tie:
            return None
        return (f"{len(self.tie)} configurations are within measurement noise of each other "
                f"({', '.join(r.label for r in self.tie)}); chosen by {TIE_RULE}")

    def race_note(self) -> str | None:
        if not self.race:
            return None
        labels = {r.key: r.label for r in self.trials}
        return summary(self.race, lambda k: labels.get(k, k))

    def dp_only_note(self) -> str | None:
        """Why a config without CP can win, when it does."""
        best = self.best
        if best is None or best.config.parallel_dims().cp != 1:
            return None
        return (f"{best.label} means no context parallelism: each rank holds whole sequences and exchanges "
                "no attention blocks, so it wins whenever a whole sequence fits the budget. CP pays off when one does not: "
                "search with --memory-budget set to your device's memory and your model (--model for a "
                "transformers one, --workload for your own step, or the proxy's --layers).")

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "study_name": self.study_name, "storage": self.storage, "workload": self.workload.model_dump(mode="json"),
            "world_size": self.world_size, "device": self.device, "memory_budget": self.memory_budget,
            "memory_budget_unit": "bytes", "memory_margin": self.memory_margin,
            "evaluated_now": self.evaluated_now, "complete": self.complete,
            "best": best.to_dict() if best else None, "trials": [r.to_dict() for r in self.ranked],
            "equivalent": [r.label for r in self.tie], "race": self.race, "plan_calibration": self.plan_calibration,
            "check": self.check,
        }
