"""How well ``cptune plan`` predicts, here and against published figures, and what it saves a search.

    python -m benchmarks.plan                   # 2 and 4 gloo ranks (~20 min on 2 cores)
    python -m benchmarks.plan --update-readme   # also rewrite its section of README.md or docs/ (plan)
    python -m benchmarks.plan --from-results benchmarks/results/plan-DATE.json --update-readme
    python -m benchmarks.plan --published --update-readme   # only the published TP x CP points (instant)

1. This machine: ``cptune probe`` measures its rates on 2 (then 4) ranks; a grid search (every
   configuration once: meshes x strategies x splits x rotate x LB x AC none/selective/full, the Llama
   example's training step ``examples.train_llama_cp:search_step``) measures each, twice (the second
   grid says how much a measurement here moves between runs: a ceiling for any prediction). Reported per world
   size: Spearman's rank correlation of predicted vs measured tokens/s, the measured tokens/s of the
   plan's top pick over the measured best, and the worst memory error (predicted / measured peak - 1)
   - with the probe's rates alone, and calibrated on the grid's own trials (each trial predicted by a
   fit made without it).
2. The plan-guided search, as ``cptune search`` runs by default (brief screening in the plan's order,
   skips, then paired race rounds among the leaders), on the same space and settings: its wall time
   over one grid's, and the grids' measured tokens/s of its pick over the grids' best.
3. Published figures (``PUBLISHED``): torchtitan's Llama 3.1 8B CP table, calibrated on one point
   (FSDP 8, CP 1) and predicting the others; ring-flash-attention's ring / zigzag efficiencies with no
   calibration at all; NeMo's Llama 2 7B long-sequence runs (TP 1-8 x CP 1-32, up to 1,024 GPUs), calibrated on
   its one TP 1 run. Every error is reported, the misses too.
4. The ring's traffic outside its kernels per further ring step, as ``benchmarks.ring_traffic`` measures it
   here: the figures the step model's ``RING_STEP_BYTES`` hold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import torch

import cptune
import cptune.plan as P
from cptune.plan import dims_from_workload
from cptune.search import MeasureSettings
from cptune.search.guide import SKIPPED

from . import ring_traffic
from .plan_published import frontier, frontier_lines, nemo, nemo_lines, ring_flash, torchtitan

STEP = "examples.train_llama_cp:search_step"
WORKLOAD = dict(seq_len=4096, heads=4, kv_heads=2, head_dim=32, layers=2, ac="auto", step=STEP)
SETTINGS = MeasureSettings(warmup=1, min_repeats=3, max_repeats=6, min_seconds=1.0)

def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def _grid_rows(result: cptune.SearchResult, storage: str) -> tuple[list, int]:
    study = optuna.load_study(study_name=result.study_name, storage=storage)
    rows = [r for r in result.trials if r.state == "ok" and r.tokens_per_s]
    return rows, int(study.user_attrs.get("baseline_bytes", 0))


def _predict_rows(rows, workload: cptune.Workload, hw: P.Hardware, nproc: int) -> list[P.Prediction]:
    dims = dims_from_workload(workload)
    out = []
    for r in rows:
        w = workload.model_copy(update={"ac": r.ac})
        out.append(P.predict(dims, w, P.Point(r.config, r.ac, sync="none"), hw, nproc, optimizer=False))
    return out


def _judge(rows, preds: list[P.Prediction]) -> dict:
    measured = [r.tokens_per_s for r in rows]
    predicted = [p.tokens_per_s for p in preds]
    top = max(range(len(rows)), key=lambda i: predicted[i])
    mem = [p.peak_bytes / r.peak_bytes - 1 for p, r in zip(preds, rows) if r.peak_bytes]
    return {"configs": len(rows), "spearman": spearman(predicted, measured),
            "top_pick": rows[top].label, "top_over_best": measured[top] / max(measured),
            "memory_worst": max(mem, key=abs) if mem else None,
            "memory_mean_abs": statistics.fmean(abs(m) for m in mem) if mem else None,
            "rows": [{"label": r.label, "measured": r.tokens_per_s, "predicted": p.tokens_per_s,
                      "measured_peak": r.peak_bytes, "predicted_peak": p.peak_bytes} for r, p in zip(rows, preds)]}


def _loo(rows, preds: list[P.Prediction]) -> list[P.Prediction]:
    """Each trial predicted by a calibration fitted on all the others."""
    out = []
    for i in range(len(rows)):
        rest = [j for j in range(len(rows)) if j != i]
        cal = P.calibrate([preds[j] for j in rest], [rows[j].step_time_s for j in rest],
                          [rows[j].peak_bytes for j in rest])
        out.append(cal.apply(preds[i]))
    return out


def here(nproc: int, work: Path) -> dict:
    workload = cptune.Workload(**WORKLOAD)
    hw = P.probe(nproc)
    grids, grid_s = [], []
    for run in range(2):  # the grid twice: how well it agrees with itself bounds any prediction's agreement
        started = time.monotonic()
        store = f"sqlite:///{work}/grid-{nproc}-{run}.db"
        result = cptune.tune(workload, nproc=nproc, storage=store, confirm=False, exhaustive=True, sampler="grid",
                               settings=SETTINGS, trial_timeout=900)  # the space's own order: not the plan's
        grid_s.append(time.monotonic() - started)
        grids.append((result, store))
    rows, baseline = _grid_rows(*grids[0])
    again = {r.key: r for r in _grid_rows(*grids[1])[0]}
    rows = [r for r in rows if r.key in again]
    for r in rows:  # each config's figure: the geometric mean of its two measurements (time and peak alike)
        other = again[r.key]
        r.run1, r.run2 = r.tokens_per_s, other.tokens_per_s
        r.tokens_per_s = math.sqrt(r.tokens_per_s * other.tokens_per_s)
        r.step_time_s = math.sqrt(r.step_time_s * other.step_time_s)
        r.peak_bytes = max(r.peak_bytes, other.peak_bytes)
    hw = hw.model_copy(update={"baseline": baseline or hw.baseline_bytes})
    preds = _predict_rows(rows, workload, hw, nproc)
    started = time.monotonic()
    guided = cptune.tune(workload, nproc=nproc, storage=f"sqlite:///{work}/guided-{nproc}.db",
                           settings=SETTINGS, trial_timeout=900)  # as users run it: screening, then a race
    guided_s = time.monotonic() - started
    measured = {r.key: r.tokens_per_s for r in rows}
    pick = guided.best
    skipped = [r for r in guided.trials if r.state == "skipped"]
    by_plan = [r for r in skipped if r.reason.startswith(SKIPPED)]  # the rest: dominated checkpointing modes
    moved = [r.run1 / r.run2 for r in rows]  # run 1 / run 2, per config
    return {"nproc": nproc, "probe": hw.model_dump(mode="json"), "probe_only": _judge(rows, preds),
            "calibrated_loo": _judge(rows, _loo(rows, preds)),
            "retest": {"spearman": spearman([r.run1 for r in rows], [r.run2 for r in rows]),
                       "worst_ratio": max(moved, key=lambda x: abs(math.log(x))),
                       "median_abs_change": statistics.median(abs(x - 1) for x in moved)},
            "search": {"grid_s": grid_s[0], "grid_again_s": grid_s[1], "guided_s": guided_s,
                       "ratio": guided_s / grid_s[0],
                       "measured_by_guided": sum(r.state in ("ok", "infeasible") for r in guided.trials),
                       "skipped": len(skipped), "skipped_by_plan": len(by_plan), "configs": len(rows),
                       "pick": pick.label if pick else None,
                       "tuned_over_oracle": measured.get(pick.key, 0.0) / max(measured.values()) if pick else 0.0}}


def summary_lines(results: dict) -> list[str]:
    lines = [f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min). The Llama example's training step "
             f"(`{STEP}`, S={WORKLOAD['seq_len']}, 4 heads / 2 kv x 32, 2 layers, float32), every configuration "
             "(meshes x strategies x rotate x LB x AC none/selective/full) measured by a grid search, twice; a "
             "configuration's figure is the geometric mean of its two. The first row per world size is how well the "
             "grid agrees with itself: the ceiling for any prediction on this machine.", "",
             "| ranks | configs | predicted from | Spearman | plan's top pick / measured best | worst memory error |",
             "|---|---|---|---|---|---|"]
    for h in results["here"]:
        t = h["retest"]
        lines.append(f"| {h['nproc']} | {h['probe_only']['configs']} | the grid's first run (its second run as measured; "
                     f"median change {t['median_abs_change']:.0%}, worst {t['worst_ratio']:.2f}x) "
                     f"| {t['spearman']:.2f} | - | - |")
        for name, key in (("the probe's rates", "probe_only"), ("the grid's other trials", "calibrated_loo")):
            j = h[key]
            mem = f"{j['memory_worst']:+.0%}" if j["memory_worst"] is not None else "-"
            lines.append(f"| {h['nproc']} | {j['configs']} | {name} | {j['spearman']:.2f} | {j['top_over_best']:.2f} "
                         f"({j['top_pick']}) | {mem} |")
    lines += ["", "The default `cptune search` (screening in the plan's order, skips, a race among the leaders) against "
                  "one grid run; skipped: by the plan, or as a checkpointing mode that a measured, fitting run of the "
                  "same configuration with less recompute dominates; tuned / oracle: the grids' figure of the search's "
                  "pick over the grids' best.", "",
              "| ranks | grid | plan-guided search | time ratio | measured / skipped (by plan + dominated) | "
              "tuned / oracle |",
              "|---|---|---|---|---|---|"]
    for h in results["here"]:
        s = h["search"]
        split = f" ({s['skipped_by_plan']} + {s['skipped'] - s['skipped_by_plan']})" if "skipped_by_plan" in s else ""
        lines.append(f"| {h['nproc']} | {s['grid_s']:.0f} s | {s['guided_s']:.0f} s | {s['ratio']:.2f} | "
                     f"{s['measured_by_guided']} / {s['skipped']}{split} of {s['configs']} | "
                     f"{s['tuned_over_oracle']:.2f} |")
    geo = math.exp(statistics.fmean(math.log(max(h["search"]["tuned_over_oracle"], 1e-9)) for h in results["here"]))
    lines += ["", f"Geometric mean tuned / oracle: {geo:.2f}. Published figures "
                  f"({results['torchtitan']['source']}; calibrated on {results['torchtitan']['calibrated_on']}, "
                  f"compute factor {results['torchtitan']['compute_factor']:.2f}):", "",
              "| configuration | published tokens/s/GPU | predicted | error | published memory | predicted memory |",
              "|---|---|---|---|---|---|"]
    for r in results["torchtitan"]["rows"]:
        mark = " (calibration point)" if r["calibration"] else ""
        lines.append(f"| {r['config']}{mark} | {r['published']:,} | {r['predicted']:,.0f} | {r['error']:+.0%} | "
                     f"{r['published_memory_gib']} GiB | {r['predicted_memory_gib']:.1f} GiB |")
    lines += ["", f"{results['ring_flash']['source']}; calibrated on {results['ring_flash']['calibrated_on']}:", "",
              "| GPUs | implementation | published share of theoretic | predicted | error |", "|---|---|---|---|---|"]
    for r in results["ring_flash"]["rows"]:
        lines.append(f"| {r['gpus']} | {r['impl']} | {r['published']:.1%} | {r['predicted']:.1%} | {r['error']:+.0%} |")
    if "nemo" in results:
        lines += ["", *nemo_lines(results["nemo"])]
    if "ring_traffic" in results:
        lines += ["", *ring_traffic.summary_lines(results["ring_traffic"])]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="the plan's predictions against measurements and published figures")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--from-results", default=None, metavar="JSON",
                        help="Print (and with --update-readme, write) the summary of an earlier run's results file")
    parser.add_argument("--published", action="store_true",
                        help="Only the published TP x CP points (NeMo's): no ranks, no grid")
    args = parser.parse_args()
    from .report import publish, replace_readme_section

    if args.published:
        results = {"command": "python -m benchmarks.plan --published",
                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M"), "nemo": nemo(),
                   "frontier": frontier()}
        publish("plan-published", results, nemo_lines(results["nemo"]) + ["", *frontier_lines(results["frontier"])],
                args.update_readme)
        return

    if args.from_results:
        lines = summary_lines(json.loads(Path(args.from_results).read_text()))
        print("\n".join(lines))
        if args.update_readme:
            replace_readme_section("plan", lines)
        return

    started = time.monotonic()
    results = {"command": "python -m benchmarks.plan",
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M"),
               "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo ranks x 1 thread, "
                          f"torch {torch.__version__}"}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results["here"] = []
    with tempfile.TemporaryDirectory() as work:
        for n in args.nproc:
            results["here"].append(here(n, Path(work)))
            Path("/tmp/cptune-plan-partial.json").write_text(json.dumps(results, indent=1))  # a long run's progress
    results["torchtitan"] = torchtitan()
    results["ring_flash"] = ring_flash()
    results["nemo"] = nemo()
    results["ring_traffic"] = ring_traffic.measure()
    results["total_seconds"] = time.monotonic() - started
    publish("plan", results, summary_lines(results), args.update_readme)


if __name__ == "__main__":
    main()
