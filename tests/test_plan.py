"""cptune plan: the step model, hardware profiles, calibration, the CLI and predicted recipes (no ranks, no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import cptune
import cptune.plan as P
from cptune.plan._calibrate import fold
from cptune.plan import busiest_pairs, ring_blocks
from cptune.plan._step import RING_STEP_BYTES
from cptune.search.memory import predict_peak
from cptune.errors import ValidationError

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = ROOT / "examples/models/llama-3.1-8b"
TINY = ROOT / "tests/models/tiny-llama"


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The command as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "cptune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _run(*args: str):
    """The same command in this process (click's runner): its exit code, stdout and stderr."""
    from cptune.cli import main

    try:
        runner = CliRunner(mix_stderr=False)  # click 8.1 mixes them unless told
    except TypeError:
        runner = CliRunner()  # click 8.2 and later keep stderr apart
    return runner.invoke(main, list(args), catch_exceptions=False)


def _dims() -> P.ModelDims:
    return P.dims_from_config(LLAMA_8B)


def _predict(config: cptune.CPConfig, ac: str = "none", seq_len: int = 131072, **kw) -> P.Prediction:
    dims = _dims()
    return P.predict(dims, P.plan_workload(dims, seq_len, **kw), P.Point(config, ac), P.load_hardware("h100"), 8)


def test_plan_answers_for_a_64_gpu_cluster_in_seconds(tmp_path):
    started = time.monotonic()
    out = _cli("plan", "--model", str(LLAMA_8B), "--seq-len", "131072", "--gpus", "64", "--gpus-per-node", "8",
               "--hardware", "h100", "--memory-budget", "80GiB", "--json")
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert elapsed < 60, elapsed  # seconds, with the interpreter's and torch's import
    plan = json.loads(out.stdout)
    preds = plan["predictions"]
    assert plan["gpus"] == 64 and len(preds) > 100
    labels = {p["point"]["label"] for p in preds}
    assert any("hybrid" in x for x in labels) and any("ulysses" in x for x in labels)
    assert {p["point"]["ac"] for p in preds} == {"none", "selective", "full"}
    feasible = [p for p in preds if p["infeasible"] is None]
    assert feasible and plan["best"]["point"] == feasible[0]["point"]
    rates = [p["tokens_per_s_per_gpu"] for p in feasible]
    assert rates == sorted(rates, reverse=True)
    for p in preds:  # every row: a peak, a time split, and a bottleneck or the reason it cannot run
        assert p["peak_bytes"] > 0 and p["time"]["compute"] > 0 and p["bottleneck"]
        if p["infeasible"]:
            assert "budget" in p["infeasible"] and p["peak_bytes"] > 80 * 2**30
    assert any(p["infeasible"] for p in preds)  # dp-only at 131072 tokens does not fit 80GiB
    assert all(p["point"]["config"]["mesh_shape"][1] > 1 for p in feasible[:5])
    assert any("32 heads do not divide among 64 Ulysses ranks" in r["reason"] for r in plan["invalid"])


def test_a_predicted_recipe_says_so_wherever_it_is_read(tmp_path):
    recipe_path = tmp_path / "pred.yaml"
    out = _run("plan", "--model", str(LLAMA_8B), "--seq-len", "65536", "--gpus", "16", "--hardware", "h200",
               "--out", str(recipe_path))
    assert out.exit_code == 0, out.stderr
    assert "best (predicted):" in out.stdout and "predicted recipe" in out.stderr
    recipe = cptune.load_recipe(recipe_path)
    assert not recipe.metrics.measured and recipe.metrics.predicted_by.startswith("cptune plan on H200")
    assert not recipe.figures_apply and recipe.figures_status().startswith("predicted, not measured")
    assert recipe.launch.nnodes == 2 and recipe.launch.nproc_per_node == 8
    assert recipe.workload.ac in ("none", "selective", "full") and recipe.workload.model == str(LLAMA_8B)
    assert recipe_path.read_text().splitlines()[2].startswith("# PREDICTED, NOT MEASURED")
    shown = _run("show", str(recipe_path))
    assert shown.exit_code == 0, shown.stderr
    assert "predicted:" in shown.stdout and "tokens/s per GPU" in shown.stdout and "measured : no" in shown.stdout
    launched = _cli("launch", str(recipe_path), "--dry-run", "--rdzv-endpoint", "node0:29500", "--",
                    str(ROOT / "examples/train_hf.py"))  # after --: click's runner does not split there
    assert launched.returncode == 0, launched.stderr
    assert "predicted by cptune plan, not measured" in launched.stderr
    assert "--nnodes=2" in launched.stdout
    checked = _run("check", str(recipe_path), "--json")
    problems = {p["argument"]: p for p in json.loads(checked.stdout)["problems"]}
    assert checked.exit_code == 1 and "not measured" in problems["metrics.predicted_by"]["message"]
    assert "provenance.device" not in problems  # a profile's name is not a measured device
    assert (recipe.provenance.device_type, recipe.provenance.backend) == ("cuda", "nccl")


def test_a_recipe_planned_for_the_cpu_records_the_cpu(tmp_path):
    """A recipe records the device it was planned for: ``--hardware cpu`` writes a gloo CPU recipe, which
    ``cptune check`` reads as one (it wrote cuda and nccl before)."""
    out = _run("plan", "--dims", "2,64,4,2,128,128", "--seq-len", "256", "--gpus", "2", "--hardware", "cpu",
               "--out", str(tmp_path / "cpu.yaml"))
    assert out.exit_code == 0, out.stderr
    recipe = cptune.load_recipe(tmp_path / "cpu.yaml")
    assert (recipe.provenance.device_type, recipe.provenance.backend) == ("cpu", "gloo")
    checked = _run("check", str(tmp_path / "cpu.yaml"), "--json")
    assert not any("device_type" in p["argument"] or "cuda" in p["message"].lower()
                   for p in json.loads(checked.stdout)["problems"]), checked.stdout


def test_plan_errors_name_the_option():
    out = _run("plan", "--model", str(LLAMA_8B), "--seq-len", "8192", "--gpus", "12", "--gpus-per-node", "8")
    assert out.exit_code == 1 and "--gpus-per-node" in out.stderr
    out = _run("plan", "--model", str(LLAMA_8B), "--seq-len", "8192", "--gpus", "8", "--hardware", "tpu9")
    assert out.exit_code == 2 and "--hardware" in out.stderr and "h100" in out.stderr  # click's usage error
    out = _run("plan", "--dims", "32,4096", "--seq-len", "8192", "--gpus", "8")
    assert out.exit_code == 2 and "--dims" in out.stderr
    out = _run("plan", "--model", str(LLAMA_8B), "--seq-len", "0", "--gpus", "64")
    assert out.exit_code == 2 and "--seq-len" in out.stderr


def test_dims_come_from_the_config_or_by_hand():
    tiny = P.dims_from_config(TINY)
    assert (tiny.layers, tiny.hidden, tiny.heads, tiny.kv_heads, tiny.head_dim, tiny.ffn, tiny.vocab) == \
        (2, 64, 4, 2, 16, 128, 256)
    assert P.dims_from_config(TINY, {"num_hidden_layers": 6}).layers == 6
    big = _dims()
    assert 7.9e9 < big.params < 8.1e9  # Llama 3.1 8B
    by_hand = _run("plan", "--dims", "32,4096,32,8,14336,128256", "--seq-len", "32768", "--gpus", "8", "--json")
    assert by_hand.exit_code == 0, by_hand.stderr
    assert json.loads(by_hand.stdout)["model"]["layers"] == 32


def test_the_step_model_counts_the_blocks_the_ring_really_sends():
    """PyTorch's ring sends every block; cptune's masked ring only the attended ones (a causal window of S/16
    on 4 ranks: one neighbour's), so the predicted ring time and the search's ring buffers shrink with them."""
    w = cptune.Workload(seq_len=8192, heads=8, head_dim=64)
    windowed, packed = w.model_copy(update={"window": 511}), w.model_copy(update={"documents": "16"})
    assert ring_blocks(w, 4, True) == (3, 3)
    assert ring_blocks(windowed, 4, True) == (1, 1)
    assert ring_blocks(packed, 4, True) == (0, 0)  # 16 equal documents, 4 whole ones per rank in order
    ring = cptune.CPConfig(mesh_shape=(1, 4), rotate_method="allgather", load_balance=True)
    dims = P.ModelDims(layers=1, hidden=512, heads=8, kv_heads=8, head_dim=64, attention_only=True)
    hw = P.load_hardware("h100")

    def ring_s(workload):
        return P.predict(dims, workload, P.Point(ring, "none", sync="none"), hw, 8, optimizer=False).time.get(
            "comm_ring", 0.0)

    assert ring_s(windowed) == pytest.approx(ring_s(w) / 3, rel=1e-6) and ring_s(packed) == 0.0
    assert predict_peak(windowed, ring) < predict_peak(w.model_copy(update={"window": 4095}), ring)


def test_the_step_model_follows_the_physics():
    ring = cptune.CPConfig(mesh_shape=(1, 8), rotate_method="alltoall", load_balance=True)
    unbalanced = ring.model_copy(update={"load_balance": False})
    w = cptune.Workload(seq_len=8192, heads=8, head_dim=64)
    total = busiest_pairs(w, 1, False)
    assert busiest_pairs(w, 4, True) == pytest.approx(total / 4, rel=1e-3)
    assert busiest_pairs(w, 4, False) == pytest.approx(total * 7 / 16, rel=1e-2)  # the last shard's
    packed = w.model_copy(update={"documents": "16"})
    assert busiest_pairs(packed, 1, False) == pytest.approx(total / 16, rel=0.01)
    # load balancing shortens the step; checkpointing trades time for memory
    assert _predict(ring).step_s < _predict(unbalanced).step_s
    none, selective, full = (_predict(ring, ac) for ac in ("none", "selective", "full"))
    assert none.memory["activations"] > selective.memory["activations"] > full.memory["activations"]
    assert none.step_s < selective.step_s < full.step_s
    # more CP: fewer tokens per GPU, less activation memory; FSDP shards the optimizer over dp x cp
    cp4 = _predict(cptune.CPConfig(mesh_shape=(2, 4), rotate_method="alltoall", load_balance=True))
    assert cp4.memory["activations"] == pytest.approx(2 * none.memory["activations"], rel=0.01)
    assert cp4.memory["optimizer"] == none.memory["optimizer"]
    # PyTorch's all-gather rotation is exposed; the point-to-point ring hides behind the block's compute
    gather = _predict(ring.model_copy(update={"rotate_method": "allgather"}))
    assert gather.exposed_s > none.exposed_s
    # a ring crossing nodes is slower than one inside a node
    wide = cptune.CPConfig(mesh_shape=(1, 16), rotate_method="allgather", load_balance=True)
    dims = _dims()
    inside = P.predict(dims, P.plan_workload(dims, 131072), P.Point(wide), P.load_hardware("h100"), 16)
    across = P.predict(dims, P.plan_workload(dims, 131072), P.Point(wide), P.load_hardware("h100"), 8)
    assert across.time["comm_ring"] > inside.time["comm_ring"]


def test_each_further_ring_step_moves_the_measured_bytes_and_expanded_kv_moves_more():
    """The ring's traffic outside its kernels (RING_STEP_BYTES, measured by benchmarks.ring_traffic): none
    without a ring, the forward part twice under full AC, and K/V repeated to the query heads before attention
    (torchtitan's repeat_kv) costs query-wide K/V: in the merge traffic, the ring's bytes and memory."""
    dims = _dims()
    expanded = dims.model_copy(update={"kv_expanded": True})
    hw = P.load_hardware("h100")
    w = P.plan_workload(dims, 65536)

    def merge(d, cp, ac="none"):
        config = cptune.CPConfig(mesh_shape=(1, cp), rotate_method="allgather", load_balance=True)
        return P.predict(d, w, P.Point(config, ac), hw, 8)

    assert merge(dims, 1).time["ring_merge"] == 0.0
    tokens, hq, kv = w.seq_len // 4, dims.q_width, dims.kv_width
    (fq, fkv), (bq, bkv) = RING_STEP_BYTES["forward"], RING_STEP_BYTES["backward"]
    rate = hw.memory_GBps * 1e9 * hw.efficiency.memory
    for ac, passes in (("none", 1), ("full", 2)):
        per_step = passes * (fq * hq + fkv * kv) + bq * hq + bkv * kv
        assert merge(dims, 4, ac).time["ring_merge"] == pytest.approx(dims.layers * 3 * tokens * per_step / rate)
    plain, wide = merge(dims, 4), merge(expanded, 4)
    assert dims.kv_heads < dims.heads and expanded.attended_kv_heads == dims.heads
    assert wide.time["ring_merge"] > plain.time["ring_merge"]
    # the ring's bytes scale with the heads (its per-message latency does not)
    assert 0.95 * dims.heads / dims.kv_heads < wide.time["comm_ring"] / plain.time["comm_ring"] < dims.heads / dims.kv_heads
    assert wide.peak_bytes > plain.peak_bytes


def test_nothing_fits_a_tiny_budget_and_the_recipe_says_why():
    dims = _dims()
    plan = P.plan(dims, P.plan_workload(dims, 32768), P.load_hardware("a100"), 8, budget=2**30)
    assert plan.best is None and all(p.infeasible for p in plan.predictions)
    with pytest.raises(ValidationError, match="memory_budget"):
        P.predicted_recipe(plan)


def test_every_shipped_profile_cites_its_figures(tmp_path):
    for name in ("a100", "h100", "h200", "b200", "cpu"):
        hw = P.load_hardware(name)
        assert hw.sources and hw.flops("bfloat16") > 0 and hw.memory_bytes > 0 and hw.calibrated_by
    assert P.load_hardware("h200").memory_bytes > P.load_hardware("h100").memory_bytes
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "peak_tflops": {"bfloat16": 1}, "memory": "80GiB", "memory_GBps": -1,
                               "intra_node": {"GBps": 1}, "inter_node": {"GBps": 1}}))
    with pytest.raises(ValidationError, match="hardware bad.json: memory_GBps"):
        P.load_hardware(bad)
    saved = P.load_hardware("h100").save(tmp_path / "mine.json")
    assert P.load_hardware(saved) == P.load_hardware("h100")


