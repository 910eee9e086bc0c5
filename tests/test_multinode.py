"""Two torchrun agents on this host (c10d rendezvous) stand in for two nodes: the search they run, into a PostgreSQL
study, writes a recipe of their shape (2 nodes x 1 rank), `cptune show` says so, the next job resumes the study
measuring nothing twice, and `cptune launch` on each node trains from the recipe."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cptune.launch import free_port
from cptune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _agents(cmd_for_node, cwd: Path, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Both nodes' commands at once; their results in node order."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd_for_node(n), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n in (0, 1)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server on 127.0.0.1 for this module, run as an unprivileged user (it refuses root)."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    pytest.importorskip("psycopg2", reason="the postgres extra (psycopg2-binary) is not installed")
    home = Path(tempfile.mkdtemp(prefix="cptune-pg-"))
    home.chmod(0o755)
    as_user = {}
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("nobody")
        os.chown(home, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    port = free_port()
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=home, **as_user)
    made = run(initdb, "-D", str(home / "data"), "-U", "cptune", "--auth=trust")
    if made.returncode != 0:
        pytest.skip(f"initdb could not make a cluster: {made.stderr[-500:]}")
    started = run(pg_ctl, "-D", str(home / "data"), "-l", str(home / "log"), "-w", "-o",
                  f"-p {port} -k {home} -c listen_addresses=127.0.0.1", "start")
    if started.returncode != 0:
        pytest.skip(f"the PostgreSQL server did not start: {started.stderr[-500:]}")
    try:
        yield f"postgresql+psycopg2://cptune@127.0.0.1:{port}/postgres"  # the database initdb makes
    finally:
        run(pg_ctl, "-D", str(home / "data"), "-m", "fast", "-w", "stop")
        shutil.rmtree(home, ignore_errors=True)


def test_a_two_node_search_writes_its_shape_and_launch_on_each_node_trains_from_it(tmp_path, postgres):
    """Into one PostgreSQL study, which the next job resumes measuring nothing twice."""
    search = ["-m", "cptune", "search", "--seq-len", "512", "--workload",
              "examples.train_llama_cp:search_step", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
              "--min-seconds", "0.1", "--out", "two-nodes.yaml", "--script", str(ROOT / "examples" / "train_llama_cp.py"),
              "--storage", postgres]

    def job():
        endpoint = f"127.0.0.1:{free_port()}"
        return _agents(lambda node: [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                                     "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "search",
                                     *search], tmp_path)

    searched = job()
    for node, run in enumerate(searched):
        assert run.returncode == 0, f"node {node}:\n{run.stderr[-3000:]}"
        assert "terminate called" not in run.stderr
    recipe = load_recipe(tmp_path / "two-nodes.yaml")
    assert (recipe.launch.nnodes, recipe.launch.nproc_per_node) == (2, 1)
    assert recipe.provenance.device_count == 2
    shown = subprocess.run([str(BIN / "cptune"), "show", "two-nodes.yaml"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert "launch   : 2 node(s) x 1 ranks" in shown.stdout, shown.stdout
    again = job()  # the next job: the same study, resumed
    assert all(r.returncode == 0 for r in again), again[0].stderr[-2000:] + again[1].stderr[-2000:]
    assert "0 trial(s) run now" in "".join(r.stdout for r in again), again[0].stdout + again[1].stdout

    endpoint = f"127.0.0.1:{free_port()}"
    trained = _agents(lambda node: [str(BIN / "cptune"), "launch", "two-nodes.yaml", "--node-rank", str(node),
                                    "--rdzv-endpoint", endpoint, "--", "--steps", "2"], tmp_path)
    for node, run in enumerate(trained):
        assert run.returncode == 0, f"node {node}:\n{run.stderr[-3000:]}"
    printed = "".join(r.stdout for r in trained)
    assert "step 1 loss" in printed and "world 2 (" in printed, printed  # one job of 2 ranks, one per node
