"""Turn a benchmark run's results.json into results.md, plots, and README.md's Performance section."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any


def run_json(cmd: list[str], cwd: Path, timeout: int = 1800, env: dict | None = None) -> dict:
    """The JSON object a benchmark's subprocess prints on its last line (its stderr's end raised on failure)."""
    import subprocess

    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return __import__("json").loads(out.stdout.strip().splitlines()[-1])


def print_worst_rank(got: dict, **extra: Any) -> None:
    """Rank 0 prints, as one JSON line, the worst rank's peak rise and seconds (each rank's ``got``, as
    ``benchmarks.loss._measure`` gives them; gathered where a process group is joined) with ``extra``."""
    import json

    import torch.distributed as dist

    every = [got]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, got)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"peak_rise": max(r["peak_rise"] for r in every),
                          "seconds": max(r["seconds"] for r in every), "ranks": len(every), **extra}))


def save_results(root: Path, name: str, results: dict) -> Path:
    """``results`` as benchmarks/results/<name>-<stamp>.json under ``root``; its path printed and returned."""
    import json
    import time

    out = root / "benchmarks" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"results: {out.relative_to(root)}")
    return out


def _best(oracle: dict, feasible_only: bool = True) -> str:
    rows = {k: r for k, r in oracle.items() if r["feasible"] or not feasible_only}
    return max(rows, key=lambda k: rows[k]["tokens_per_s"])


def _first_hold(trace: list, target: str) -> tuple[int, float] | None:
    """(trials, seconds) until the search's running best (its own measurements) was ``target``."""
    best_key, best_tps = None, -1.0
    for i, (key, tps, state, seconds) in enumerate(trace, 1):
        if state == "ok" and tps > best_tps:
            best_key, best_tps = key, tps
        if best_key == target:
            return i, seconds
    return None


def _relative(oracle: dict, key: str) -> float:
    """``key``'s throughput / the oracle's best (the fastest config feasible by the search's rule,
    peak plus margin within budget). A config whose oracle peak fits the budget but not the margin
    took a risk the oracle's best did not: a speed it bought that way counts as no better (at most 1)."""
    best = max((r["tokens_per_s"] for r in oracle.values() if r["feasible"]), default=None)
    ratio = oracle[key]["tokens_per_s"] / best if best else 1.0
    return ratio if oracle[key]["feasible"] else min(1.0, ratio)


def analyse(entry: dict) -> dict:
    oracle = entry["oracle"]
    best = _best(oracle)
    tuned, default = entry["tuned"], entry["default"]
    dp_key = next((k for k in oracle if "-cp1-" in k), None)
    cp_best = max((k for k in oracle if "-cp1-" not in k), key=lambda k: oracle[k]["tokens_per_s"], default=None)
    hold = _first_hold(entry["trace"], best)
    errors = [abs(r["predicted_bytes"] - r["peak_bytes"]) / r["peak_bytes"] for r in oracle.values()
              if r.get("predicted_bytes") is not None]  # none for a user's step: the model covers the proxy
    tps = {k: r["tokens_per_s"] for k, r in oracle.items()}
    return {
        "name": entry["name"], "best": best, "tuned": tuned, "default": default,
        "tuned_over_oracle": _relative(oracle, tuned) if tuned else None,
        "tuned_feasible": oracle[tuned].get("fits", oracle[tuned]["feasible"]) if tuned else None,
        "tuned_over_default": tps[tuned] / tps[default] if tuned and default in tps else None,
        "default_feasible": oracle.get(default, {}).get("feasible"),
        "cp_efficiency": tps[cp_best] / tps[dp_key] if dp_key and cp_best else None,
        "dp_feasible": oracle[dp_key]["feasible"] if dp_key else None,
        "hold_trials": hold[0] if hold else None, "hold_seconds": hold[1] if hold else None,
        "trials": len(entry["trace"]), "search_seconds": entry["search_seconds"],
        "oracle_seconds": entry["oracle_seconds"], **_grid(entry),
        "startup_seconds": entry.get("startup_seconds"),
        "mem_err_mean": sum(errors) / len(errors) if errors else None, "mem_err_max": max(errors, default=None),
    }


