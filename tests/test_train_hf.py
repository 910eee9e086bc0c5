"""The model you train: a transformers model from its config, searched (``cptune search --model``) and trained
(``examples/train_hf.py``) on real ranks, its losses equal to one process, its checkpoints resumable."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cptune
from cptune.cli import main
from cptune.recipe import Metrics
from tests import _warm as warm
from tests._helpers import run_ok as run, write_recipe

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests/models/tiny-llama"
SCRIPT = str(ROOT / "examples/train_hf.py")


def torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def losses(path):
    return json.loads(Path(path).read_text())


def _recipe(tmp_path, workload, mesh, script="examples/train_hf.py"):
    return write_recipe(tmp_path / "r.yaml", workload, cptune.CPConfig(mesh_shape=mesh, rotate_method="alltoall"),
                        script)


def test_packed_training_on_four_ranks_equals_one_process_and_resumes_from_a_checkpoint(tmp_path):
    """Packed long-tailed documents, selective AC, from a recipe on four ranks: tp2·cp2 (the model split by its own
    TP plan, FSDP2 over cp) for 2 steps; its checkpoint resumed as dp2·cp2 (FSDP2 over all four: DCP reshards it),
    the first-step check forced there, for step 3; that checkpoint resumed as tp2·cp2 for step 4. The 4 losses are
    the one-process run's."""
    _recipe(tmp_path, cptune.models.model_workload(MODEL, seq_len=128, batch=1, documents="longtail",
                                                   ac="selective"), (2, 2))
    run([sys.executable, SCRIPT, "--model", str(MODEL), "--seq-len", "128", "--batch", "2", "--documents", "longtail",
         "--steps", "4", "--losses-out", "one.json"], tmp_path)
    tp = ["config.mesh_shape=[1,1,2,2]", "--", SCRIPT, "--batch", "2", "--checkpoint-dir", "ck"]
    run([sys.executable, "-m", "cptune", "launch", "r.yaml", *tp, "--steps", "2", "--losses-out", "a.json"], tmp_path)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-2"]  # whole, no .partial left
    resumed = run([*torchrun(4), SCRIPT, "--recipe", "r.yaml", "--steps", "3", "--checkpoint-dir", "ck", "--resume",
                   "--losses-out", "b.json", "--check", "always"], tmp_path)  # the check up front: the same loss
    assert "cptune first-step check of LlamaForCausalLM (llama) under dp2·cp2" in resumed.stdout \
        and "packed, float32): exact;" in resumed.stdout, resumed.stdout
    run([sys.executable, "-m", "cptune", "launch", "r.yaml", *tp, "--steps", "4", "--resume", "--losses-out",
         "c.json"], tmp_path)
    one, a, b, c = (losses(tmp_path / f"{x}.json") for x in ("one", "a", "b", "c"))
    assert (a["dp"], a["cp"]) == (1, 2) and a["loss"] == c["loss"] == "vocab-parallel", (a, c)
    assert (b["dp"], b["cp"]) == (2, 2) and (b["start"], c["start"]) == (2, 3) and len(b["losses"]) == 1, (b, c)
    assert max(abs(x - y) for x, y in zip(a["losses"] + b["losses"] + c["losses"], one["losses"])) <= 1e-5, \
        (a, b, c, one)
    assert len(a["losses"] + b["losses"] + c["losses"]) == 4


def test_the_same_run_twice_gives_the_same_losses(tmp_path):
    """Uninitialized memory anywhere in the built model (rotary frequencies on transformers 4.56-4.57 once were)
    changes a run's losses from one process to the next, or makes them NaN: two runs must agree to the bit."""
    for name in ("a.json", "b.json"):
        run([sys.executable, SCRIPT, "--model", str(MODEL), "--seq-len", "64", "--batch", "2", "--steps", "2",
             "--losses-out", name], tmp_path)
    a, b = losses(tmp_path / "a.json")["losses"], losses(tmp_path / "b.json")["losses"]
    assert len(a) == 2 and all(x == x for x in a) and a == b, (a, b)
    # a recipe that asks for the whole logits (cptune search --loss whole) trains with them: the same losses
    _recipe(tmp_path, cptune.models.model_workload(MODEL, seq_len=64, batch=2, loss="whole"), (1, 1))
    run([sys.executable, SCRIPT, "--recipe", "r.yaml", "--steps", "2", "--losses-out", "whole.json"], tmp_path)
    whole = losses(tmp_path / "whole.json")
    assert losses(tmp_path / "a.json")["loss"] in ("torch", "cptune") and whole["loss"] == "whole logits (asked)"
    assert max(abs(x - y) for x, y in zip(whole["losses"], a)) <= 1e-5, (whole, a)


