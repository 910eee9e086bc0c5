"""Ring vs Ulysses vs hybrid, side by side in one run, across sequence lengths and head counts.

    python -m benchmarks.strategies                  # ~12 min on 2 cores (2 and 4 gloo ranks)
    python -m benchmarks.strategies --quick          # shorter sequences, for a look (~3 min)
    python -m benchmarks.strategies --update-readme  # also rewrite its section of README.md or docs/ (strategies)
    torchrun --nproc-per-node 8 -m benchmarks.strategies --device cuda   # the same sweep on a GPU node

Each row is one workload (causal, fp32 on CPU / bf16 on GPU, forward + backward of the search's
proxy step); each column a strategy, as throughput relative to the ring (alltoall, load
balanced) measured in the same run, configurations interleaved over two rounds. A second
table measures grouped-query attention (H=8 query heads, 2 KV heads) with K/V expanded to
every query head before the ring (what cptune did before) against K/V travelling with
their own head count, and gives the bytes each rank sends per step for both, computed from
the tensor shapes. On a 2-core machine 4 ranks share 2 cores: those rows compare
strategies under the same contention, not scaling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune.attention import kv_replication
from cptune.config import CPConfig
from cptune.search import MeasureSettings, Workload
from cptune.search.measure import measure_on_rank

STRATEGIES = {
    "ring allgather": CPConfig(rotate_method="allgather", load_balance=True),
    "ring alltoall": CPConfig(rotate_method="alltoall", load_balance=True),
    "ulysses": CPConfig(strategy="ulysses"),
    "hybrid u2": CPConfig(strategy="hybrid", ulysses_degree=2, rotate_method="alltoall", load_balance=True),
}


def sweep(quick: bool, world: int, dtype: str) -> list[Workload]:
    lengths = (2048, 4096) if quick else (4096, 8192, 16384)
    if world > 2:  # 4 ranks on 2 cores: one length
        lengths = lengths[-2:-1]
    heads = [(8, None), (8, 2), (16, 4)] if world == 2 else [(8, None), (8, 2)]
    return [Workload(seq_len=s, heads=h, kv_heads=kv, head_dim=64, batch=1, dtype=dtype)
            for s in lengths for h, kv in heads]


def configs_for(world: int, device: str) -> dict[str, CPConfig]:
    """Each strategy on (1, world); flash on CPU (its only ring kernel), PyTorch's kernel order on GPU."""
    update = {"mesh_shape": (1, world), "sdpa_backend": ("flash",) if device == "cpu" else None}
    return {name: c.model_copy(update=update) for name, c in STRATEGIES.items()
            if c.strategy != "hybrid" or world >= 4}


def sent_bytes(w: Workload, config: CPConfig, expanded: bool = False) -> int:
    """Bytes one rank sends in one forward + backward, from the shapes (``expanded``: K/V at every query head)."""
    cp = config.dp_cp()[1]
    ulysses, ring = config.degrees(cp)
    e, hq = w.itemsize, w.heads
    hk = hq if expanded else (w.kv_heads or hq)
    tokens = w.seq_len // cp
    total = 0
    if ulysses > 1:  # q, k, v and out each way, forward; their grads backward; (u-1)/u of each leaves
        hk = hk * kv_replication(hq, hk, ulysses)
        moved = 2 * (2 * hq + 2 * hk) * w.batch * tokens * w.head_dim * e
        total += moved * (ulysses - 1) // ulysses
        hq, hk, tokens = hq // ulysses, hk // ulysses, tokens * ulysses
    if ring > 1:  # k, v blocks forward and again backward; float32 dk, dv blocks round the ring
        block = 2 * w.batch * hk * tokens * w.head_dim
        total += 2 * (ring - 1) * block * e + ring * block * 4
    return total


