"""Calibration: the step model's efficiencies fitted to what was measured.

From a study's trials (or any measured steps) four factors are fitted, and only these:

- ``compute``: measured / predicted for the compute part (FLOPs and memory traffic), one factor for
  GEMMs, attention and elementwise work alike;
- ``communication``: the same for the exposed communication;
- ``layer_overhead_s``: seconds per layer pass (kernel launches, Python), which the FLOP counts miss;
- ``memory``: measured / predicted for what a step adds to the process's baseline memory.

Time is fitted by non-negative least squares on ``measured = compute x C + communication x X +
layer_overhead_s x P`` (C, X, P: the prediction's compute seconds, exposed communication seconds
and layer passes); with fewer than five trials only one common scale is fitted (more factors than
that would fit the noise). Each fit reports its *leave-one-out* error: the worst relative error of
each trial predicted by a fit made without it, which is what the search's skip rule trusts.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .._files import read_json_object
from ..errors import Problem, ValidationError
from ._hardware import Hardware
from ._step import Prediction

FULL_FIT = 5
"""Trials needed before compute, communication and overhead are fitted apart (below it: one scale)."""


@dataclass(frozen=True)
class Calibration:
    compute: float = 1.0
    communication: float = 1.0
    layer_overhead_s: float | None = None  # None: the profile's own
    memory: float = 1.0
    trials: int = 0
    error: float | None = None
    """Worst leave-one-out relative error of the step time (None: fewer than 3 trials)."""
    memory_error: float | None = None
    fitted: tuple[str, ...] = ()

    def step_s(self, p: Prediction) -> float:
        if self.layer_overhead_s is None:
            return self.compute * p.compute_s + self.communication * p.exposed_s
        return (self.compute * (p.compute_s - p.time["overhead"]) + self.communication * p.exposed_s
                + self.layer_overhead_s * p.time["layer_passes"])

    def apply(self, p: Prediction) -> Prediction:
        """``p`` with its step time, tokens/s and memory as calibrated: each part the step adds to the baseline scaled
        by the memory factor, the peak their sum (so the parts a row prints add up to its peak)."""
        step = self.step_s(p)
        memory = {k: v if k == "baseline" else int(self.memory * v) for k, v in p.memory.items()}
        scale = p.step_s / step if step > 0 else 1.0
        return replace(p, step_s=step, tokens_per_s=p.tokens_per_s * scale,
                       tokens_per_s_per_gpu=p.tokens_per_s_per_gpu * scale, memory=memory,
                       peak_bytes=sum(memory.values()))

    def describe(self) -> str:
        if not self.trials:
            return "uncalibrated"
        parts = [f"compute x{self.compute:.2f}"]
        if "communication" in self.fitted:
            parts.append(f"communication x{self.communication:.2f}")
        if self.layer_overhead_s is not None:
            parts.append(f"{self.layer_overhead_s * 1e3:.2f} ms per layer pass")
        err = f", leave-one-out error {self.error:.0%}" if self.error is not None else ""
        mem = f", memory x{self.memory:.2f}" + (f" (error {self.memory_error:.0%})" if self.memory_error is not None
                                                 else "")
        return f"{', '.join(parts)}{mem} from {self.trials} trial(s){err}"

    def to_dict(self) -> dict:
        return asdict(self)


def _features(p: Prediction, full: bool) -> list[float]:
    if not full:
        return [p.compute_s + p.exposed_s]
    return [p.compute_s - p.time["overhead"], p.exposed_s, p.time["layer_passes"]]


def _nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares, relative (each row weighted by 1 / y): the best of every active set."""
    k = len(rows[0])
    best, best_err = [0.0] * k, math.inf
    for size in range(1, k + 1):
        for active in itertools.combinations(range(k), size):
            coef = _lstsq([[r[i] / t for i in active] for r, t in zip(rows, y)], [1.0] * len(y))
            if coef is None or min(coef) < 0:
                continue
            full = [0.0] * k
            for i, v in zip(active, coef):
                full[i] = v
            err = sum((sum(a * b for a, b in zip(r, full)) / t - 1) ** 2 for r, t in zip(rows, y))
            if err < best_err:
                best, best_err = full, err
    return best


