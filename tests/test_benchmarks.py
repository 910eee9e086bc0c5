"""The benchmark scripts' code paths, on tiny sizes (their figures come from real runs, not tests)."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.report import analyse

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["seq_len"] for r in results["sweep"]] == [256, 512] and all(r["tflops"] > 0 for r in results["sweep"])
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in results["calibration"])
    assert "| flash | 256 |" in (tmp_path / "results.md").read_text()
    check = results["ring_check"]
    assert [r["compiled"] for r in check] == [False, True]
    assert all(r["out_err"] < 1e-4 and max(r["grad_errs"]) < 1e-3 for r in check), check


def test_training_step_benchmark_runs_three_ways(ranks):
    from benchmarks.training import training_step_on_rank

    row = ranks(2).run(training_step_on_rank, 256, 1)[0]  # raises if the three ways' losses differ
    assert set(row["median_s"]) == {"pytorch", "cptune_eager", "cptune_compiled"}
    assert row["cptune_over_pytorch"] > 0 and row["compiled_over_eager"] > 0


def test_report_ratios_and_search_cost():
    oracle = {
        "a": {"tokens_per_s": 100.0, "feasible": True, "predicted_bytes": 90, "peak_bytes": 100},
        "b-cp1-x": {"tokens_per_s": 120.0, "feasible": False, "predicted_bytes": 110, "peak_bytes": 100},
        "c": {"tokens_per_s": 80.0, "feasible": True, "predicted_bytes": 100, "peak_bytes": 100},
    }
    trace = [("c", 79.0, "ok", 1.0), ("a", 101.0, "ok", 2.0), ("b-cp1-x", 119.0, "infeasible", 3.0)]
    row = analyse({"name": "w", "oracle": oracle, "tuned": "a", "default": "c", "trace": trace,
                   "search_seconds": 3.0, "oracle_seconds": 6.0})
    assert row["best"] == "a" and row["tuned_over_oracle"] == 1.0 and row["tuned_over_default"] == 1.25
    assert row["cp_efficiency"] == 100.0 / 120.0 and row["dp_feasible"] is False
    assert (row["hold_trials"], row["hold_seconds"]) == (2, 2.0)
    assert abs(row["mem_err_mean"] - 0.2 / 3) < 1e-9 and abs(row["mem_err_max"] - 0.1) < 1e-9
