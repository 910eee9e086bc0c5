"""The model search over the whole mesh against an exhaustive grid of it, on 4 CPU ranks, once.

    python -m benchmarks.search_tp            # about 15 min on 2 cores; results in benchmarks/results/search-tp-*.json (from the repository's root)

A Llama wide for its size (hidden 1024, MLP 4096, 4 heads and 4 key/value heads, 2 layers: 25M parameters) on few
tokens a rank: FSDP2's all-gathers of whole layers weigh against the matmuls, which tensor parallelism halves, so
tp is a real contender here, not a formality. The space: every mesh of 4 ranks with tp 1, 2 or 4 (dp x cp x tp),
every strategy, rotation and load balancing. ``cptune search --model ... --max-tp 4 --exhaustive --sampler grid``
measures every configuration under a loose budget; the budget is then set to the median of the peaks it measured,
so that half the space does not fit (the memory-hungriest meshes out, the fastest among them), and under it the
grid runs again and the search runs as users run it (``--max-tp 4``: the plan's order, screening, skips and a race).
A configuration's figure is the geometric mean of its two grid measurements; how far the two disagree is this
machine's noise. Reported: each run's wall time, the grids' figure of the search's pick over the best that fits,
and the retest noise that ratio is to be read against.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .report import publish

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 1024,
          "intermediate_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
SEQ_LEN, RANKS, MAX_TP = 256, 4, 4


MARGIN = 0.05  # the search's default --memory-margin


def _search(work: Path, name: str, budget_mib: int, *extra: str) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "cptune", "search", "--model", str(work / "model"), "--seq-len", str(SEQ_LEN),
           "--nproc", str(RANKS), "--max-tp", str(MAX_TP), "--memory-budget", f"{budget_mib}MiB", "--min-seconds", "0.5",
           "--storage", f"sqlite:///{work}/{name}.db", "--json", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=3600)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads(done.stdout), seconds


def _figures(found: dict) -> dict[str, dict]:
    return {t["label"]: t for t in found["trials"] if t.get("tokens_per_s") and t["state"] == "ok"}


def main() -> None:
    import torch

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(CONFIG))
        grid = ("--exhaustive", "--sampler", "grid")
        first, first_s = _search(work, "grid-1", 4096, *grid)
        budget = int(statistics.median(t["peak_bytes"] for t in _figures(first).values()) * (1 + MARGIN)) // 2**20
        second, second_s = _search(work, "grid-2", budget, *grid)
        guided, guided_s = _search(work, "guided", budget)
    a, b = _figures(first), _figures(second)
    keys = sorted(a.keys() & b.keys())
    figure = {k: math.sqrt(a[k]["tokens_per_s"] * b[k]["tokens_per_s"]) for k in keys}
    fits = {k for k in keys if max(a[k]["peak_bytes"], b[k]["peak_bytes"]) * (1 + MARGIN) <= budget * 2**20}
    best = max(fits, key=figure.get)
    moved = [a[k]["tokens_per_s"] / b[k]["tokens_per_s"] for k in keys]
    pick = guided["best"]["label"] if guided.get("best") else None
    result = {
        "command": "python -m benchmarks.search_tp", "date": time.strftime("%Y-%m-%d-%H%M"), "model": CONFIG, "seq_len": SEQ_LEN, "ranks": RANKS,
        "max_tp": MAX_TP, "torch": torch.__version__, "space": sum(t["state"] != "invalid" for t in first["trials"]),
        "states": {s: sum(t["state"] == s for t in first["trials"]) for s in {t["state"] for t in first["trials"]}}, "configs": len(keys),
        "budget_mib": budget, "fit": len(fits),
        "grid_s": first_s, "grid_again_s": second_s, "search_s": guided_s, "time_ratio": guided_s / second_s,
        "grid_best": best, "grid_best_tokens_per_s": figure[best],
        "pick": pick, "pick_over_best": figure[pick] / figure[best] if pick in figure else None,
        "retest_median_change": statistics.median(abs(x - 1) for x in moved),
        "retest_worst": max(moved, key=lambda x: abs(math.log(x))),
        "measured_by_search": sum(t["state"] in ("ok", "infeasible") for t in guided["trials"]),
        "skipped_by_search": sum(t["state"] == "skipped" for t in guided["trials"]),
        "rows": sorted(({"config": k, "run1": a[k]["tokens_per_s"], "run2": b[k]["tokens_per_s"],
                         "figure": figure[k], "fits": k in fits,
                         "peak_mib": max(a[k]["peak_bytes"], b[k]["peak_bytes"]) / 2**20} for k in keys),
                       key=lambda r: -r["figure"]),
        "total_s": time.monotonic() - started}
    lines = [f"  {r['config']:<40} {r['figure']:>9,.0f} tokens/s ({r['run1']:,.0f} / {r['run2']:,.0f}), peak "
             f"{r['peak_mib']:,.0f}MiB{'' if r['fits'] else ' (does not fit)'}" for r in result["rows"][:10]]
    ratio = f"{result['pick_over_best']:.2f}" if result["pick_over_best"] is not None else "not in the grid"
    lines.append(f"{result['space']} valid configurations of {RANKS} ranks (tp up to {MAX_TP}); {len(fits)} measured within "
                 f"{budget}MiB by both grids; grid {first_s:.0f} s (again {second_s:.0f} s), search {guided_s:.0f} s "
                 f"({result['time_ratio']:.2f} of the grid under the same budget, {result['measured_by_search']} "
                 f"measured, {result['skipped_by_search']} skipped); grid best {result['grid_best']}, search's pick "
                 f"{result['pick']}: {ratio} of the best's figure; the two grids disagree by "
                 f"{result['retest_median_change']:.0%} at the median, {result['retest_worst']:.2f}x at worst")
    publish("search-tp", result, lines, update_readme=False)

if __name__ == "__main__":
    main()