def _lstsq(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Normal equations, solved by Gaussian elimination (k <= 3)."""
    k = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] + [sum(r[i] * t for r, t in zip(a, y))] for i in range(k)]
    for i in range(k):
        pivot = max(range(i, k), key=lambda r: abs(m[r][i]))
        if abs(m[pivot][i]) < 1e-300:
            return None
        m[i], m[pivot] = m[pivot], m[i]
        for r in range(k):
            if r != i:
                factor = m[r][i] / m[i][i]
                m[r] = [x - factor * z for x, z in zip(m[r], m[i])]
    return [m[i][k] / m[i][i] for i in range(k)]


def _fit(preds: Sequence[Prediction], steps: Sequence[float], full: bool) -> list[float]:
    return _nnls([_features(p, full) for p in preds], steps)


def _predict(coef: list[float], p: Prediction, full: bool) -> float:
    return sum(a * b for a, b in zip(coef, _features(p, full)))


def _loo(preds: Sequence[Prediction], steps: Sequence[float], full: bool) -> float | None:
    if len(preds) < 3:
        return None
    worst = 0.0
    for i in range(len(preds)):
        rest = [j for j in range(len(preds)) if j != i]
        coef = _fit([preds[j] for j in rest], [steps[j] for j in rest], full)
        guess = _predict(coef, preds[i], full)
        worst = max(worst, abs(guess / steps[i] - 1) if guess > 0 else 1.0)
    return worst


def calibrate(preds: Sequence[Prediction], steps: Sequence[float], peaks: Sequence[int | None] = ()) -> Calibration:
    """Fit the factors to measured step seconds (and peak bytes per rank, where measured) of predicted points."""
    if not preds:
        return Calibration()
    full = len(preds) >= FULL_FIT
    if full:  # three factors only where they predict the held-out trials better than one scale does
        one, three = _loo(preds, steps, False), _loo(preds, steps, True)
        full = three is not None and one is not None and three < one
    coef = _fit(preds, steps, full)
    error = _loo(preds, steps, full)
    if full:
        cal = Calibration(compute=coef[0], communication=coef[1], layer_overhead_s=coef[2],
                          fitted=("compute", "communication", "layer_overhead_s"))
    else:
        cal = Calibration(compute=coef[0], communication=coef[0], fitted=("compute",))
    pairs = [(p, m) for p, m in zip(preds, peaks) if m and p.peak_bytes > p.memory["baseline"]]
    ratios = [(m - p.memory["baseline"]) / (p.peak_bytes - p.memory["baseline"]) for p, m in pairs]
    memory = statistics.median(ratios) if ratios else 1.0
    mem_err = None
    if len(ratios) >= 2:
        mem_err = max(abs((p.memory["baseline"] + memory * (p.peak_bytes - p.memory["baseline"])) / m - 1)
                      for p, m in pairs)
    return replace(cal, memory=memory, trials=len(preds), error=error, memory_error=mem_err,
                   fitted=cal.fitted + (("memory",) if ratios else ()))


def fold(hw: Hardware, cal: Calibration, what: str) -> Hardware:
    """``hw`` with ``cal``'s factors folded into its efficiencies (a profile to save and plan with)."""
    e = hw.efficiency
    update = {"gemm": e.gemm / cal.compute, "attention": e.attention / cal.compute, "memory": e.memory / cal.compute,
              "communication": e.communication / cal.communication}
    if cal.layer_overhead_s is not None:
        update["layer_overhead_ms"] = cal.layer_overhead_s * 1e3
    return hw.model_copy(update={"efficiency": e.model_copy(update=update),
                                 "calibrated_by": [*hw.calibrated_by, f"{what}: {cal.describe()}"]})


def from_gpu_benchmark(hw: Hardware, results: str | Path, backend: str = "flash",
                       argument: str = "results") -> Hardware:
    """``hw`` with its attention efficiency from ``python -m benchmarks.gpu`` results (its kernel sweep: the
    TFLOP/s of ``backend`` at the longest length measured). Results without such a row are an error naming
    ``argument``: a profile silently left uncalibrated would pass for a calibrated one."""
    fix = "give the results.json that python -m benchmarks.gpu wrote"
    data = read_json_object(results, argument, fix)
    sweep = data.get("sweep")
    rows = [r for r in sweep if isinstance(r, dict) and r.get("backend") == backend] if isinstance(sweep, list) else []
    rows = [r for r in rows if isinstance(r.get("seq_len"), int) and isinstance(r.get("tflops"), (int, float))
            and r["tflops"] > 0]
    if not rows:
        raise ValidationError([Problem(argument, f"{results} has no {backend} row (seq_len, tflops) in its sweep",
                                       fix)])
    top = max(rows, key=lambda r: r["seq_len"])
    share = top["tflops"] / (hw.flops("bfloat16") / 1e12)
    return hw.model_copy(update={
        "efficiency": hw.efficiency.model_copy(update={"attention": share}),
        "calibrated_by": [*hw.calibrated_by, f"attention {share:.2f} of peak: {backend} at S={top['seq_len']}, "
                          f"{top['tflops']:.1f} TFLOP/s on {data.get('device')} ({results})"]})
