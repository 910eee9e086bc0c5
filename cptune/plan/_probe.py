"""A hardware profile of this machine, measured on real ranks: ``cptune probe --nproc 2 --out cpu.json``.

Every rank measures at once (so ranks sharing cores share them as they will in a search): a float32
GEMM rate, the causal SDPA kernel's rate forward + backward, memory bandwidth (a large copy), the
cost of a small layer's pass (launch and Python overhead), and the process group's bandwidth and
latency (all-gather of 8 MiB, all-reduce of one number). The slowest rank's figures are the profile's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._env import device_name, total_device_memory
from ._hardware import Efficiency, Hardware, Link


def _timed(fn, min_s: float = 0.3, sync=lambda: None) -> float:
    fn()
    sync()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_s and n >= 3:
            return elapsed / n


def _counted(fn, n: int) -> float:
    """Seconds per call of a collective, over ``n`` calls after one warm-up and a barrier."""
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _usage() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure_rank() -> dict[str, float]:
    torch.manual_seed(0)
    out: dict[str, float] = {}
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    out["gemm_flops"] = 2 * 512**3 / _timed(lambda: a @ b)
    s, h, d = 2048, 4, 64
    q = torch.randn(1, h, s, d, requires_grad=True)

    def attention() -> None:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    pairs = s * (s + 1) / 2
    out["attention_flops"] = 4 * d * h * pairs * 3.5 / _timed(attention)
    big = torch.empty(16 * 2**20)  # 64 MiB
    dst = torch.empty_like(big)
    out["memory_Bps"] = 2 * big.numel() * 4 / _timed(lambda: dst.copy_(big))
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)

    def tiny_layer() -> None:  # a layer's worth of small ops: time that FLOPs do not explain
        y = x
        for _ in range(6):
            y = F.silu(y @ w) + y
        y.sum().backward()

    out["layer_pass_s"] = _timed(tiny_layer) / 3
    world = dist.get_world_size()
    if world > 1:  # collectives: the same count on every rank (a rank timing on its own would hang the others)
        chunk = torch.empty(2 * 2**20)  # 8 MiB per rank
        gathered = [torch.empty_like(chunk) for _ in range(world)]
        out["link_Bps"] = chunk.numel() * 4 * (world - 1) / _counted(lambda: dist.all_gather(gathered, chunk), 8)
        one = torch.zeros(1)
        out["latency_s"] = _counted(lambda: dist.all_reduce(one), 50)
    out["baseline_bytes"] = _usage()
    return out


def probe(nproc: int = 2, threads: int = 1) -> Hardware:
    """Measure this machine on ``nproc`` gloo ranks of ``threads`` threads each; the slowest rank's figures."""
    from ..launch import WorkerGroup

    with WorkerGroup(nproc, threads=threads, timeout=300) as group:
        per_rank = group.run(_measure_rank)
    worst = {k: min(r[k] for r in per_rank) for k in per_rank[0] if k not in ("layer_pass_s", "latency_s",
                                                                               "baseline_bytes")}
    gemm = worst["gemm_flops"] / 1e12
    link = Link(GBps=worst.get("link_Bps", 1e9) / 1e9,
                latency_us=max(r.get("latency_s", 0.0) for r in per_rank) * 1e6)
    return Hardware(
        name=f"{device_name('cpu')}: {nproc} gloo rank(s) x {threads} thread(s)", device_type="cpu",
        sources=[f"measured by cptune probe --nproc {nproc} on {time.strftime('%Y-%m-%d %H:%M')}: float32 GEMM "
                 "512^3, causal SDPA S=2048 H=4 D=64 fwd+bwd, a 64 MiB copy, an 8 MiB all-gather, a one-number "
                 "all-reduce, on every rank at once (the slowest rank's figures)"],
        peak_tflops={"float32": gemm, "bfloat16": gemm, "float16": gemm},
        memory=int(total_device_memory("cpu") // nproc), memory_GBps=worst["memory_Bps"] / 1e9, intra_node=link, inter_node=link,
        efficiency=Efficiency(gemm=1.0, attention=worst["attention_flops"] / worst["gemm_flops"], memory=1.0,
                              communication=1.0,
                              layer_overhead_ms=max(r["layer_pass_s"] for r in per_rank) * 1e3),
        baseline=int(max(r["baseline_bytes"] for r in per_rank)),
        calibrated_by=["rates measured by the probe (efficiencies 1.0: the rates are what this machine reached)"])
