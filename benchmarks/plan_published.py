"""The plan against published figures (``python -m benchmarks.plan --published``): torchtitan's Llama 3.1 8B CP
table, ring-flash-attention's ring and zigzag efficiencies, NeMo's Llama 2 7B long-sequence runs (TP x CP up to 1,024
GPUs), and the frontier (a 70B at 1M tokens on 64 H100s); each with its source, every error reported."""

from __future__ import annotations

import cptune
import cptune.plan as P
from cptune.plan import busiest_pairs
from cptune.workload import BUDGET_FRACTION

TORCHTITAN = {
    "source": "torchtitan docs/performance.md, Table 2: Llama 3.1 8B, 8 H100 (96GB HBM2e, 2.4 TB/s, 500 W), "
              "FSDP + CP + torch.compile + Float8, local batch 1, full activation checkpointing",
    "model": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                  kv_expanded=True, name="Llama 3.1 8B"),  # torchtitan's Llama: repeat_kv before SDPA
    "points": [  # (dp = FSDP degree, cp, sequence length, published tokens/s per GPU, published memory GiB)
        (8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5)],
}
NEMO = {
    "source": "NeMo Framework 24.12 user guide, Long Sequence Performance: Llama 2 7B, FP8, DGX H100 (8 GPUs a node), "
              "the runs 'with CP' (Megatron-Core: TP x PP x DP x CP, one sequence per micro-batch)",
    "url": "https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_long_sequence.html",
    "model": dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008, vocab=32000,
                  name="Llama 2 7B"),
    "points": [  # (sequence length K, GPUs, tp, pp, dp, cp, published model TFLOP/s per GPU)
        (4, 4, 1, 1, 4, 1, 768), (8, 8, 1, 2, 4, 1, 730), (16, 16, 2, 1, 8, 1, 660), (32, 32, 2, 1, 8, 2, 610),
        (64, 64, 4, 1, 8, 2, 574), (128, 128, 4, 1, 8, 4, 555), (256, 256, 4, 1, 8, 8, 549),
        (512, 512, 8, 1, 4, 16, 549), (1024, 1024, 8, 1, 4, 32, 536)],
}
RING_FLASH = {
    "source": "zhuzilin/ring-flash-attention README, batch api, fwd + bwd, 8 GPUs, Llama-3.1-8B attention (32 "
              "heads x 128, 8 kv heads), 8k tokens per GPU: iterations/s over the theoretic flash_attn figure",
    "points": [("8xH800", "ring_attn", 0.539), ("8xH800", "zigzag_ring", 0.902), ("8xA100", "ring_attn", 0.525),
               ("8xA100", "zigzag_ring", 0.898)],
}


def torchtitan() -> dict:
    dims = P.ModelDims(**TORCHTITAN["model"])
    hw = P.load_hardware("h100").model_copy(update={"name": "H100 96GB HBM2e, 500 W (Grand Teton)",
                                                    "memory": "96GiB", "memory_GBps": 2400})
    preds = []
    for dp, cp, s, _, _ in TORCHTITAN["points"]:
        w = P.plan_workload(dims, s)
        config = cptune.CPConfig(mesh_shape=(dp, cp), rotate_method="allgather", load_balance=True)
        preds.append(P.predict(dims, w, P.Point(config, "full"), hw, 8, gemm_dtype="float8"))
    published = [p[3] for p in TORCHTITAN["points"]]
    cal = P.calibrate([preds[0]], [preds[0].step_s * preds[0].tokens_per_s_per_gpu / published[0]])
    rows = []
    for (dp, cp, s, tps, mem), p in zip(TORCHTITAN["points"], preds):
        c = cal.apply(p)
        rows.append({"config": f"FSDP {dp}, CP {cp}, S={s}", "published": tps, "predicted": c.tokens_per_s_per_gpu,
                     "error": c.tokens_per_s_per_gpu / tps - 1, "published_memory_gib": mem,
                     "predicted_memory_gib": c.peak_bytes / 2**30, "calibration": dp == 8})
    return {"source": TORCHTITAN["source"], "calibrated_on": "FSDP 8, CP 1, S=32768 (3,890 tokens/s per GPU)",
            "compute_factor": cal.compute, "rows": rows}