def _grid(entry: dict) -> dict:
    """The fixed-repeats grid: every config measured once at the search's settings, which is the
    oracle's first pass (start-up included, as in the search). Its time, its own choice (the fastest
    config that fitted in that pass alone) and that choice's throughput / the oracle's best."""
    oracle = entry["oracle"]
    fitted = {k: r["first_pass"]["tokens_per_s"] for k, r in oracle.items()
              if r.get("first_pass", {}).get("feasible")}
    choice = max(fitted, key=fitted.get) if fitted else None
    return {"grid_seconds": entry["oracle_seconds"], "grid_choice": choice,
            "grid_over_oracle": _relative(oracle, choice) if choice else None,
            "grid_feasible": oracle[choice].get("fits", oracle[choice]["feasible"]) if choice else None}


def _grid_text(rows: list[dict]) -> str:
    """Search time against the fixed-repeats grid (over all workloads' time, and per workload), and
    how good the grid's own choice was."""
    ratios = [r["search_seconds"] / r["grid_seconds"] for r in rows]
    search, grid = sum(r["search_seconds"] for r in rows), sum(r["grid_seconds"] for r in rows)
    chose = [r["grid_over_oracle"] for r in rows if r["grid_feasible"]]
    over = sum(r["grid_choice"] is not None and not r["grid_feasible"] for r in rows)
    return (f"{search / grid:.2f} in total time ({search:.0f} s / {grid:.0f} s), "
            f"per workload {min(ratios):.2f}–{max(ratios):.2f} (geometric mean {_geomean(ratios):.2f})"
            f"{_startup_text(rows)}; that grid's own choice / oracle: geometric mean "
            f"{_fmt(_geomean(chose), '.3f')}, worst {_fmt(min(chose, default=None), '.3f')}"
            f"{f', over budget in {over}' if over else ''} (the oracle's rounds come after, apart from the grid's pass)")


def _startup_text(rows: list[dict]) -> str:
    starts = [e["startup_seconds"] for e in rows if e.get("startup_seconds")]
    if not starts:
        return ""
    return (f"; both include starting the ranks and reading their memory baseline ({min(starts):.0f}–"
            f"{max(starts):.0f} s), which dominates the shortest workloads")


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _pct(x):
    return _fmt(x and 100 * x, ".0f", "n/a") + ("" if x is None else " %")


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary_lines(results: dict, rows: list[dict]) -> list[str]:
    t_o = [r["tuned_over_oracle"] for r in rows if r["tuned_feasible"]]
    none = sum(r["tuned"] is None for r in rows)  # the search found nothing feasible
    over = len(rows) - len(t_o) - none  # the tuned config measured over budget in the oracle pass
    t_d = [r["tuned_over_default"] for r in rows if r["default_feasible"]]
    eff = [r["cp_efficiency"] for r in rows]
    mem = [r["mem_err_mean"] for r in rows if r["mem_err_mean"] is not None]
    mem_max = [r["mem_err_max"] for r in rows if r["mem_err_max"] is not None]
    ov = results["overhead"]
    held = [r for r in rows if r["hold_trials"]]
    held_text = ", ".join(f"{r['hold_trials']}/{r['trials']}" for r in held)
    return [
        f"- tuned / oracle throughput: geometric mean {_fmt(_geomean(t_o), '.3f')}, worst {_fmt(min(t_o), '.3f')} "
        f"({sum(x >= 0.95 for x in t_o)} of {len(rows)} workloads within 5 %"
        f"{f'; in {over} the tuned config peaked over the budget in the oracle' if over else ''}"
        f"{f'; in {none} the search found no feasible config' if none else ''})",
        f"- tuned / PyTorch default (allgather, load balancing, cp = world): geometric mean "
        f"{_fmt(_geomean(t_d), '.2f')}, range {_fmt(min(t_d), '.2f')}–{_fmt(max(t_d), '.2f')}",
        f"- CP parallel efficiency (best CP config / dp-only, no communication): "
        f"{_fmt(min(eff), '.2f')}–{_fmt(max(eff), '.2f')}",
        f"- wrapper overhead, cptune.context_parallel vs the bare ring (S={ov['seq_len']}): "
        f"{_fmt(ov['wrapped_over_bare'], '.3f')}x; with 3 buffers sharded and restored: "
        f"{_fmt(ov['with_buffers_over_bare'], '.3f')}x",
        f"- search cost: the search first held the oracle's config after "
        f"{held_text} trials in {len(held)} of {len(rows)} "
        f"workloads; time to that point / time to measure every config: geometric mean "
        f"{_fmt(_geomean([r['hold_seconds'] / r['oracle_seconds'] for r in held]), '.2f')}; whole search "
        f"(screening and racing) / a grid measuring every config with fixed repeats at the same settings "
        f"({results.get('settings', 'the defaults')}): {_grid_text(rows)}",
        f"- memory model (the proxy workloads): mean |predicted - measured| / measured peak per config "
        f"{_fmt(100 * sum(mem) / len(mem) if mem else None, '.1f')} %, "
        f"worst {_fmt(100 * max(mem_max) if mem_max else None, '.1f')} %",
        *_repeat_line(results.get("repeat")),
    ]