def test_search_a_model_then_launch_its_recipe_compiled(tmp_path):
    search = [sys.executable, "-m", "cptune", "search", "--model", str(MODEL), "--model-override",
              "num_hidden_layers=1", "--seq-len", "256", "--documents", "4", "--nproc", "2", "--memory-budget", "4GiB",
              "--min-seconds", "0.1", "--out", "m.yaml"]
    found = run(search, tmp_path)
    assert f"model={MODEL} (num_hidden_layers=1)" in found.stderr and "best: " in found.stdout
    recipe = cptune.load_recipe(tmp_path / "m.yaml")
    w = recipe.workload
    assert (w.model, w.model_overrides, w.heads, w.kv_heads, w.head_dim, w.layers) == \
        (str(MODEL), {"num_hidden_layers": 1}, 4, 2, 16, 1)
    assert recipe.launch.script == "cptune.examples.train_hf" and recipe.metrics.measured  # installed with cptune
    shown = run([sys.executable, "-m", "cptune", "show", "m.yaml"], tmp_path).stdout
    assert f"model run: {MODEL} with {{'num_hidden_layers': 1}}, 256 tokens x 1 per replica, 4," in shown
    # trained from the recipe (its model and overrides), unpacked and compiled here, against one process
    run([sys.executable, "-m", "cptune", "launch", "m.yaml", "--", SCRIPT, "--steps", "2", "--documents", "1",
         "--compile", "--losses-out", "cp.json"], tmp_path)
    dp = recipe.config.mesh_shape[0]
    run([sys.executable, SCRIPT, "--model", str(MODEL), "--model-override", "num_hidden_layers=1", "--seq-len", "256",
         "--batch", str(dp), "--documents", "1", "--steps", "2", "--losses-out", "one.json"], tmp_path)
    one, cp = losses(tmp_path / "one.json"), losses(tmp_path / "cp.json")
    assert cp["world"] == 2 and max(abs(x - y) for x, y in zip(cp["losses"], one["losses"])) <= 1e-5, (cp, one)
    assert w.loss == "chunked" and cp["loss"] in ("torch", "cptune")  # the loss the search measured


def test_a_model_search_checks_a_family_the_matrix_has_not_proven_once_before_it_measures(tmp_path):
    config = transformers.CONFIG_MAPPING["helium"](vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=16)
    config.save_pretrained(tmp_path / "helium")
    found = run([sys.executable, "-m", "cptune", "search", "--model", "helium", "--seq-len", "64", "--nproc", "2",
                 "--memory-budget", "4GiB", "--min-seconds", "0.05", "--n-trials", "1", "--json"], tmp_path)
    check = json.loads(found.stdout)["check"]
    assert "first-step check of HeliumForCausalLM (helium) under dp1·cp2" in check and ": exact;" in check, check


def test_a_model_search_with_max_tp_measures_the_model_split_by_tensor_parallelism(tmp_path):
    """--max-tp 2: the search's space holds tp2 meshes (the model split by its own TP plan, measured on the ranks),
    in a study of its own, which a search without it does not resume; without --model there is no model to split,
    and that is said by name."""
    search = [sys.executable, "-m", "cptune", "search", "--model", str(MODEL), "--model-override",
              "num_hidden_layers=1", "--seq-len", "64", "--nproc", "4", "--memory-budget", "4GiB", "--min-seconds",
              "0.05"]
    found = json.loads(run([*search, "--max-tp", "2", "--json"], tmp_path).stdout)
    assert found["study_name"].split("-")[-2] == "tp2"
    rows = {tuple(t["config"]["mesh_shape"]): t for t in found["trials"] if t["tokens_per_s"]}
    tp = rows[(1, 2, 1, 2)]  # dp2·cp1·tp2: measured, fits, and its peak is a sharded model's
    assert tp["feasible"] and 0 < tp["peak_bytes"] <= rows[(4, 1)]["peak_bytes"] * 1.5, rows.keys()
    assert any(len(t["config"]["mesh_shape"]) == 4 and t["config"]["mesh_shape"][2] == 2 for t in found["trials"])
    refused = warm.run([sys.executable, "-m", "cptune", "search", "--seq-len", "64", "--max-tp", "2"], tmp_path, 120)
    assert refused.returncode == 1 and "--max-tp: is 2 but there is no model to split" in refused.stderr, refused.stderr
    refused = warm.run([sys.executable, "-m", "cptune", "search", "--seq-len", "64", "--loss", "whole"], tmp_path, 120)
    assert refused.returncode == 1 and "--loss: is how a --model's step takes its loss" in refused.stderr, \
        refused.stderr
    # the study's axes hold tp: resumed by name without --max-tp, it is another question, said by name
    other = warm.run([*search, "--study-name", found["study_name"]], tmp_path, 300)
    assert other.returncode == 1 and "tensor-parallel degrees [1, 2] -> [1]" in other.stderr, other.stderr[-2000:]