def _local(w: Workload, device: torch.device):
    cp = dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(w.batch, w.heads, w.seq_len // cp, w.head_dim, device=device, generator=gen, dtype=w.torch_dtype)
    kv = torch.randn(w.batch, 2 * w.kv_heads, w.seq_len // cp, w.head_dim, device=device, generator=gen,
                     dtype=w.torch_dtype)
    return x.requires_grad_(), kv.requires_grad_()


def gqa_step(w: Workload, device: torch.device):
    """GQA attention on this rank's shard; K/V keep their own head count (cptune's default)."""
    x, kv = _local(w, device)

    def step() -> None:
        k, v = kv.chunk(2, dim=1)
        F.scaled_dot_product_attention(x, k, v, is_causal=True, enable_gqa=True).sum().backward()

    return step, [], []


def gqa_expanded_step(w: Workload, device: torch.device):
    """The same, with K/V repeated to every query head before attention: what the ring moved before."""
    x, kv = _local(w, device)
    groups = w.heads // w.kv_heads

    def step() -> None:
        k, v = (t.repeat_interleave(groups, dim=1) for t in kv.chunk(2, dim=1))
        F.scaled_dot_product_attention(x, k, v, is_causal=True).sum().backward()

    return step, [], []


def _settings(w: Workload) -> MeasureSettings:
    return MeasureSettings(warmup=1, min_repeats=3, max_repeats=10, min_seconds=1.0 if w.seq_len >= 8192 else 0.5)


def _interleaved(run, cases: dict[str, tuple[Workload, CPConfig]], rounds: int = 2) -> dict[str, dict]:
    """Each case measured ``rounds`` times, in turn: median step time over all, worst rank's peak."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, int] = {}
    for _ in range(rounds):
        for name, (w, config) in cases.items():
            per_rank = run(measure_on_rank, w, config, _settings(w))
            times[name] += [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
            peaks[name] = max(peaks.get(name, 0), *(r["peak"] - r["baseline"] for r in per_rank))
    return {name: {"step_s": statistics.median(ts), "steps": len(ts), "peak_rise": peaks[name]}
            for name, ts in times.items()}


def run_sweep(run, world: int, quick: bool, device: str, dtype: str, workloads: list[Workload] | None = None) -> list[dict]:
    """Every strategy on each workload of the sweep (or of ``workloads``)."""
    rows = []
    for w in workloads or sweep(quick, world, dtype):
        cases = {name: (w, c) for name, c in configs_for(world, device).items()}
        measured = _interleaved(run, cases)
        base = measured["ring alltoall"]["step_s"]
        row = {"world": world, "workload": w.describe(), "seq_len": w.seq_len, "heads": w.heads,
               "kv_heads": w.kv_heads or w.heads,
               "speed": {n: base / m["step_s"] for n, m in measured.items()},
               "memory": {n: m["peak_rise"] / max(1, measured["ring alltoall"]["peak_rise"]) for n, m in measured.items()},
               "sent_bytes": {n: sent_bytes(w, c) for n, (_, c) in cases.items()}, "measured": measured}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_gqa(run, world: int, quick: bool, device: str, dtype: str) -> list[dict]:
    rows = []
    seq_len = 4096 if quick else 8192
    configs = configs_for(world, device)
    for name in ("ring alltoall", "ulysses"):
        config = configs[name]
        cases = {kind: (Workload(seq_len=seq_len, heads=8, kv_heads=2, head_dim=64, batch=1, dtype=dtype,
                                 step=f"benchmarks.strategies:{fn}"), config)
                 for kind, fn in (("expanded", "gqa_expanded_step"), ("own heads", "gqa_step"))}
        measured = _interleaved(run, cases)
        w = cases["own heads"][0]
        row = {"world": world, "strategy": name, "seq_len": seq_len,
               "bytes_before": sent_bytes(w, config, expanded=True), "bytes_after": sent_bytes(w, config),
               "speedup": measured["expanded"]["step_s"] / measured["own heads"]["step_s"], "measured": measured}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary_lines(results: dict) -> list[str]:
    names = list(STRATEGIES)
    lines = [f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min). Causal, {results['dtype']}, forward + backward, batch 1, "
             "head dim 64. Throughput relative to the ring (alltoall, load-balanced) in the same run; higher is "
             "faster. `-`: not applicable at that rank count.", "",
             "| ranks | workload | " + " | ".join(names) + " | bytes sent per rank, Ulysses / ring |",
             "|---:|---|" + "---:|" * (len(names) + 1)]
    for r in results["sweep"]:
        cells = [f"{r['speed'][n]:.2f}" if n in r["speed"] else "-" for n in names]
        sent = r["sent_bytes"]
        lines.append(f"| {r['world']} | {r['workload']} | " + " | ".join(cells) +
                     f" | {sent['ulysses'] / sent['ring alltoall']:.2f} |")
    lines += ["", "Grouped-query attention (H=8, 2 KV heads): K/V expanded to every query head before attention "
              "(what the ring moved before) against K/V moved with their own head count. Bytes from the shapes.", "",
              "| ranks | strategy | tokens | bytes sent per rank per step, before → after | step time before / after |",
              "|---:|---|---:|---:|---:|"]
    for r in results["gqa"]:
        lines.append(f"| {r['world']} | {r['strategy']} | {r['seq_len']} | {r['bytes_before'] / 2**20:.0f} MiB → "
                     f"{r['bytes_after'] / 2**20:.0f} MiB | {r['speedup']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="ring vs Ulysses vs hybrid, side by side")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    started = time.monotonic()
    command = "python -m benchmarks.strategies" + (" --quick" if args.quick else "")
    results = {"command": command, "date": stamp, "dtype": "float32", "sweep": [], "gqa": []}
    if "RANK" in os.environ:  # under torchrun: every rank runs the sweep (SPMD), rank 0 reports
        _spmd(args, results)
        return
    from cptune.launch import WorkerGroup

    results["machine"] = (f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo ranks x 1 thread, "
                          f"torch {torch.__version__}")
    for world in (2, 4):
        with WorkerGroup(world, timeout=1800) as group:
            run = lambda *a: group.run(*a, timeout=1800)  # noqa: E731
            results["sweep"] += run_sweep(run, world, args.quick, "cpu", "float32")
            if world == 2:
                results["gqa"] += run_gqa(run, world, args.quick, "cpu", "float32")
    _finish(results, started, args.update_readme)


def _spmd(args, results: dict) -> None:
    """The same sweep inside torchrun (e.g. one GPU per rank, nccl)."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    started = time.monotonic()

    def run(fn, *a):
        out = [None] * world
        dist.all_gather_object(out, fn(*a))
        return out

    results["dtype"] = "bfloat16" if args.device == "cuda" else "float32"
    results["machine"] = f"{world} x {torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'} ranks"
    results["sweep"] = run_sweep(run, world, args.quick, args.device, results["dtype"])
    results["gqa"] = run_gqa(run, world, args.quick, args.device, results["dtype"])
    if dist.get_rank() == 0:
        _finish(results, started, False)
    dist.destroy_process_group()


def _finish(results: dict, started: float, update_readme: bool) -> None:
    from .report import publish

    results["total_seconds"] = time.monotonic() - started
    publish("strategies", results, summary_lines(results), update_readme)


if __name__ == "__main__":
    main()
