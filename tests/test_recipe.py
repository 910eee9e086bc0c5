"""Recipes: schema, YAML round trip, clear errors for bad files, the CLI's show/check/launch."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import cptune
from cptune.cli import main
from cptune.cli._catalog import index_text
from cptune._env import environment
from cptune.recipe import Launch, Metrics, Provenance, Recipe, load_recipe, save_recipe

ROOT = Path(__file__).resolve().parents[1]


def make_recipe(nproc=2, cp=2, script=None, measured=False, device_type="cpu", load_balance=True):
    env = environment("cpu", nproc).provenance()
    env.update(device_type=device_type, backend="gloo" if device_type == "cpu" else "nccl")
    return Recipe(
        workload=cptune.Workload(seq_len=256),
        config=cptune.CPConfig(mesh_shape=(nproc // cp, cp), rotate_method="alltoall", sdpa_backend="flash",
                               load_balance=load_balance),
        launch=Launch(nproc_per_node=nproc, script=script),
        provenance=Provenance(**env),
        metrics=Metrics(measured=measured),
    )


def test_round_trip_and_header(tmp_path):
    path = save_recipe(make_recipe(script="examples/train_llama_cp.py"), tmp_path / "r.yaml")
    text = path.read_text()
    first = text.splitlines()[0]
    assert first.startswith(f"# CPTUNE_RECIPE={path} torchrun --standalone --nnodes=1 --nproc-per-node=2 "
                            "examples/train_llama_cp.py")
    assert "NOT MEASURED" in text
    assert load_recipe(path) == make_recipe(script="examples/train_llama_cp.py")
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temp file


def test_recipes_are_data_only(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("schema_version: 1\nworkload: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(cptune.ValidationError, match="not valid YAML"):
        load_recipe(evil)


@pytest.mark.parametrize("mutate,expected", [
    (lambda d: d.update(schema_version=7), "schema_version: "),
    (lambda d: d.pop("config"), "config: Field required"),
    (lambda d: d["launch"].update(nproc_per_node="two"), "launch.nproc_per_node"),
    (lambda d: d["config"].update(rotate_method="ring"), "use rotate_method='allgather' or 'alltoall'"),
    (lambda d: d["workload"].update(colour="red"), "remove it; Workload accepts"),
])
def test_bad_fields_are_named(tmp_path, mutate, expected):
    data = make_recipe().model_dump(mode="json")
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(cptune.ValidationError) as info:
        load_recipe(path)
    assert expected in str(info.value)


def test_unknown_version_says_regenerate(tmp_path):
    data = make_recipe().model_dump(mode="json")
    data["schema_version"] = 2
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(cptune.ValidationError, match="regenerate it with cptune search"):
        load_recipe(tmp_path / "v2.yaml")


@pytest.mark.parametrize("content,expected", [
    ("workload: [1, 2\n", "not valid YAML at line 2"),
    ("- just\n- a list\n", "not a mapping"),
    ("", "not a mapping"),
])
def test_cli_bad_files_exit_1_without_traceback(tmp_path, content, expected):
    path = tmp_path / "x.yaml"
    path.write_text(content)
    for command in (["show", str(path)], ["check", str(path)], ["launch", str(path), "--", "x.py"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1 and expected in result.output
        assert "Traceback" not in result.output


def test_cli_missing_recipe_and_missing_script(tmp_path):
    result = CliRunner().invoke(main, ["show", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output and "cptune ls lists" in result.output
    path = save_recipe(make_recipe(), tmp_path / "r.yaml")
    result = CliRunner().invoke(main, ["launch", str(path), "--", "no_such_script.py"])
    assert result.exit_code == 1 and "'no_such_script.py' does not exist" in result.output
    result = CliRunner().invoke(main, ["launch", str(path)])
    assert result.exit_code == 1 and "launch.script" in result.output


def test_show_and_check(tmp_path):
    path = save_recipe(make_recipe(), tmp_path / "r.yaml")
    shown = CliRunner().invoke(main, ["show", str(path)])
    assert shown.exit_code == 0 and "dp1·cp2 alltoall lb flash" in shown.output and "not measured" in shown.output
    as_json = CliRunner().invoke(main, ["show", "--json", str(path)])
    assert '"rotate_method": "alltoall"' in as_json.output
    assert CliRunner().invoke(main, ["check", str(path)]).exit_code == 0
    wrong = CliRunner().invoke(main, ["check", str(path), "--world-size", "4"])
    assert wrong.exit_code == 1 and "the recipe is for 2 ranks" in wrong.output and "cptune launch" in wrong.output
    gpu = save_recipe(make_recipe(device_type="cuda"), tmp_path / "gpu.yaml")
    result = CliRunner().invoke(main, ["check", str(gpu)])
    assert result.exit_code == 1 and "none is visible here" in result.output


def test_dry_run_prints_a_command_that_runs(tmp_path):
    path = save_recipe(make_recipe(nproc=2, cp=2, load_balance=False), tmp_path / "r.yaml")  # non-causal ViT
    script = ROOT / "examples" / "vit_noncausal.py"
    out = CliRunner().invoke(main, ["launch", "--dry-run", str(path), "--", str(script), "--steps", "1",
                                    "--image-size", "64"])
    assert out.exit_code == 0
    command = out.output.strip()
    assert command.startswith(f"CPTUNE_RECIPE={path} torchrun --standalone --nnodes=1 --nproc-per-node=2 ")
    bindir = Path(sys.executable).parent  # the torchrun of this environment, as an activated venv has
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=240,
                         env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 0 loss" in run.stdout and "2 rank(s)" in run.stdout


def test_multinode_flags_and_environment_reach_torchrun_and_the_recipe_keeps_its_shape(tmp_path, monkeypatch):
    two_nodes = make_recipe()
    two_nodes = two_nodes.model_copy(update={"launch": Launch(nnodes=2, nproc_per_node=1)})
    path = save_recipe(two_nodes, tmp_path / "r.yaml")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = CliRunner().invoke(main, ["launch", "--dry-run", "--node-rank", "1", "--rdzv-endpoint", "node0:29500",
                                    str(path), "--", str(script)])
    argv = shlex.split(out.output)
    assert "--nnodes=2" in argv and "--node-rank=1" in argv and "--rdzv-endpoint=node0:29500" in argv, out.output
    assert "--nproc-per-node=1" in argv
    placeholder = CliRunner().invoke(main, ["launch", "--dry-run", str(path), "--", str(script)])
    assert placeholder.exit_code == 1 and "pass --rdzv-endpoint" in placeholder.output
    monkeypatch.setenv("PET_NODE_RANK", "1")  # what a scheduler's torchrun environment says
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "node0:29501")
    argv = shlex.split(CliRunner().invoke(main, ["launch", "--dry-run", str(path), "--", str(script)]).output)
    assert "--node-rank=1" in argv and "--rdzv-endpoint=node0:29501" in argv
    wrong = CliRunner().invoke(main, ["launch", "--dry-run", "--nnodes", "3", str(path), "--", str(script)])
    assert wrong.exit_code == 1 and "--nnodes: the recipe is for 2 ranks (2 node(s) x 1) but this job has 3" in \
        wrong.output, wrong.output
    outside = CliRunner().invoke(main, ["launch", "--dry-run", "--node-rank", "2", str(path), "--", str(script)])
    assert outside.exit_code == 1 and "--node-rank: is 2 in a job of 2 node(s)" in outside.output, outside.output


def _recipe_world_mismatch(path):
    import torch

    try:
        with cptune.context_parallel(buffers=[torch.zeros(1, 2, 8, 4)], seq_dims=[2], recipe=path):
            pass
    except cptune.CPTuneError as exc:
        return str(exc)
    return "no error"


def test_recipe_for_another_world_size_fails_before_any_collective(ranks, tmp_path):
    path = save_recipe(make_recipe(nproc=4, cp=4), tmp_path / "r4.yaml")
    for message in ranks(2).run(_recipe_world_mismatch, str(path)):
        assert "is for 4 ranks" in message and "this job has 2" in message


def test_every_recipe_in_the_repo_loads_and_is_indexed():
    index = (ROOT / "recipes" / "README.md").read_text()
    assert index == index_text(ROOT / "recipes"), "recipes/README.md is stale: run cptune index recipes"
    files = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert files, "recipes/ holds no recipe"
    for path in files:
        recipe = load_recipe(path)
        assert path.name in index, f"{path.name} is not listed in recipes/README.md"
        assert recipe.metrics.measured and recipe.provenance.device_type == "cpu"
        assert path.read_text().startswith("# CPTUNE_RECIPE=")