def _repeat_line(repeat: dict | None) -> list[str]:
    if not repeat:
        return []
    runs = repeat["runs"]
    answers = [(r["chosen"], tuple(r["tie"])) for r in runs]
    same = len({a[0] for a in answers}) == 1 or len({a[1] for a in answers if a[1]}) == 1 and all(a[1] for a in answers)
    text = "; ".join(f"{r['chosen']}" + (f" (tie of {len(r['tie'])})" if r["tie"] else "") for r in runs)
    return [f"- repeatability, {repeat['name']} searched {len(runs)} times from scratch: {text} -> "
            f"{'the same answer' if same else 'different answers'}"]


def write_report(results: dict, out: Path, update_readme: bool = False) -> str:
    rows = [analyse(e) for e in results["workloads"]]
    lines = [f"# cptune CPU benchmark, {results['date']}", "", f"Command: `{results['command']}`  ",
             f"Machine: {results['machine']}  ", f"Total time: {results.get('total_seconds', 0):.0f} s", "",
             "## Summary", "", *summary_lines(results, rows), "", "## Per workload", "",
             "| workload | oracle best | tuned | tuned/oracle | tuned/default | CP efficiency | trials to hold best "
             "| search s / fixed-repeats grid s (its choice / oracle) | memory model error (mean, max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = "" if r["default_feasible"] else " (default over budget)"
        over = "" if r["tuned_feasible"] else " (over budget here)"
        lines.append(f"| {r['name']} | {r['best']} | {r['tuned']} | {_fmt(r['tuned_over_oracle'], '.3f')}{over} | "
                     f"{_fmt(r['tuned_over_default'])}{note} | {_fmt(r['cp_efficiency'])}"
                     f"{'' if r['dp_feasible'] else ' (dp over budget)'} | {r['hold_trials'] or 'never'}/{r['trials']} | "
                     f"{r['search_seconds']:.0f}/{r['grid_seconds']:.0f} ({_fmt(r['grid_over_oracle'], '.3f')}"
                     f"{'' if r['grid_feasible'] in (True, None) else ', over budget'}) | "
                     f"{_pct(r['mem_err_mean'])}, {_pct(r['mem_err_max'])} |")
    lines += ["", "## Every configuration (throughput relative to the workload's oracle best)", ""]
    for e in results["workloads"]:
        best = e["oracle"][_best(e["oracle"])]["tokens_per_s"]
        lines += [f"**{e['name']}** (budget {e['budget'] / 2**20:.0f} MiB per rank)", "",
                  "| config | relative throughput | peak MiB | predicted MiB | feasible | spread |", "|---|---|---|---|---|---|"]
        for k, r in sorted(e["oracle"].items(), key=lambda kv: -kv[1]["tokens_per_s"]):
            tag = " (tuned)" if k == e["tuned"] else ""
            tag += " (PyTorch default)" if k == e["default"] else ""
            lines.append(f"| {r['label']}{tag} | {r['tokens_per_s'] / best:.3f} | {r['peak_bytes'] / 2**20:.0f} | "
                         f"{_fmt(r.get('predicted_bytes') and r['predicted_bytes'] / 2**20, '.0f')} | "
                         f"{'yes' if r['feasible'] else 'no'} | "
                         f"{100 * r['spread']:.0f} % |")
        lines.append("")
    plots = _plots(results, out)
    lines += ["## Scaling with sequence length", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    if update_readme:
        _update_readme(results, rows, out)
    return "\n".join(summary_lines(results, rows))


def _plots(results: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    series: dict[str, dict[str, list]] = {}
    for e in results["workloads"]:
        if e["workload"]["layers"] != 1 or e.get("nproc", 2) != 2 or e["workload"].get("step"):  # same ranks, model
            continue
        kind = "causal" if e["workload"]["causal"] else "non-causal"
        for k, r in e["oracle"].items():
            s = series.setdefault(f"{kind}: {r['label']}", {"S": [], "t": [], "m": []})
            s["S"].append(e["workload"]["seq_len"])
            s["t"].append(r["step_time_s"])
            s["m"].append(r["peak_bytes"] / 2**20)
    paths = []
    for metric, ylabel, name in (("t", "step time (s, this run)", "step_time"), ("m", "peak memory per rank (MiB)",
                                                                                 "peak_memory")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, s in sorted(series.items()):
            ax.plot(s["S"], s[metric], marker="o", label=label, linestyle="-" if "non" not in label else "--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        path = out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def cpu_run(name: str, description: str, ranks: int = 2) -> tuple[Any, dict]:
    """A CPU benchmark's command line (``--quick``, ``--update-readme``) and the head of its results: the command
    as run, the date and the machine."""
    import argparse
    import datetime
    import os
    import platform

    import torch

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    return args, {"command": f"python -m benchmarks.{name}" + (" --quick" if args.quick else ""),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M"),
                  "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {ranks} gloo ranks x 1 thread, "
                             f"torch {torch.__version__}"}


def publish(kind: str, results: dict, lines: list[str], update_readme: bool) -> Path:
    """Write benchmarks/results/<kind>-<date>.json, print ``lines``, and rewrite README's ``kind`` section if asked."""
    import json

    out = Path(f"benchmarks/results/{kind}-{results['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    if update_readme:
        replace_readme_section(kind, lines)
    print(f"written: {out}")
    return out


def replace_readme_section(name: str, lines: list[str]) -> None:
    """Rewrite the page (README.md or one of docs/) between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
    with ``lines``; links into the repository are made relative to that page."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    page = next((p for p in [Path("README.md"), *sorted(Path("docs").glob("*.md"))] if start in p.read_text()), None)
    if page is None:
        raise SystemExit(f"neither README.md nor docs/ has a {start} ... {end} section to rewrite")
    body = "\n".join([start, "", *lines, "", end])
    if page.parent.name == "docs":
        body = re.sub(r"\]\((benchmarks|recipes|examples|tests)/", r"](../\1/", body)
    text = page.read_text()
    page.write_text(re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: body, text, flags=re.S))


def _update_readme(results: dict, rows: list[dict], out: Path) -> None:
    replace_readme_section("performance", [
        f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
        f"({results.get('total_seconds', 0) / 60:.0f} min). Full tables and plots: [{out}/results.md]({out}/results.md).",
        "", *summary_lines(results, rows)])