def nemo_flops_per_token(model: dict, seq_len: int) -> float:
    """NeMo's model FLOPs of a Llama token (nemo/utils/flops_formulas.py, ``llama2``): forward and backward, no
    recompute, attention counted whole (not halved for the causal mask), which is how its TFLOP/s were reported."""
    h, L = model["hidden"], model["layers"]
    return L * h * h * (12 + 12 * model["kv_heads"] / model["heads"] + 18 * model["ffn"] / h + 12 * seq_len / h
                        + 6 * model["vocab"] / (L * h))


def nemo() -> dict:
    """The plan against NeMo's TP x CP runs: calibrated on the one tp = 1, pp = 1 run (4K tokens, DP 4) and
    predicting the others; the published TFLOP/s become tokens/s per GPU by NeMo's own FLOPs formula. The run with
    PP 2 is listed, not predicted: the plan has no pipeline parallelism."""
    dims = P.ModelDims(**NEMO["model"])
    hw = P.load_hardware("h100")
    rows, preds = [], []
    for k, gpus, tp, pp, dp, cp, tflops in NEMO["points"]:
        s = k * 1024
        published = tflops * 1e12 / nemo_flops_per_token(NEMO["model"], s)
        pred = None
        if pp == 1:
            config = cptune.CPConfig(mesh_shape=(1, dp, cp, tp), rotate_method="alltoall", load_balance=True)
            pred = P.predict(dims, P.plan_workload(dims, s), P.Point(config, "none"), hw, 8, gemm_dtype="float8")
        preds.append(pred)
        rows.append({"config": f"TP {tp}, PP {pp}, DP {dp}, CP {cp}, S={k}K, {gpus} GPUs", "tp": tp, "cp": cp,
                     "seq_len": s, "published_tflops": tflops, "published": published,
                     "calibration": tp == 1 and pp == 1})
    first = next(i for i, r in enumerate(rows) if r["calibration"])
    p0 = preds[first]
    cal = P.calibrate([p0], [p0.step_s * p0.tokens_per_s_per_gpu / rows[first]["published"]])
    for r, p in zip(rows, preds):
        if p is None:
            r.update(predicted=None, error=None, note="pipeline parallel: not in the plan")
            continue
        c = cal.apply(p)
        r.update(predicted=c.tokens_per_s_per_gpu, error=c.tokens_per_s_per_gpu / r["published"] - 1,
                 predicted_tflops=c.tokens_per_s_per_gpu * nemo_flops_per_token(NEMO["model"], r["seq_len"]) / 1e12,
                 predicted_bottleneck=c.bottleneck, predicted_memory_gib=c.peak_bytes / 2**30,
                 predicted_loss_gib=c.memory["loss"] / 2**30, budget_gib=hw.memory_bytes * BUDGET_FRACTION / 2**30)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and not r["calibration"]]
    return {"source": NEMO["source"], "url": NEMO["url"], "calibrated_on": rows[first]["config"],
            "compute_factor": cal.compute, "rows": rows, "worst_error": max(errors),
            "within_15": sum(e <= 0.15 for e in errors), "predicted_points": len(errors)}


