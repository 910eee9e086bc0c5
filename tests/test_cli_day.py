"""A new user's day with the CLI and recipes: units, launch pass-through and overrides, headlines, ls/cp,
edited recipes, the index guard, check --json, and the data-parallel helpers."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import cptune
from cptune.cli import main
from cptune.recipe import load_recipe, save_recipe
from tests.test_recipe import make_recipe

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd=None):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_search_json_states_its_unit():
    from cptune.search.result import SearchResult

    r = SearchResult(study_name="s", storage=None, workload=cptune.Workload(), world_size=2, device="cpu",
                     nproc_per_node=2, memory_budget=2**30)
    assert r.to_dict()["memory_budget_unit"] == "bytes"


def test_launch_passes_torchrun_options_script_args_and_overrides(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    path = save_recipe(make_recipe(script=str(script), measured=True), tmp_path / "r.yaml")
    out = cli("launch", "--dry-run", path, "--max-restarts", "3", "config.rotate_method=allgather",
              "--", "--steps", "3").output
    cmd = out.strip().splitlines()[-1]
    assert "--nproc-per-node=2 --max-restarts 3 " + str(script) + " --steps 3" in cmd
    patched = load_recipe(cmd.split()[0].split("=", 1)[1])
    assert patched.config.rotate_method == "allgather" and not patched.metrics.measured
    assert "config.rotate_method: 'alltoall' -> 'allgather'" in patched.metrics.note
    assert load_recipe(path).config.rotate_method == "alltoall"  # the recipe file itself is untouched
    other = tmp_path / "other.py"
    other.write_text("")
    assert f"{other} --x 1" in cli("launch", "--dry-run", path, "--", other, "--x", "1").output


@pytest.mark.parametrize("args,named", [
    (["launch", "{r}", "stray"], "'stray' is neither an override nor a torchrun option"),
    (["launch", "{r}", "config.rotate=x"], "config.rotate: is not a recipe field"),
    (["launch", "{r}", "config.mesh_shape=[3,3]"], "mesh_shape"),
    (["show", "nothere.yaml"], "cptune ls lists"),
    (["check", "--world-size", "4", "{r}"], "--world-size: the recipe is for 2 ranks"),
    (["search", "--kv-heads", "3"], "--kv-heads: 3 does not divide heads (8). Fix: use a divisor of 8"),
])
def test_headlines_name_the_real_cause(tmp_path, args, named):
    script = tmp_path / "train.py"
    script.write_text("")
    r = save_recipe(make_recipe(script=str(script)), tmp_path / "r.yaml")
    result = CliRunner().invoke(main, [a.format(r=r) for a in args])
    assert result.exit_code in (1, 2) and named in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_search_on_cuda_without_a_gpu_says_so():
    result = CliRunner().invoke(main, ["search", "--device", "cuda"])
    assert result.exit_code == 1 and "--device: is cuda but this machine has no usable CUDA GPU" in result.output


def test_ls_cp_and_shipped_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    listed = json.loads(cli("ls", "--json").output)
    shipped = [r for r in listed if r["where"] == "shipped"]
    assert {r["name"] for r in shipped} >= {"cpu-2r-s4096-causal", "cpu-2r-s2048-L32-budget630MiB"}
    assert all("tok/s" in r["figures"] for r in shipped)
    assert "copied:" in cli("cp", "cpu-2r-s4096-causal", "recipes/").output
    again = CliRunner().invoke(main, ["cp", "cpu-2r-s4096-causal", "recipes/"])
    assert again.exit_code == 1 and "exists" in again.output
    missing = CliRunner().invoke(main, ["cp", "nosuch", "x.yaml"])
    assert missing.exit_code == 1 and "cpu-2r-s4096-causal" in missing.output  # names what there is
    local = [r for r in json.loads(cli("ls", "--json").output) if r["where"] == "local"]
    assert [r["name"] for r in local] == ["cpu-2r-s4096-causal"]


def _measured_recipe(tmp_path):
    workload = cptune.Workload(seq_len=256)
    from cptune.search.records import TrialRecord
    from cptune.search.result import SearchResult

    best = TrialRecord(number=0, config=cptune.CPConfig(mesh_shape=(1, 2), sdpa_backend="flash"), state="ok",
                       tokens_per_s=1000.0, step_time_s=0.1, peak_bytes=2**20, peak_per_rank=[2**20, 2**20],
                       feasible=True)
    result = SearchResult(study_name="s", storage=None, workload=workload, world_size=2, device="cpu",
                          nproc_per_node=2, memory_budget=2**30, trials=[best])
    return save_recipe(cptune.recipe.recipe_from_search(result), tmp_path / "m.yaml")


def test_a_recipe_edited_after_measuring_is_shown_unmeasured(tmp_path):
    path = _measured_recipe(tmp_path)
    assert load_recipe(path).figures_apply and "1,000 tokens/s" in cli("show", path).output
    path.write_text(path.read_text().replace("mesh_shape: [1, 2]", "mesh_shape: [2, 1]"))
    edited = load_recipe(path)
    assert edited.edited and not edited.figures_apply
    assert "edited after measuring" in cli("show", path).output
    report = CliRunner().invoke(main, ["check", "--json", str(path)])
    data = json.loads(report.output)
    assert report.exit_code == 1 and not data["ok"] and data["problems"][0]["argument"] == "metrics"


def test_an_edited_figure_or_a_deleted_digest_is_never_read_as_measured(tmp_path):
    path = _measured_recipe(tmp_path)
    text = path.read_text()
    path.write_text(text.replace("tokens_per_s: 1000.0", "tokens_per_s: 5000.0"))  # a better-looking figure
    edited = load_recipe(path)
    assert edited.edited and not edited.figures_apply and "5,000" not in cli("show", path).output
    path.write_text("\n".join(line for line in text.splitlines() if "digest:" not in line) + "\n")
    bare = load_recipe(path)
    assert not bare.edited and not bare.verifiable and not bare.figures_apply
    assert "not verifiable" in cli("show", path).output and "1,000 tokens/s" not in cli("show", path).output
    assert [r["figures"] for r in json.loads(cli("ls", "--json", tmp_path).output) if r["where"] == "local"] == \
        ["not verifiable (no digest)"]
    report = CliRunner().invoke(main, ["check", "--json", str(path)])
    assert report.exit_code == 1 and json.loads(report.output)["problems"][0]["argument"] == "metrics.digest"


def test_a_digest_written_before_metrics_were_covered_still_verifies(tmp_path):
    recipe = load_recipe(_measured_recipe(tmp_path))
    old = recipe.model_copy(update={"metrics": recipe.metrics.model_copy(update={"digest": recipe._v1_digest()})})
    assert old.figures_apply
    moved = old.model_copy(update={"config": old.config.model_copy(update={"rotate_method": "alltoall"})})
    assert moved.edited
    # frozen: the hash of a shipped recipe's v1-era fields alone (Workload seq_len ... step, CPConfig rotate_method ...
    # ulysses_degree), so a field added since (documents, mixers, video, ep_degree, ...) cannot change a v1 digest
    shipped = load_recipe(Path(__file__).resolve().parents[1] / "recipes/cpu-2r-s4096-causal.yaml")
    assert shipped._v1_digest() == "b152b02f49dfd0c6"


def test_index_guards_hand_written_readmes_and_missing_folders(tmp_path):
    save_recipe(make_recipe(), tmp_path / "a.yaml")
    (tmp_path / "README.md").write_text("# my notes\n")
    refused = CliRunner().invoke(main, ["index", str(tmp_path)])
    assert refused.exit_code == 1 and "not written by cptune index" in refused.output
    assert (tmp_path / "README.md").read_text() == "# my notes\n"
    assert cli("index", "--force", tmp_path).exit_code == 0 and "| [a.yaml]" in (tmp_path / "README.md").read_text()
    assert cli("index", tmp_path).exit_code == 0  # its own file: rewritten without --force
    missing = CliRunner().invoke(main, ["index", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "is not a folder" in missing.output and "Traceback" not in missing.output


def _replica_case(mesh_shape):
    config = cptune.CPConfig(mesh_shape=mesh_shape)
    rows = cptune.replica_rows(8, config=config)
    x = torch.zeros(2, 16)
    with cptune.context_parallel(buffers=[x], seq_dims=[1], config=config) as cp:
        return {"rank": dist.get_rank(), "rows": (rows.start, rows.stop), "dp_rank": cp.dp_rank,
                "cp_rank": cp.cp_rank}


def test_replica_rows_and_dp_rank(ranks):
    got = ranks(4).run(_replica_case, (2, 2))
    assert [(r["rows"], r["dp_rank"], r["cp_rank"]) for r in got] == [
        ((0, 4), 0, 0), ((0, 4), 0, 1), ((4, 8), 1, 0), ((4, 8), 1, 1)]


def test_a_rate_under_one_token_a_second_is_printed_not_rounded_to_zero(tmp_path):
    """A model that takes a minute a step (the scale test's on 2 cores) measures 0.533 tokens/s: the table, its
    range and the best line say so, where whole numbers printed 0."""
    from cptune.sizes import format_rate
    from cptune.search.records import TrialRecord
    from cptune.search.result import SearchResult

    assert [format_rate(x) for x in (0.53321, 9.0912, 45.27, 1234.6)] == ["0.533", "9.09", "45.3", "1,235"]
    slow = TrialRecord(number=0, config=cptune.CPConfig(mesh_shape=(2, 1)), state="ok", tokens_per_s=0.53321,
                       tps_low=0.5012, tps_high=0.5499, plan_tps=0.61, step_time_s=60.0, peak_bytes=2**30,
                       peak_per_rank=[2**30, 2**30], feasible=True)
    result = SearchResult(study_name="s", storage=None, workload=cptune.Workload(seq_len=16), world_size=2,
                          device="cpu", nproc_per_node=2, memory_budget=2**31, trials=[slow])
    row = result.table().splitlines()[2].split()
    start = row.index("0.533")  # tokens/s, then plan and the IQR
    assert row[start:start + 3] == ["0.533", "0.61", "0.501-0.55"], row
    path = save_recipe(cptune.recipe.recipe_from_search(result), tmp_path / "slow.yaml")
    assert "0.533 tokens/s" in cli("show", path).output
