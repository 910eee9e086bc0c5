"""``cptune plan``: every configuration of a cluster, predicted and ranked, and the recipe of the best, marked predicted."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from ..workload import BUDGET_FRACTION
from .._env import process_backend
from .._version import __version__
from ..config import CPConfig
from ..errors import Problem, ValidationError, raise_if
from ..sizes import format_rate, format_size
from ..models import training_problems
from ._space import AC_MODES, configurations, expert_degrees, model_limits, tp_degrees, transformers_missing
from ..workload import Workload
from ._calibrate import Calibration
from ._dims import ModelDims
from ._hardware import Hardware
from ._step import Point, Prediction, judge, predict

def points(workload: Workload, world: int, ac_modes: tuple[str, ...] = AC_MODES, device_type: str | None = None,
           backend: str = "flash", tp_degrees: tuple[int, ...] = (1,), replicas: tuple[int, ...] = (1,),
           cp_refused: str | None = None, mixers: tuple[str, ...] = (), ep: tuple[int, ...] = ()
           ) -> tuple[list[Point], list[tuple[str, str]]]:
    """Every distinct configuration of ``world`` ranks for ``workload`` x each AC mode it trains under, and the invalid
    ones with why; ``mixers``: the ways a hybrid's mixer layers may cross the ranks (:attr:`cptune.CPConfig.mixers`);
    ``ep``: its experts' degrees (:func:`cptune.plan.expert_degrees`)."""
    valid, invalid = configurations(workload, world, (backend,), device_type, tp_degrees, replicas, cp_refused,
                                    mixers, ep)
    return [Point(config, ac) for config in valid for ac in ac_modes
            if not training_problems(ac, False, ep=config.ep_degree)], invalid


@dataclass
class Plan:
    """Every configuration predicted for one model, length and cluster, best first."""

    dims: ModelDims
    workload: Workload
    hardware: Hardware
    gpus: int
    gpus_per_node: int
    budget: int
    predictions: list[Prediction]
    invalid: list[tuple[str, str]] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction | None:
        return next((p for p in self.predictions if p.infeasible is None), None)

    def table(self, limit: int | None = None) -> str:
        shown = self.predictions if limit is None else self.predictions[:limit]
        width = max([40, *(len(p.point.label()) for p in shown)])
        head = (f"{'#':>3}  {'config':<{width}} {'tokens/s/GPU':>12} {'step':>9} {'peak':>10} {'headroom':>8}  "
                "bottleneck / why not")
        lines = [head, "-" * len(head)]
        for i, p in enumerate(shown, 1):
            if p.infeasible is not None and (i == 1 or shown[i - 2].infeasible is None):
                lines.append(f"     predicted not to fit the budget of {format_size(self.budget)}:")
            room = (self.budget - p.peak_bytes) / self.budget
            lines.append(f"{i:>3}  {p.point.label():<{width}} {format_rate(p.tokens_per_s_per_gpu):>12} {p.step_s:>8.3f}s "
                         f"{format_size(p.peak_bytes):>10} {room:>8.0%}  {p.infeasible or p.bottleneck}")
        if limit is not None and len(self.predictions) > limit:
            lines.append(f"... {len(self.predictions) - limit} more (--all shows them)")
        return "\n".join(lines)

    def shortfall(self, more_gpus: Plan | None = None) -> str:
        """What the closest configuration lacks, when none is predicted to fit: its peak against the budget and each
        of its memory parts in GiB, largest first; ``more_gpus``: a plan of the same job on more GPUs, said if something
        fits there."""
        close = min(self.predictions, key=lambda p: p.peak_bytes)
        there = more_gpus.best if more_gpus is not None else None
        more = (f"On {more_gpus.gpus} GPUs {there.point.label()} is predicted to fit ({format_size(there.peak_bytes)}, "
                f"{format_rate(there.tokens_per_s_per_gpu)} tokens/s per GPU). " if there is not None else "")
        return (f"The closest, {close.point.label()}, needs {format_size(close.peak_bytes)} per GPU against "
                f"{format_size(self.budget)} ({memory_parts(close)}). {more}It "
                "would take more GPUs, a shorter --seq-len or a larger --memory-budget; or what cptune does not "
                "plan: activation offloading, or pipeline parallelism (the layers split into stages)")

    def best_line(self) -> str:
        """The best configuration's line: its rate and each of its memory parts in GiB, largest first."""
        best = self.best
        return (f"best (predicted): {best.point.label()}  {format_rate(best.tokens_per_s_per_gpu)} tokens/s per GPU; "
                f"peak {format_size(best.peak_bytes)}: {memory_parts(best)}")

    def header(self) -> str:
        nodes = max(1, self.gpus // self.gpus_per_node)
        return (f"{self.dims.describe()}\n{self.workload.describe()}\n{self.gpus} x {self.hardware.name} "
                f"({nodes} node(s) of {min(self.gpus, self.gpus_per_node)}), budget {format_size(self.budget)} "
                f"per GPU; efficiencies: {self.calibration.describe() if self.calibration.trials else 'as the profile: ' + '; '.join(self.hardware.calibrated_by) or 'nominal'}"
                + "".join(f"\nnote: {n}" for n in self.notes))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.dims.model_dump(mode="json"), "workload": self.workload.model_dump(mode="json"),
                "hardware": self.hardware.model_dump(mode="json"), "gpus": self.gpus,
                "gpus_per_node": self.gpus_per_node, "memory_budget": self.budget,
                "calibration": self.calibration.to_dict(),
                "best": self.best.to_dict() if self.best else None,
                "predictions": [p.to_dict() for p in self.predictions],
                "invalid": [{"config": c, "reason": r} for c, r in self.invalid], "notes": self.notes}