def ring_flash() -> dict:
    dims = P.ModelDims(layers=1, hidden=4096, heads=32, kv_heads=8, head_dim=128, attention_only=True)
    profiles = {"8xH800": P.load_hardware("h100").model_copy(update={  # H800: H100 with 400 GB/s NVLink
        "name": "H800", "intra_node": P.load_hardware("h100").intra_node.model_copy(update={"GBps": 200})}),
        "8xA100": P.load_hardware("a100")}
    rows = []
    for gpus, impl, published in RING_FLASH["points"]:
        w = cptune.Workload(seq_len=8 * 8192, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
        config = cptune.CPConfig(mesh_shape=(1, 8), rotate_method="alltoall", load_balance=impl == "zigzag_ring")
        p = P.predict(dims, w, P.Point(config, "none", sync="none"), profiles[gpus], 8, optimizer=False)
        ideal = p.time["attention"] * busiest_pairs(w, 1, False) / 8 / busiest_pairs(w, 8, config.load_balance)
        predicted = ideal / (p.time["attention"] + p.time["ring_merge"] + p.exposed_s)
        rows.append({"gpus": gpus, "impl": impl, "published": published, "predicted": predicted,
                     "error": predicted / published - 1})
    return {"source": RING_FLASH["source"], "calibrated_on": "nothing (efficiencies cancel in the ratio)",
            "rows": rows}


def nemo_lines(n: dict) -> list[str]:
    lines = [f"[{n['source']}]({n['url']}), calibrated on its one run with TP 1 and PP 1 ({n['calibrated_on']}; "
             f"compute factor {n['compute_factor']:.2f}); published model TFLOP/s per GPU turned into tokens/s per GPU "
             "by NeMo's own FLOPs formula (`benchmarks.plan.nemo_flops_per_token`); FP8 matmuls, no activation "
             "checkpointing, FSDP2 over DP x CP where Megatron keeps a distributed optimizer:", "",
             "| configuration | published TFLOP/s/GPU | published tokens/s/GPU | predicted | error | predicted peak "
             "(of which the loss) | plan's bottleneck |",
             "|---|---|---|---|---|---|---|"]
    for r in n["rows"]:
        if r["predicted"] is None:
            lines.append(f"| {r['config']} | {r['published_tflops']} | {r['published']:,.0f} | - | - | - | {r['note']} |")
            continue
        mark = " (calibration point)" if r["calibration"] else ""
        lines.append(f"| {r['config']}{mark} | {r['published_tflops']} | {r['published']:,.0f} | "
                     f"{r['predicted']:,.0f} | {r['error']:+.0%} | {r['predicted_memory_gib']:.1f} GiB "
                     f"({r['predicted_loss_gib']:.2f}) | {r['predicted_bottleneck']} |")
    lines += ["", f"Worst error of the {n['predicted_points']} predicted runs: {n['worst_error']:.1%}; "
                  f"{n['within_15']} of {n['predicted_points']} within 15 %."]
    return lines


FRONTIER = {"dims": "80,8192,64,8,28672,128256", "seq_len": 1048576, "gpus": 64}
"""Issue 52's question: a 70B Llama (Llama 3.1's shape) at 1M tokens on 64 H100s."""


def frontier() -> dict:
    """The plan's answer to :data:`FRONTIER` on each H100 profile: the best configuration, its peak and its parts."""
    dims = P.dims_from_values(*map(int, FRONTIER["dims"].split(",")))
    out = {"command": f"cptune plan --dims {FRONTIER['dims']} --seq-len {FRONTIER['seq_len']} --gpus "
                      f"{FRONTIER['gpus']} --hardware HW", "profiles": {}}
    for name in ("h100", "h100-fa3"):
        hw = P.load_hardware(name)
        result = P.plan(dims, P.plan_workload(dims, FRONTIER["seq_len"]), hw, FRONTIER["gpus"])
        best = result.best
        out["profiles"][name] = None if best is None else {
            "config": best.point.label(), "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu, "step_s": best.step_s,
            "peak_gib": best.peak_bytes / 2**30, "budget_gib": result.budget / 2**30,
            "memory_gib": {k: v / 2**30 for k, v in best.memory.items()}}
    return out


def frontier_lines(f: dict) -> list[str]:
    lines = [f"`{f['command']}` (issue 52's 70B case; the loss chunked, vocabulary-parallel under tp):", "",
             "| profile | best configuration | tokens/s per GPU | step | peak / budget | largest parts |",
             "|---|---|---|---|---|---|"]
    for name, b in f["profiles"].items():
        if b is None:
            lines.append(f"| {name} | nothing predicted to fit | - | - | - | - |")
            continue
        parts = sorted(b["memory_gib"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"| {name} | {b['config']} | {b['tokens_per_s_per_gpu']:.1f} | {b['step_s']:.0f} s | "
                     f"{b['peak_gib']:.2f} / {b['budget_gib']:.0f} GiB | "
                     f"{', '.join(f'{k} {v:.2f}' for k, v in parts)} GiB, loss {b['memory_gib']['loss']:.2f} GiB |")
    return lines
