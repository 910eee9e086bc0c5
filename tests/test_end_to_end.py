"""End to end, as a user runs it: a real search on 2 CPU ranks, its recipe, training from it, the example (on 4
ranks: tp2·cp2 from a recipe, the model split by its TP plan with sequence parallelism, compiled, checkpointed and
sharded by cptune.parallelize)."""

import json
import re
import sys
from pathlib import Path

import pytest

import cptune
from tests._helpers import run_ok, write_recipe

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, timeout=300):
    return run_ok(args, cwd, timeout)


def test_search_writes_recipe_resumes_and_trains_like_one_process(tmp_path):
    search = [sys.executable, "-m", "cptune", "search", "--seq-len", "512", "--nproc", "2", "--memory-budget", "4GiB",
              "--min-seconds", "0.2", "--out", "recipes/e2e.yaml", "--script", str(ROOT / "examples/train_llama_cp.py")]
    first = run(search, tmp_path)
    assert "6 trial(s) run now" in first.stdout and "best: " in first.stdout
    recipe = cptune.load_recipe(tmp_path / "recipes/e2e.yaml")
    assert recipe.metrics.measured and recipe.launch.nproc_per_node == 2 and recipe.workload.seq_len == 512
    again = run(search, tmp_path)
    assert "0 trial(s) run now" in again.stdout  # resumed from cptune.db: nothing measured twice

    run([sys.executable, "-m", "cptune", "launch", "recipes/e2e.yaml"], tmp_path)  # the recipe's script, as is
    run([sys.executable, "-m", "cptune", "launch", "recipes/e2e.yaml", "--",
         str(ROOT / "examples/train_llama_cp.py"), "--losses-out", "cp.json"], tmp_path)
    batch = recipe.config.mesh_shape[0] * recipe.workload.batch  # the global batch the recipe's run trains on
    run([sys.executable, str(ROOT / "examples/train_llama_cp.py"), "--seq-len", "512", "--batch", str(batch),
         "--losses-out", "one.json"], tmp_path)
    cp, one = json.loads((tmp_path / "cp.json").read_text()), json.loads((tmp_path / "one.json").read_text())
    assert cp["world"] == 2 and one["world"] == 1
    assert max(abs(a - b) for a, b in zip(cp["losses"], one["losses"])) <= 1e-5


def test_canonical_example_under_torchrun():
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                  "examples/cp_example.py", "--seq-len", "1024"], ROOT)
    line = next(x for x in result.stdout.splitlines() if x.startswith("max abs error"))
    errors = [float(v) for v in re.findall(r"\d\.\d+e[-+]\d+", line)]
    assert len(errors) == 4 and max(errors) < 1e-5


def test_example_tp_cp_with_compile_selective_ac_and_fsdp_matches_one_process(tmp_path, monkeypatch):
    """Packed long-tailed documents; dp x cp alone, unpacked, on 2 ranks: tests/test_training.py."""
    script = str(ROOT / "examples/train_llama_cp.py")
    workload = cptune.Workload(seq_len=256, heads=4, kv_heads=2, head_dim=16, documents="longtail",
                               step="examples.train_llama_cp:search_step")
    write_recipe(tmp_path / "r.yaml", workload, cptune.CPConfig(mesh_shape=(1, 1, 2, 2), rotate_method="alltoall"),
                 "examples/train_llama_cp.py")
    common = ["--seq-len", "256", "--batch", "2", "--steps", "2", "--documents", "longtail"]
    run([sys.executable, script, *common, "--losses-out", "one.json"], tmp_path)
    run([sys.executable, "-m", "cptune", "launch", "r.yaml", "--", script, *common, "--compile", "--ac", "selective",
         "--fsdp", "--losses-out", "tp.json"], tmp_path, timeout=600)
    tp, one = json.loads((tmp_path / "tp.json").read_text()), json.loads((tmp_path / "one.json").read_text())
    assert (tp["world"], tp["cp"], tp["tp"]) == (4, 2, 2) and tp["compile"] and tp["fsdp"] and tp["ac"] == "selective"
    assert max(abs(a - b) for a, b in zip(tp["losses"], one["losses"])) <= 1e-5, (tp, one)
    # without FSDP2 there is nothing to hold the tensor-parallel shards: said by name before any rank starts
    from cptune.examples import train_llama_cp

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(cptune.ValidationError, match=r"fsdp: is off with dp1·cp2·tp2.*Fix: add --fsdp"):
        train_llama_cp.checked(recipe_path=str(tmp_path / "r.yaml"), seq_len=None, batch=None, compile_=None, ac=None,
                               documents=None, fsdp=False)
