"""The model you train, searched and trained on real ranks: a small Llama from its config, two lengths.

    python -m benchmarks.model                   # 2 gloo ranks (~15 min on 2 cores)
    python -m benchmarks.model --update-readme   # also rewrite its section of README.md or docs/ (model)

The model is ``tests/models/tiny-llama`` made larger with overrides (``OVERRIDES``: 4 layers,
hidden 256, vocab 8192), so that at the longer length its dp-only step holds more than a CP step.
1. Probe: ``cptune search --model`` at the longer length with a generous budget measures every
   config's training step (FSDP2, AdamW, packed long-tailed documents).
2. The budget is set halfway between the dp-only config's peak and the lowest CP peak there;
   both lengths are searched with it (the same studies: nothing is measured twice). Reported per
   length: the choice, its headroom, and every config's measured peak (the search predicts a model step
   with the plan's step model, from the model's config; the proxy's analytic memory model does not apply).
3. ``examples/train_hf.py`` runs 6 steps at the longer length under the tuned recipe and under
   PyTorch's default configuration (allgather, load balancing, cp = world), twice each in turn:
   median tokens/s of steps 2-6, the ratio tuned / default (above 1: the tuned recipe is faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import cptune
from cptune.recipe import Metrics, recipe_from_search, save_recipe
from cptune.search import MeasureSettings
from cptune.search.space import pytorch_default
from cptune.sizes import format_size

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests/models/tiny-llama"
OVERRIDES = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
             "num_key_value_heads": 4, "vocab_size": 8192}
LENGTHS = (1024, 8192)


def _search(seq_len: int, budget: int | str, storage: str) -> cptune.SearchResult:
    workload = cptune.models.model_workload(MODEL, OVERRIDES, seq_len=seq_len, documents="longtail")
    return cptune.tune(workload, nproc=2, memory_budget=budget, storage=storage, trial_timeout=1200,
                         settings=MeasureSettings(min_seconds=1.0))


def _tokens_per_s(recipe_path: Path, cwd: Path) -> list[float]:
    """Tokens/s of steps 2-6 of examples/train_hf.py launched from the recipe."""
    out = subprocess.run([sys.executable, "-m", "cptune", "launch", str(recipe_path), "--",
                          str(ROOT / "examples/train_hf.py"), "--steps", "6"], cwd=cwd, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(f"train_hf.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rates = [float(r.replace(",", "")) for r in re.findall(r"^step \d+ loss \S+ tokens/s (\S+)$", out.stdout, re.M)]
    return rates[1:]


def run(work: Path) -> dict:
    storage = f"sqlite:///{work}/model.db"
    probe = _search(LENGTHS[-1], None, storage)  # the default budget: 90 % of RAM over the ranks
    peaks = {r.config.label(): r.peak_bytes for r in probe.trials if r.peak_bytes}
    dp_only = next(p for label, p in peaks.items() if "cp1" in label)
    cp_low = min(p for label, p in peaks.items() if "cp1" not in label)
    budget = (dp_only + cp_low) // 2
    rows, training = [], None
    for seq_len in LENGTHS:
        result = _search(seq_len, budget, storage)
        best = result.best
        rows.append({"seq_len": seq_len, "best": best.config.label() if best else None,
                     "headroom": best.headroom if best else None,
                     "peaks": {r.config.label(): r.peak_bytes for r in result.trials if r.peak_bytes},
                     "feasible": {r.config.label(): bool(r.feasible) for r in result.trials if r.peak_bytes}})
        if seq_len == LENGTHS[-1] and best is not None:
            tuned = save_recipe(recipe_from_search(result), work / "tuned.yaml")
            default = recipe_from_search(result).model_copy(update={
                "config": pytorch_default(result.workload, result.world_size, "cpu"),
                "metrics": Metrics(measured=False, note="PyTorch's default configuration")})
            default_path = save_recipe(default, work / "default.yaml")
            rates: dict[str, list[float]] = {"tuned": [], "default": []}
            for _ in range(2):  # in turn, twice: a machine that drifts moves both alike
                for name, path in (("tuned", tuned), ("default", default_path)):
                    rates[name] += _tokens_per_s(path, work)
            tuned_tps, default_tps = statistics.median(rates["tuned"]), statistics.median(rates["default"])
            training = {"tuned": best.config.label(), "default": default.config.label(), "rates": rates,
                        "tuned_tokens_per_s": tuned_tps, "default_tokens_per_s": default_tps,
                        "ratio": tuned_tps / default_tps}
    return {"budget": budget, "overrides": OVERRIDES, "rows": rows, "training": training}


def summary_lines(results: dict) -> list[str]:
    lines = [f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min): `tests/models/tiny-llama` with {results['overrides']}, "
             f"packed long-tailed documents, FSDP2 + AdamW, budget {format_size(results['budget'])} per rank "
             "(halfway between the dp-only peak and the lowest CP peak at the longer length).", "",
             "| S | choice | headroom | measured peak per config (feasible: yes/no) |", "|---|---|---|---|"]
    for row in results["rows"]:
        peaks = ", ".join(f"{label} {format_size(p)} ({'yes' if row['feasible'][label] else 'no'})"
                          for label, p in sorted(row["peaks"].items(), key=lambda kv: kv[1]))
        head = f"{row['headroom']:.0%}" if row["headroom"] is not None else "-"
        lines.append(f"| {row['seq_len']} | {row['best'] or 'nothing fits'} | {head} | {peaks} |")
    t = results.get("training")
    if t:
        same = " (the same configuration: the tuned recipe is PyTorch's default here, so this ratio is the " \
            "run-to-run noise)" if t["tuned"] == t["default"] else ""
        lines += ["", f"`examples/train_hf.py` at S={results['rows'][-1]['seq_len']}, median tokens/s of steps 2-6 of "
                      f"two runs each, in turn: tuned ({t['tuned']}) / PyTorch's default ({t['default']}) = "
                      f"{t['ratio']:.2f}{same}. The search predicted these steps with the plan's step model (from the "
                      "model's config), not the proxy's memory model."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="search and train a transformers model on 2 ranks")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    from .report import publish

    started = time.monotonic()
    results = {"command": "python -m benchmarks.model",
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M"),
               "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo ranks x 1 thread, "
                          f"torch {torch.__version__}"}
    with tempfile.TemporaryDirectory() as work:
        results.update(run(Path(work)))
    results["total_seconds"] = time.monotonic() - started
    publish("model", results, summary_lines(results), args.update_readme)


if __name__ == "__main__":
    main()
