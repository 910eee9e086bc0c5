"""The model you train: a transformers model from its config, searched (``cptune search --model``) and trained
(``examples/train_hf.py``) on real ranks, its losses equal to one process, its checkpoints resumable."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cptune
from cptune._env import environment
from cptune.cli import main
from cptune.recipe import Launch, Metrics, Provenance, Recipe, save_recipe

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests/models/tiny-llama"
SCRIPT = str(ROOT / "examples/train_hf.py")


def run(args, cwd, timeout=600):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def losses(path):
    return json.loads(Path(path).read_text())


def test_two_ranks_train_like_one_process_and_resume_from_a_checkpoint(tmp_path):
    common = ["--model", str(MODEL), "--seq-len", "128", "--batch", "2"]
    run([sys.executable, SCRIPT, *common, "--steps", "3", "--losses-out", "one.json"], tmp_path)
    run([*torchrun(2), SCRIPT, *common, "--steps", "2", "--checkpoint-dir", "ck", "--losses-out", "a.json"], tmp_path)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-2"]  # whole, no .partial left
    run([*torchrun(2), SCRIPT, *common, "--steps", "3", "--checkpoint-dir", "ck", "--resume",
         "--losses-out", "b.json"], tmp_path)
    one, a, b = losses(tmp_path / "one.json"), losses(tmp_path / "a.json"), losses(tmp_path / "b.json")
    assert a["cp"] == 2 and b["start"] == 2 and len(b["losses"]) == 1
    assert max(abs(x - y) for x, y in zip(a["losses"] + b["losses"], one["losses"])) <= 1e-5, (a, b, one)


@pytest.mark.parametrize("nproc,mesh,documents,extra", [
    (4, (2, 2), "longtail", []),
    (2, (1, 2), "4", ["--ac", "selective", "--compile"]),
])
def test_packed_training_from_a_recipe_equals_one_process(tmp_path, nproc, mesh, documents, extra):
    workload = cptune.models.model_workload(MODEL, seq_len=128, batch=1, documents=documents)
    recipe = Recipe(workload=workload, config=cptune.CPConfig(mesh_shape=mesh, rotate_method="alltoall"),
                    launch=Launch(nproc_per_node=nproc, script="examples/train_hf.py"),
                    provenance=Provenance(**environment("cpu", nproc).provenance()), metrics=Metrics(measured=False))
    save_recipe(recipe, tmp_path / "r.yaml")
    run([sys.executable, SCRIPT, "--model", str(MODEL), "--seq-len", "128", "--batch", str(mesh[0]),
         "--documents", documents, "--steps", "2", "--losses-out", "one.json"], tmp_path)
    run([*torchrun(nproc), SCRIPT, "--recipe", "r.yaml", "--steps", "2", *extra, "--losses-out", "cp.json"], tmp_path)
    one, cp = losses(tmp_path / "one.json"), losses(tmp_path / "cp.json")
    assert (cp["dp"], cp["cp"]) == mesh
    assert max(abs(x - y) for x, y in zip(cp["losses"], one["losses"])) <= 1e-5, (cp, one)


def test_search_a_model_then_launch_its_recipe(tmp_path):
    search = [sys.executable, "-m", "cptune", "search", "--model", str(MODEL), "--model-override",
              "num_hidden_layers=1", "--seq-len", "256", "--documents", "4", "--nproc", "2", "--memory-budget", "4GiB",
              "--min-seconds", "0.1", "--out", "m.yaml"]
    found = run(search, tmp_path)
    assert f"model={MODEL} (num_hidden_layers=1)" in found.stderr and "best: " in found.stdout
    recipe = cptune.load_recipe(tmp_path / "m.yaml")
    w = recipe.workload
    assert (w.model, w.model_overrides, w.heads, w.kv_heads, w.head_dim, w.layers) == \
        (str(MODEL), {"num_hidden_layers": 1}, 4, 2, 16, 1)
    assert recipe.launch.script == "examples/train_hf.py" and recipe.metrics.measured
    shown = run([sys.executable, "-m", "cptune", "show", "m.yaml"], tmp_path).stdout
    assert f"model run: {MODEL} with {{'num_hidden_layers': 1}}, 256 tokens x 1 per replica, 4," in shown
    run([sys.executable, "-m", "cptune", "launch", "m.yaml", "--", SCRIPT, "--steps", "2", "--losses-out", "cp.json"],
        tmp_path)
    dp = recipe.config.mesh_shape[0]
    run([sys.executable, SCRIPT, "--model", str(MODEL), "--model-override", "num_hidden_layers=1", "--seq-len", "256",
         "--batch", str(dp), "--documents", "4", "--steps", "2", "--losses-out", "one.json"], tmp_path)
    one, cp = losses(tmp_path / "one.json"), losses(tmp_path / "cp.json")
    assert cp["world"] == 2 and max(abs(x - y) for x, y in zip(cp["losses"], one["losses"])) <= 1e-5, (cp, one)


def test_bad_models_are_refused_by_name_before_any_rank_starts(tmp_path):
    with pytest.raises(cptune.ValidationError, match=r"--model: .*no config.json there.*nothing is downloaded"):
        cptune.models.load_config(tmp_path)
    with pytest.raises(cptune.ValidationError, match=r"--model-override: num_layers: not fields of this LlamaConfig"):
        cptune.models.load_config(MODEL, {"num_layers": 1})
    with pytest.raises(cptune.ValidationError, match=r"--model-override: 'layers' is not KEY=VALUE"):
        cptune.models.parse_overrides(["layers"])
    assert cptune.models.parse_overrides(["num_hidden_layers=1", "rope_theta=1e6", "name=x"]) == \
        {"num_hidden_layers": 1, "rope_theta": 1e6, "name": "x"}
    with pytest.raises(cptune.ValidationError, match=r"differs from --model .*heads=8 \(the model's: 4\).*model_workload"):
        cptune.search(cptune.Workload(model=str(MODEL), seq_len=64), nproc=2, storage=f"sqlite:///{tmp_path}/s.db")
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["search", "--model", str(MODEL), "--heads", "4", "--seq-len", "64"])
    assert out.exit_code == 1 and "a --model's come from its config" in out.output