def test_calibration_recovers_the_factors_and_reports_its_error():
    dims = P.dims_from_config(TINY)
    hw = P.load_hardware("cpu")
    points = [P.Point(cptune.CPConfig(mesh_shape=(dp, 4 // dp), rotate_method=r, load_balance=lb), ac, sync="none")
              for dp in (1, 2) for r in ("allgather", "alltoall") for lb in (True, False) for ac in ("none", "full")]
    preds = [P.predict(dims, P.plan_workload(dims, 4096, dtype="float32"), p, hw, 4, optimizer=False)
             for p in points]
    steps = [2.0 * (p.compute_s - p.time["overhead"]) + 3.0 * p.exposed_s + 0.004 * p.time["layer_passes"]
             for p in preds]
    peaks = [int(p.memory["baseline"] + 1.2 * (p.peak_bytes - p.memory["baseline"])) for p in preds]
    cal = P.calibrate(preds, steps, peaks)
    assert cal.fitted == ("compute", "communication", "layer_overhead_s", "memory")
    assert cal.compute == pytest.approx(2.0, rel=0.01) and cal.communication == pytest.approx(3.0, rel=0.01)
    assert cal.layer_overhead_s == pytest.approx(0.004, rel=0.01) and cal.memory == pytest.approx(1.2, rel=1e-3)
    assert cal.error < 0.01 and cal.memory_error < 0.01
    few = P.calibrate(preds[:2], steps[:2])
    assert few.fitted == ("compute",) and few.error is None  # no held-out trial to judge it by
    folded = fold(hw, cal, "a test")
    assert folded.efficiency.gemm == pytest.approx(hw.efficiency.gemm / 2.0, rel=0.01)
    assert "a test: compute x2.00" in folded.calibrated_by[-1]


def test_a_gpu_benchmark_sets_the_attention_efficiency():
    results = ROOT / "benchmarks/results/gpu-2026-11-30-1750/results.json"
    hw = P.from_gpu_benchmark(P.load_hardware("h200"), results)
    assert hw.efficiency.attention == pytest.approx(310.0 / 989.5, rel=0.01)  # flash at the longest length
    assert "flash at S=65536" in hw.calibrated_by[-1]
    out = _run("plan", "--model", str(LLAMA_8B), "--seq-len", "32768", "--gpus", "8", "--hardware", "h200",
               "--gpu-benchmark", str(results), "--json")
    assert out.exit_code == 0, out.stderr
    assert json.loads(out.stdout)["hardware"]["efficiency"]["attention"] == pytest.approx(310.0 / 989.5, rel=0.01)


def test_the_step_model_prices_tensor_parallelism():
    """tp splits a layer's matmuls, heads and MLP width (their FLOPs, their activations, a rank's share of the
    layer's weights), and sequence parallelism the residual stream, for two all-reduces' bytes a layer pass; the
    blocks' gathered inputs and the embeddings stay whole (the loss is vocabulary-parallel), so at a given cp tp
    trades some memory it cannot divide for collectives."""
    dims = _dims()
    ring = cptune.CPConfig(mesh_shape=(1, 4), rotate_method="alltoall", load_balance=True)
    cp4, tp2 = _predict(ring), _predict(ring.model_copy(update={"mesh_shape": (1, 1, 4, 2)}))
    layers, root = dims.layers * dims.layer_params, dims.params - dims.layers * dims.layer_params
    assert cp4.memory["parameters"] == pytest.approx(4 * dims.params / 4, rel=1e-6)
    assert tp2.memory["parameters"] == pytest.approx(4 * (layers / 2 + root) / 4, rel=1e-6)  # FSDP2 over cp only
    assert tp2.memory["loss"] < cp4.memory["loss"] and tp2.time["comm_tp"] > 0 and "comm_tp" not in cp4.time
    assert tp2.time["dense"] < cp4.time["dense"] and tp2.time["attention"] == pytest.approx(cp4.time["attention"] / 2)
    assert cp4.memory["activations"] / 2 < tp2.memory["activations"] < cp4.memory["activations"]
    assert "tp2: gathers and reduce-scatters" in tp2.bottleneck
    full = [_predict(c, ac="full") for c in (ring, ring.model_copy(update={"mesh_shape": (1, 1, 4, 2)}))]
    assert full[1].memory["activations"] < 0.6 * full[0].memory["activations"]  # the layers' inputs split by token
    # a tp that crosses nodes pays the network for every layer's collectives
    wide = ring.model_copy(update={"mesh_shape": (1, 1, 1, 16)})
    w = P.plan_workload(dims, 65536)
    inside, across = (P.predict(dims, w, P.Point(wide), P.load_hardware("h100"), n) for n in (16, 8))
    assert across.time["comm_tp"] > 4 * inside.time["comm_tp"]
    # HSDP: replicas keep whole shards and all-reduce the gradients across them
    hsdp = _predict(ring.model_copy(update={"mesh_shape": (2, 1, 4, 1)}))
    assert hsdp.memory["parameters"] == cp4.memory["parameters"] and hsdp.time["comm_hsdp"] > 0


def test_the_plan_proposes_tp_where_it_fits_and_says_what_nothing_fitting_would_take():
    dims = _dims()
    hw = P.load_hardware("h100")
    found = P.plan(dims, P.plan_workload(dims, 32768), hw, 16, budget=40 * 2**30, ac_modes=("selective",))
    tps = {p.point.config.parallel_dims().tp for p in found.predictions}
    assert tps == {1, 2, 4, 8}  # the divisors of a node's 8 GPUs that divide the 32 heads and 8 key/value heads
    # HSDP on 2 nodes: one replica a node, FSDP2 inside it, priced with its cross-node gradient all-reduce
    hsdp = [p for p in found.predictions if p.point.config.parallel_dims().dp_replicate == 2]
    assert hsdp and all(p.time["comm_hsdp"] > 0 and p.point.label().startswith("dpr2·") for p in hsdp)
    assert {p.point.config.parallel_dims().tp for p in P.plan(dims, P.plan_workload(dims, 32768), hw, 16,
                                                                max_tp=1, ac_modes=("full",)).predictions} == {1}
    recipe = P.predicted_recipe(found)
    assert recipe.config.parallel_dims(recipe.launch.world_size).world == 16
    none = P.plan(dims, P.plan_workload(dims, 262144), hw, 8, budget=40 * 2**30, ac_modes=("full",), max_tp=2)
    more = P.with_more_gpus(none, max_tp=2)
    said = none.shortfall(more)
    assert none.best is None and more is not None and more.best is not None
    assert said.startswith(f"The closest, {min(none.predictions, key=lambda p: p.peak_bytes).point.label()}, needs ")
    assert f"On {more.gpus} GPUs {more.best.point.label()} is predicted to fit" in said and "pipeline" in said


def test_the_plan_predicts_published_tp_and_cp_runs_within_15_percent():
    """NeMo's Llama 2 7B runs at 16K to 1M tokens (TP 2-8 x CP 1-32, up to 1,024 H100s), the plan calibrated on its
    one run without TP (``python -m benchmarks.plan --published`` prints the table)."""
    from benchmarks import plan as published

    n = published.nemo()
    predicted = [r for r in n["rows"] if r["error"] is not None and not r["calibration"]]
    assert len(predicted) == 7 and {r["tp"] for r in predicted} == {2, 4, 8} and max(r["cp"] for r in predicted) == 32
    assert all(abs(r["error"]) <= 0.15 for r in predicted), [(r["config"], r["error"]) for r in predicted]
    skipped = [r for r in n["rows"] if r["predicted"] is None]
    assert [r["config"].split(",")[1].strip() for r in skipped] == ["PP 2"]


def test_the_step_model_prices_the_loss_as_it_is_built():
    """The chunked loss holds one chunk of float32 logits over a tp rank's share of the vocabulary and a float a
    token; ``loss: whole`` (``cptune search --loss whole``) the whole logits; under tp the head's matmul is split,
    and recomputed in backward. Issue 52's 70B case at 1M tokens fits 64 H100s, where the whole logits left nothing
    fitting."""
    from cptune.losses import chunk_tokens_for

    dims = _dims()
    ring = cptune.CPConfig(mesh_shape=(1, 4), rotate_method="alltoall", load_balance=True)
    tokens = 131072 // 4
    chunked, whole = _predict(ring), _predict(ring, loss="whole")
    assert whole.memory["loss"] == tokens * dims.vocab * (2 + 8)
    assert chunked.memory["loss"] == chunk_tokens_for(dims.vocab) * dims.vocab * (2 + 8) + 4 * tokens
    tp2 = _predict(ring.model_copy(update={"mesh_shape": (1, 1, 4, 2)}))
    assert tp2.memory["loss"] == chunk_tokens_for(dims.vocab) * dims.vocab // 2 * (2 + 8) + 4 * tokens
    assert chunked.time["dense"] == whole.time["dense"]  # at tp 1 the same FLOPs
    tp2_whole = _predict(ring.model_copy(update={"mesh_shape": (1, 1, 4, 2)}), loss="whole")
    assert tp2.time["dense"] < tp2_whole.time["dense"] and tp2.time["recompute"] > tp2_whole.time["recompute"]
    big = P.dims_from_values(80, 8192, 64, 8, 28672, 128256)
    plans = {loss: P.plan(big, P.plan_workload(big, 1048576).model_copy(update={"loss": loss}),
                          P.load_hardware("h100"), 64) for loss in ("chunked", "whole")}
    best = plans["chunked"].best
    assert best is not None and best.peak_bytes <= plans["chunked"].budget and best.memory["loss"] < 2**30
    assert plans["whole"].best is None


QWEN3_5 = ROOT / "examples/models/qwen3.5-shaped"
"""Qwen3.5's shape (transformers' Qwen3_5TextConfig defaults): three Gated DeltaNet layers in every four."""


def test_the_step_model_prices_a_hybrids_mixers_on_their_path(tmp_path):
    """A hybrid's layers are read from its config (Gated DeltaNet, Mamba2, short convolutions) and priced on the path
    cptune takes: split over cp (all-to-all over heads, halo) or whole on every rank (``mixers: whole``, or heads
    that cp does not divide). A Qwen3.5-shaped model at 1M tokens on 16 H100s fits split and not whole."""
    dims = P.dims_from_config(QWEN3_5)
    mix = dims.mixer
    assert mix.kind == "gated_deltanet" and mix.layers == 24 and mix.heads == 16 and mix.state == 32 * 128 * 128
    assert dims.params > 8e9 and "24 of the layers gated_deltanet" in dims.describe()
    transformers = pytest.importorskip("transformers")
    transformers.BambaConfig(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, attn_layer_indices=[3, 7],
                             mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64).save_pretrained(tmp_path / "b")
    bamba = P.dims_from_config(tmp_path / "b")  # its time_step_limit (0, inf) as save_pretrained writes it
    assert bamba.mixer.kind == "mamba2" and bamba.mixer.layers == 6 and bamba.mixer.gathered == 2 * 64
    lfm2 = P.dims_from_config(_saved(tmp_path / "l", {"model_type": "lfm2", "num_hidden_layers": 4, "hidden_size": 64,
                                                        "num_attention_heads": 4, "num_key_value_heads": 4, "conv_L_cache": 3,
                                                        "layer_types": ["conv", "full_attention"] * 2}))
    assert lfm2.mixer.kind == "short_conv" and lfm2.mixer.layers == 2 and lfm2.mixer.fits(3)

    work = P.plan_workload(dims, 1048576)
    hw = P.load_hardware("h100")
    split_cfg = cptune.CPConfig(mesh_shape=(1, 16), rotate_method="alltoall", load_balance=True)
    split = P.predict(dims, work, P.Point(split_cfg, "full"), hw, 8)
    whole = P.predict(dims, work, P.Point(split_cfg.model_copy(update={"mixers": "whole"}), "full"), hw, 8)
    assert split.memory["activations"] < whole.memory["activations"] / 3
    assert split.time["comm_mixers"] < whole.time["comm_mixers"] and split.step_s < whole.step_s
    odd = P.predict(dims, work, P.Point(split_cfg.model_copy(update={"mesh_shape": (1, 32)}), "full"), hw, 8)
    assert odd.memory["activations"] > split.memory["activations"]  # 16 key heads over 32 ranks: whole
    plan = P.plan(dims, work, hw, 16)
    assert plan.best is not None and plan.best.point.config.mixers == "split", plan.best
    assert all(p.infeasible for p in plan.predictions if p.point.config.mixers == "whole")
    assert "24 of the 32 layers are gated_deltanet" in plan.header()


def _saved(folder: Path, config: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"
