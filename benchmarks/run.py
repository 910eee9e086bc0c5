"""CPU benchmark: does the tuner beat PyTorch's defaults and approach the best config? One run, side by side.

    python -m benchmarks.run                  # ~30 min on 2 cores; writes benchmarks/results/<date>/
    python -m benchmarks.run --quick          # a smaller set, for a look (~5 min)
    python -m benchmarks.run --update-readme  # also rewrite docs/benchmarks.md's Performance section

For each workload (2 gloo ranks, 1 thread each; one workload on 4) it measures, in this one run:
1. every valid configuration (the oracle: after the search, on fresh ranks, in 4 paired rounds,
   each timing every config once, back to back, in alternating order, so the machine's drift
   moves them alike), PyTorch's default (allgather, load balancing on, cp = world) among them, and
   the configuration `cptune.search` picks when run on its own (fresh study): tuned/oracle and
   tuned/default throughput ratios;
2. the no-communication limit (dp-only: each rank a whole sequence, no exchange) and CP
   parallel efficiency = best CP throughput / that limit;
3. wrapper overhead: a step through `cptune.context_parallel` against the same ring attention
   called directly (torch's own `context_parallel` does not run on CPU);
4. search cost: trials and seconds until the search first held the oracle's config, and the whole
   search (screening every config briefly, then racing the ones within noise of the leader),
   against a grid that measures every config with fixed repeats at the same settings (one oracle
   pass: `cptune search`'s defaults); and how good that grid's own choice is;
7. repeatability: one workload searched three times from scratch: the same choice or the same tie?
5. memory model accuracy: predicted vs measured peak per config;
6. step time and peak memory against sequence length, per config (plots).
All figures are ratios from this run; absolute times on a shared CPU are not quoted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import optuna
import torch

import cptune
from cptune.launch import WorkerGroup
from cptune.search import MeasureSettings, Workload, all_configs, config_key, pytorch_default, racing
from cptune.search.measure import baseline_on_rank, measure_on_rank, summarize
from cptune.config import CPConfig
from cptune.search.memory import default_budget, predict_peak
from cptune.workload import MEMORY_MARGIN
from cptune.search.space import mesh_shapes

from .overhead import overhead_on_rank
from .report import write_report

NPROC = 2


def workloads(quick: bool) -> list[tuple[str, Workload, str | None, int]]:
    """(name, workload, memory budget rule, ranks). Small heads keep 32K tokens affordable on 2 cores."""
    small = {"heads": 4, "head_dim": 32}
    lengths = (1024, 4096) if quick else (1024, 4096, 16384, 32768)
    out = [(f"causal S={s}", Workload(seq_len=s, **small), None, NPROC) for s in lengths]
    out += [(f"non-causal S={s}", Workload(seq_len=s, causal=False, **small), None, NPROC)
            for s in ((1024,) if quick else (1024, 4096))]
    # A transformer (attention and MLP) where a whole sequence per rank (dp only) needs clearly more
    # memory than half of one (about 40 %; see benchmarks/llama.py): the budget is set between the
    # two, so the full sequence does not fit and the search must choose context parallelism.
    deep = Workload(seq_len=2048, heads=8, kv_heads=2, head_dim=64, layers=4 if quick else 8,
                    step="benchmarks.llama:deep_step")
    out.append((f"memory-bound Llama S={deep.seq_len} dim {deep.heads * deep.head_dim} L={deep.layers}", deep,
                "between", NPROC))
    if not quick:  # 4 ranks (on 2 cores): 15 configurations (dp x cp shapes, ring, Ulysses, hybrid), the size
        # of space where screening and racing should pay, as on a GPU node
        out.append(("causal S=8192, 4 ranks", Workload(seq_len=8192, heads=8, head_dim=32), None, 4))
    return out


SETTINGS = MeasureSettings()
"""What `cptune search` uses unless told otherwise (warm-up 1, at least 3 steps and 1 s, at most 20),
for the oracle and the search alike: "every config measured with fixed repeats" is one oracle pass."""


def measure_all(group: WorkerGroup, workload: Workload, baseline: int) -> dict[str, dict]:
    rows = {}
    for config in all_configs(workload, group.nproc, "cpu"):
        per_rank = group.run(measure_on_rank, workload, config, SETTINGS, timeout=900)
        row = summarize(per_rank, workload, config, baseline)
        row.update(label=config.label(), config=config.model_dump(mode="json"),
                   predicted_bytes=predict_peak(workload, config, baseline) if workload.predictable else None,
                   measured_s=sum(sum(r["times"]) for r in per_rank) / group.nproc)
        rows[config_key(config)] = row
    return rows


def oracle_pass(workload: Workload, nproc: int, baseline: int | None = None) -> tuple[int, dict[str, dict], float]:
    """One oracle pass on fresh ranks, as the search gets them (a rank's memory grows with what it
    ran): (memory baseline, every config's row, seconds to start the ranks and read the baseline,
    which the search pays too). ``baseline``: count peaks from this one (the first pass's) instead."""
    t0 = time.monotonic()
    with WorkerGroup(nproc, timeout=900) as group:
        read = max(group.run(baseline_on_rank, [s for s in mesh_shapes(nproc) if s[1] > 1]))
        baseline = read if baseline is None else baseline
        startup = time.monotonic() - t0
        return baseline, measure_all(group, workload, baseline), startup


ORACLE_ROUNDS = 4


def oracle_rounds(workload: Workload, nproc: int, baseline: int, rounds: int = ORACLE_ROUNDS) -> dict[str, dict]:
    """The oracle's reference, after the search, on fresh ranks: every config timed once per round,
    briefly (the search's race-round length) and back to back, the order reversed every other round,
    as in the search's race. A shared machine drifts over minutes, and hits configs differently
    (dp-only computes on every core; a CP config waits on communication), so a pass that times each
    config at one moment judges against that moment; rounds spread every config over the same
    moments. Per config: each round's tokens/s, the step times, and the highest peak (the first
    round has the warm-up, so two steps at least)."""
    configs = all_configs(workload, nproc, "cpu")
    brief = racing.race_round(SETTINGS, workload)
    rows = {config_key(c): {"round_tps": [], "step_times": [], "peak_bytes": 0} for c in configs}
    with WorkerGroup(nproc, timeout=900) as group:
        group.run(baseline_on_rank, [s for s in mesh_shapes(nproc) if s[1] > 1])  # as the search: groups made first
        for i in range(rounds):
            settings = brief.model_copy(update={"warmup": SETTINGS.warmup}) if i == 0 else brief
            for config in configs if i % 2 == 0 else configs[::-1]:
                got = summarize(group.run(measure_on_rank, workload, config, settings, timeout=900), workload, config,
                                baseline)
                row = rows[config_key(config)]
                row["round_tps"].append(got["tokens_per_s"])
                row["step_times"] += got["step_times"]
                row["peak_bytes"] = max(row["peak_bytes"], got["peak_bytes"])
    return rows


def judge(oracle: dict[str, dict], rounds: dict[str, dict], budget: int, margin: float) -> None:
    """Each config's reference figure: the geometric mean of its paired rounds' tokens/s (not
    pooled with the first pass, which is the grid being judged; ``first_pass`` keeps what that grid
    saw: its figure and whether it fitted, and ``first_pass_steps`` its steps). The peak is the
    higher of the pass's and the rounds'. The oracle's best is the fastest config feasible by the
    search's own rule (peak plus margin within the budget); ``fits``: the peak within the budget itself."""
    for key, row in oracle.items():
        tokens = row["tokens_per_s"] * row["step_time_s"]
        row["first_pass_steps"] = len(row["step_times"])
        row["first_pass"] = {"tokens_per_s": row["tokens_per_s"],
                             "feasible": row["peak_bytes"] * (1 + margin) <= budget}
        figures = rounds[key]["round_tps"]
        row["round_tps"] = figures
        row["tokens_per_s"] = math.exp(sum(math.log(x) for x in figures) / len(figures))
        row["step_time_s"] = tokens / row["tokens_per_s"]
        row["step_times"] = rounds[key]["step_times"]
        row["spread"] = (max(figures) - min(figures)) / row["tokens_per_s"]
        row["peak_bytes"] = max(row["peak_bytes"], rounds[key]["peak_bytes"])
        row["feasible"] = row["peak_bytes"] * (1 + margin) <= budget  # the search's rule: the oracle's best
        row["fits"] = row["peak_bytes"] <= budget


def run_search(workload: Workload, budget: int, storage: str, name: str,
               nproc: int = NPROC) -> tuple[cptune.SearchResult, list[tuple]]:
    """A fresh search; also when each trial finished, to see when it first held the final best."""
    finished: list[tuple] = []
    start = time.monotonic()

    def progress(record, done, total):
        finished.append((config_key(record.config), record.tokens_per_s, record.state, time.monotonic() - start))

    result = cptune.tune(workload, nproc=nproc, memory_budget=budget, storage=storage,
                           study_name=name, settings=SETTINGS, progress=progress)
    return result, finished


def main() -> None:
    parser = argparse.ArgumentParser(description="cptune CPU benchmark")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="Results folder (default benchmarks/results/<date>)")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out = Path(args.out or f"benchmarks/results/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.db").unlink(missing_ok=True)  # every run searches from scratch
    storage = f"sqlite:///{out / 'bench.db'}"
    started = time.monotonic()
    results = {"command": "python -m benchmarks.run" + (" --quick" if args.quick else ""),
               "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {NPROC} gloo ranks x 1 thread, "
                          f"torch {torch.__version__}",
               "date": stamp, "workloads": [],
               "settings": f"warm-up {SETTINGS.warmup}, at least {SETTINGS.min_repeats} steps and {SETTINGS.min_seconds:g} s, "
                           f"at most {SETTINGS.max_repeats} steps"}
    with WorkerGroup(NPROC, timeout=900) as group:
        results["overhead"] = group.run(overhead_on_rank, 8192, 5)[0]
    print(f"wrapper overhead: {results['overhead']}", flush=True)
    for name, workload, budget_rule, nproc in workloads(args.quick):
        t0 = time.monotonic()  # both timings include starting the ranks
        baseline, oracle, startup_seconds = oracle_pass(workload, nproc)
        oracle_seconds = time.monotonic() - t0
        budget = default_budget("cpu", nproc)
        margin = MEMORY_MARGIN  # the search's: a config fits when peak x (1 + margin) <= budget
        if budget_rule == "between":  # between dp-only's peak and the leanest CP config's, margin included
            dp_peak = oracle[config_key(CPConfig(mesh_shape=(nproc, 1), sdpa_backend="flash"))]["peak_bytes"]
            cp_peak = min(r["peak_bytes"] for k, r in oracle.items() if "-cp1-" not in k)
            budget = int((1 + margin) * (dp_peak + cp_peak) / 2) if cp_peak < dp_peak else budget
        t1 = time.monotonic()
        tuned, trace = run_search(workload, budget, storage, f"bench-{len(results['workloads'])}", nproc)
        search_seconds = time.monotonic() - t1
        judge(oracle, oracle_rounds(workload, nproc, baseline), budget, margin)
        entry = {"name": name, "workload": workload.model_dump(mode="json"), "budget": budget,
                 "oracle": oracle, "oracle_seconds": oracle_seconds, "search_seconds": search_seconds,
                 "startup_seconds": startup_seconds,
                 "tuned": config_key(tuned.best.config) if tuned.best else None,
                 "tuned_measurements": tuned.best.measurements if tuned.best else None,
                 "default": config_key(pytorch_default(workload, nproc, "cpu")), "trace": trace, "nproc": nproc}
        results["workloads"].append(entry)
        print(f"{name}: tuned {entry['tuned']}, {len(trace)} trials, {time.monotonic() - t0:.0f}s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    # Repeatability: the same workload searched three times from scratch, on fresh ranks each time.
    name, workload, _, _ = workloads(args.quick)[1]
    results["repeat"] = {"name": name, "runs": []}
    for i in range(3):
        tuned, _ = run_search(workload, default_budget("cpu", NPROC), storage, f"bench-repeat-{i}")
        results["repeat"]["runs"].append({"chosen": config_key(tuned.best.config) if tuned.best else None,
                                          "tie": sorted(config_key(r.config) for r in tuned.tie)})
        print(f"repeat {i}: {results['repeat']['runs'][-1]}", flush=True)
    results["total_seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=1))
    summary = write_report(results, out, update_readme=args.update_readme)
    print(summary)
    print(f"\nwritten: {out}/results.md, {out}/*.png, {out}/results.json ({results['total_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