def test_bad_models_are_refused_by_name_before_any_rank_starts(tmp_path):
    with pytest.raises(cptune.ValidationError, match=r"model: .*no config.json there.*nothing is downloaded"):
        cptune.models.load_config(tmp_path)
    with pytest.raises(cptune.ValidationError, match=r"model_overrides: num_layers: not fields of this LlamaConfig"):
        cptune.models.load_config(MODEL, {"num_layers": 1})
    with pytest.raises(cptune.ValidationError, match=r"model_overrides: 'layers' is not KEY=VALUE"):
        cptune.models.parse_overrides(["layers"])
    # an override applies before the config is made: what derives from it follows (head_dim from hidden_size)
    assert cptune.models.attention_shape(cptune.models.load_config(MODEL, {"hidden_size": 128})) == \
        {"heads": 4, "kv_heads": 2, "head_dim": 32, "layers": 2}
    assert cptune.models.parse_overrides(["num_hidden_layers=1", "rope_theta=1e6", "name=x"]) == \
        {"num_hidden_layers": 1, "rope_theta": 1e6, "name": "x"}
    with pytest.raises(cptune.ValidationError, match=r"differs from --model .*heads=8 \(the model's: 4\).*model_workload"):
        cptune.tune(cptune.Workload(model=str(MODEL), seq_len=64), nproc=2, storage=f"sqlite:///{tmp_path}/s.db")
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["search", "--model", str(MODEL), "--heads", "4", "--seq-len", "64"])
    assert out.exit_code == 1 and "a --model's come from its config" in out.output


TRAINER = str(ROOT / "examples/train_hf_trainer.py")


@pytest.mark.parametrize("nproc,mesh,extra", [
    (2, (1, 2), ["--grad-accum", "2"]),                       # packed (DataCollatorWithFlattening), accumulation
    (4, (2, 2), ["--unpacked", "64", "--per-device-batch", "2"]),  # fixed-length rows, two replicas
    (2, (1, 2), ["--grad-accum", "2", "--no-fsdp"]),          # the model whole on every rank, DDP
])
def test_hf_trainer_under_cp_equals_a_one_process_trainer(tmp_path, nproc, mesh, extra):
    """Built sharded by FSDP2 under torchrun (no rank holds the whole model) and trained as sharded, or whole
    with DDP (--no-fsdp): the losses and final parameters are a one-process transformers.Trainer's."""
    pytest.importorskip("accelerate")
    import torch

    _recipe(tmp_path, cptune.models.model_workload(MODEL, seq_len=64), mesh, "examples/train_hf_trainer.py")
    from cptune.hf._trainer import takes_sharded_models

    if "--no-fsdp" not in extra and not takes_sharded_models():  # transformers 4.x: refused by name, at once
        done = subprocess.run([*torchrun(nproc), TRAINER, "--recipe", "r.yaml", *extra, "--out", "cp.pt"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode != 0 and len(set(said)) == 1, done.stderr[-3000:]
        assert "--fsdp: the Trainer of transformers 4." in said[0] and "Fix:" in said[0], said
        assert not (tmp_path / "trainer-out").exists()  # refused before any rank started or built the model
        return
    run([sys.executable, TRAINER, "--model", str(MODEL), "--plain", "--replicas", str(mesh[0]), *extra,
         "--out", "one.pt"], tmp_path)
    run([*torchrun(nproc), TRAINER, "--recipe", "r.yaml", *extra, "--out", "cp.pt"], tmp_path)
    one, cp = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "cp.pt")
    steps = 3 * (2 if "--grad-accum" in extra else 1)
    assert (cp["dp"], cp["cp"], cp["cp_steps"]) == (*mesh, steps) and len(one["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(cp["losses"], one["losses"])) <= 1e-5, (cp["losses"], one["losses"])
    # parameters after 3 AdamW steps (lr 1e-3): Adam divides by sqrt(v), so where a gradient is near zero a
    # rounding difference moves the update by a share of lr: 1.6e-5 measured at dp 2 x cp 2, DDP and FSDP2 alike
    assert max((one["params"][k] - cp["params"][k]).abs().max().item() for k in one["params"]) <= 5e-5
    assert cp["sharded"] == ("--no-fsdp" not in extra) and len(cp["peaks"]) == nproc


def test_hf_trainer_refuses_a_padding_collator_by_name(tmp_path):
    pytest.importorskip("accelerate")
    import torch

    import cptune.hf

    model = cptune.models.build_model(cptune.models.load_config(MODEL), "cpu")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = cptune.hf.Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2]}])
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with pytest.raises(cptune.ValidationError, match=r"attention_mask: masks some tokens .*DataCollatorWithFlattening"):
        trainer.training_step(trainer.model, {"input_ids": ids, "labels": ids, "attention_mask": mask})


def test_check_says_when_a_rank_here_cannot_hold_the_measured_peak(tmp_path):
    from cptune.cli._recipe_check import check_recipe

    path = _recipe(tmp_path, cptune.models.model_workload(MODEL, seq_len=64), (1, 2))
    recipe = cptune.load_recipe(path)
    fits = recipe.model_copy(update={"metrics": Metrics(measured=True, peak_bytes_per_rank=[2**20, 2**20])})
    huge = recipe.model_copy(update={"metrics": Metrics(measured=True, peak_bytes_per_rank=[2**20, 2**50])})
    assert not [p for p in check_recipe(fits) if p.argument == "metrics.peak_bytes_per_rank"]
    [problem] = [p for p in check_recipe(huge) if p.argument == "metrics.peak_bytes_per_rank"]
    assert "1024.00TiB per rank, is more than a rank has here" in problem.message and "RAM over 2 ranks" in problem.message