def plan(dims: ModelDims, workload: Workload, hardware: Hardware, gpus: int, gpus_per_node: int = 8,
         budget: int | None = None, ac_modes: tuple[str, ...] = AC_MODES,
         calibration: Calibration | None = None, max_tp: int | None = None) -> Plan:
    """Predict every configuration of ``gpus`` GPUs (``gpus_per_node`` per node) for ``dims`` on ``workload``'s
    sequences, tensor parallelism up to ``max_tp`` inside a node (None: a node's GPUs; 1: dp x cp only); ranked
    by predicted tokens/s per GPU, those that fit ``budget`` (default:
    :data:`~cptune.workload.BUDGET_FRACTION` of the GPU's memory) first."""
    problems = []
    if gpus < 1:
        problems.append(Problem("gpus", f"is {gpus}", "give the number of GPUs, e.g. 64"))
    if gpus_per_node < 1 or (gpus > gpus_per_node and gpus % gpus_per_node):
        problems.append(Problem("gpus_per_node", f"{gpus_per_node} does not divide --gpus {gpus} into whole nodes",
                                "give the GPUs per node (8 on DGX/HGX machines), a divisor of --gpus"))
    bad = [a for a in ac_modes if a not in AC_MODES]
    if bad:
        problems.append(Problem("ac", f"{', '.join(bad)} not among {', '.join(AC_MODES)}", "use auto or one of them"))
    raise_if(problems)
    budget = int(BUDGET_FRACTION * hardware.memory_bytes) if budget is None else budget
    calibration = calibration or Calibration()
    nodes = gpus // gpus_per_node if gpus > gpus_per_node else 1  # HSDP: one replica a node, FSDP2 inside it
    # the model's own limits, as the training script and the search apply them: a tp its plan cannot split is not
    # tried, and cp > 1 is not possible for a model with layers that mix tokens outside attention
    tps, cp_refused, whole = model_limits(workload, tp_degrees(gpus, gpus_per_node, max_tp))
    if dims.experts is not None:  # no TP plan cptune applies splits experts (cptune.models.tp_problems), so none here
        tps = tuple(t for t in tps if t == 1)
    notes = [f"cp > 1 is not possible: {cp_refused}. The rows are cp = 1, and the step model does not price those "
             "layers: it takes every decoder layer as softmax attention"] if cp_refused else []
    if workload.model is not None and transformers_missing():
        notes.insert(0, "transformers is not installed: planned from config.json's fields alone, without the family's "
                        "TP plan or layer rule, so tp = 1 only and no layer refused or run whole")
    moe, ep = dims.experts, expert_degrees(workload, gpus)
    if moe is not None:
        notes.append(f"{moe.layers} of the {dims.layers} layers are a mixture of experts ({moe.describe()}): memory "
                     f"holds every expert, FLOPs count those a token goes through; an MoE layer's FSDP unit gathers "
                     f"all {moe.experts}" + (", or E / ep under expert parallelism (the rows with ep: each routed "
                                             "copy traded by all-to-all, ep folded over dp x cp)" if ep else
                                             " (no ep: transformers builds these experts ungrouped, or is missing)")
                     + "; tp does not split them")
    mix = dims.mixer
    if whole:
        notes.append(f"under cp > 1 the layers that mix tokens outside attention ({whole}) run whole on every rank "
                     "(cptune's generic path gathers their input over cp: exact, not split); the step model "
                     + (f"prices them so (mixers: whole, {mix.layers} {mix.kind} layers)" if mix else
                        "prices them as softmax attention, which under-states their memory at long sequences: "
                        "measure them with cptune search --model"))
    elif mix and not cp_refused:
        notes.append(f"{mix.layers} of the {dims.layers} layers are {mix.kind}: priced on their path (mixers: split "
                     + ("by a halo exchange" if mix.kind == "short_conv" else
                        f"by an all-to-all over {mix.heads} heads where cp divides them") + "; mixers: whole gathers "
                     "the sequence on every rank), linear-time compute with its state (cptune.plan._mixer_step)")
    valid, invalid = points(workload, gpus, ac_modes, tp_degrees=tps, replicas=(1, nodes) if nodes > 1 else (1,),
                            cp_refused=cp_refused, mixers=(("whole",) if whole else ("split", "whole")) if mix else (),
                            ep=ep)
    if not valid:
        raise ValidationError([Problem("seq_len", f"no configuration of {gpus} GPUs can split this workload: "
                                       + "; ".join(sorted({r for _, r in invalid})[:3]),
                                       "use a length divisible by the GPU count (x2 for load balancing)")])
    preds = []
    for point in valid:  # the calibrated parts decide: no row fits whose parts, summed, exceed the budget
        preds.append(judge(calibration.apply(predict(dims, workload, point, hardware, gpus_per_node, budget)), budget))
    preds.sort(key=lambda p: (p.infeasible is not None, -p.tokens_per_s_per_gpu if p.infeasible is None
                              else p.peak_bytes))
    return Plan(dims=dims, workload=workload, hardware=hardware, gpus=gpus, gpus_per_node=gpus_per_node,
                budget=budget, predictions=preds, invalid=invalid, calibration=calibration, notes=notes)


def with_more_gpus(result: Plan, factors: tuple[int, ...] = (2, 4), max_tp: int | None = None) -> Plan | None:
    """The same job planned on ``factors`` x the GPUs, the first where a configuration is predicted to fit (None:
    none does)."""
    for factor in factors:
        found = plan(result.dims, result.workload, result.hardware, result.gpus * factor, result.gpus_per_node,
                     result.budget, tuple(sorted({p.point.ac for p in result.predictions})), result.calibration, max_tp)
        if found.best is not None:
            return found
    return None


def plan_workload(dims: ModelDims, seq_len: int, batch: int = 1, dtype: str = "bfloat16", causal: bool = True,
                  documents: str | None = None, window: int | None = None, model: str | None = None,
                  overrides: dict | None = None, loss: str = "chunked", video: str | None = None) -> Workload:
    """The workload a plan predicts: ``dims``' attention shape at ``seq_len`` (``batch`` sequences per replica),
    ``loss`` and ``video`` taken as :class:`~cptune.Workload` says."""
    return Workload(seq_len=seq_len, batch=batch, heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                    layers=dims.layers, dtype=dtype, causal=causal, documents=documents, window=window, model=model,
                    model_overrides=overrides or None, loss=loss, video=video)


def predicted_recipe(result: Plan, command: str | None = None):
    """The plan's best configuration as a recipe, marked predicted (not measured): ``cptune show`` and ``launch``
    say so, and its figures are the plan's."""
    from ..recipe import MODEL_SCRIPT, Launch, Metrics, Provenance, Recipe

    best = result.best
    if best is None:
        raise ValidationError([Problem("memory_budget", "no configuration is predicted to fit",
                                       "raise --memory-budget, add GPUs, or plan a shorter --seq-len")])
    nodes = max(1, result.gpus // result.gpus_per_node)
    config: CPConfig = best.point.config.model_copy(update={"sdpa_backend": None})
    hw = result.hardware
    return Recipe(
        workload=result.workload.model_copy(update={"ac": best.point.ac}),
        config=config,
        launch=Launch(nnodes=nodes, nproc_per_node=min(result.gpus, result.gpus_per_node),
                      script=MODEL_SCRIPT if result.workload.model else None),
        provenance=Provenance(cptune_version=__version__, torch_version=torch.__version__, device=hw.name,
                              device_type=hw.device_type, device_count=result.gpus,
                              backend=process_backend(hw.device_type),
                              date=datetime.date.today().isoformat(), command=command),
        metrics=Metrics(measured=False, tokens_per_s=best.tokens_per_s, step_time_s=best.step_s,
                        peak_bytes_per_rank=[best.peak_bytes] * result.gpus, memory_budget=result.budget,
                        headroom=(result.budget - best.peak_bytes) / result.budget,
                        predicted_by=f"cptune plan on {hw.name} ({result.calibration.describe()}; "
                                     f"{'; '.join(hw.calibrated_by) or 'nominal'})",
                        note=f"predicted best of {len(result.predictions)} configurations ({best.bottleneck}); "
                             "measure it with cptune search on the cluster"))


def memory_parts(prediction: Prediction) -> str:
    """A prediction's memory parts in GiB, largest first."""
    parts = sorted(((v, k) for k, v in prediction.memory.items() if v), reverse=True)
    return ", ".join(f"{k} {v / 2**30:.2f}GiB" for v, k in parts)
