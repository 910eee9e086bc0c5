"""Packed documents at the speed limit: cptune against PyTorch's CP with FlexAttention, the ring's bytes, and
a transformers packed batch by how the block learns its packing.

    python -m benchmarks.packed                  # S = 32768 and 65536 (~15 min on 2 cores)
    python -m benchmarks.packed --quick          # S = 8192, for a look (~3 min)
    python -m benchmarks.packed --update-readme  # also rewrite README.md's packed section

**Against the peer** (2 ranks, forward, float32, H=4, D=16, causal equal documents): PyTorch's own
CP with FlexAttention all-gathers K/V and runs the compiled ``flex_attention`` with a block mask of
this rank's queries (``benchmarks/_pytorch_cp.py``); cptune's masked ring on the same plain
contiguous shards, and with its work balancing. The slowest rank's time, median of 3 after a
warm-up (Flex's compilation and block mask not counted).

**Traffic** (4 ranks, ring, load balancing): the bytes each rank's masked ring sends in one
forward + backward (counted as it sends them), against the full ring's (every block to every
rank: K/V forward, K/V again and float32 gradients backward), the imbalance of the layout the
block dealt, and the step time. A window of S/16, 16 equal documents and the long-tailed mix.

**transformers** (2 ranks, one core each, so the busiest rank sets the pace as on GPUs): a tiny
Llama's step on a long-tailed packed row under ``cptune.hf``, the packing given to the block with
``documents=``, read from a buffer named ``position_ids`` when the block opens, or found only by
the model call (dealt head-tail).
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune import attention as A
from cptune.config import CPConfig

from .documents import workload

FLEX = ((8192, "8"), (32768, "16"), (65536, "16"))
"""(tokens, documents) compared with the Flex peer; --quick runs the first."""


def flex_on_rank(seq_len: int, documents: str, repeats: int = 3) -> dict:
    """Forward on packed causal documents, this rank's contiguous shard: PyTorch's CP with FlexAttention (K/V
    all-gathered, a block mask of this rank's queries) and cptune's masked ring (without and with its work
    balancing). Seconds per repeat, after a warm-up (Flex's compilation and block mask excluded)."""
    from torch.distributed.device_mesh import init_device_mesh

    import cptune

    from ._pytorch_cp import flex_document_forward

    world, rank = dist.get_world_size(), dist.get_rank()
    docs = workload(seq_len, documents).document_ids()[0]
    gen = torch.Generator().manual_seed(1)
    full = [torch.randn(1, 4, seq_len, 16, generator=gen) for _ in range(3)]
    local = seq_len // world
    shard = [t[:, :, rank * local:(rank + 1) * local].contiguous() for t in full]

    def timed(call) -> list[float]:
        out = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return out[1:]

    results = {}
    with torch.no_grad():
        run = flex_document_forward(init_device_mesh("cpu", (world,)), docs)
        results["flex"] = timed(lambda: run(*shard))
        for name, lb in (("cptune", False), ("cptune balanced", True)):
            with cptune.context_parallel(buffers=full, seq_dims=[2, 2, 2], documents=docs,
                                         config=CPConfig(mesh_shape=(1, world), load_balance=lb,
                                                         rotate_method="alltoall", sdpa_backend="flash")):
                results[name] = timed(lambda: F.scaled_dot_product_attention(*full, is_causal=True))
    return results


def run_flex(run, quick: bool) -> list[dict]:
    rows = []
    for s, documents in FLEX[:1] if quick else FLEX:
        per_rank = run(flex_on_rank, s, documents)
        slowest = {name: statistics.median(max(ts) for ts in zip(*(r[name] for r in per_rank)))
                   for name in per_rank[0]}
        row = {"seq_len": s, "documents": documents, "seconds": slowest,
               "vs_flex": {n: t / slowest["flex"] for n, t in slowest.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows



TRAFFIC = (("window S/16", None, 16), ("16 documents", "16", None), ("longtail", "longtail", None))


def traffic_on_rank(seq_len: int, documents: str | None, window_div: int | None, rotate: str) -> dict:
    """One causal layer's forward + backward on this rank: bytes its ring sent, the full ring's, its work, time."""
    import cptune
    from cptune import attention as A

    torch.manual_seed(0)
    window = (seq_len // window_div - 1, 0) if window_div else None
    ids = workload(seq_len, documents).document_ids() if documents else None
    q, k, v, grad = (torch.randn(1, 4, seq_len, 16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    config = CPConfig(mesh_shape=(1, dist.get_world_size()), rotate_method=rotate, load_balance=True,
                      sdpa_backend="flash")
    dist.barrier()
    t0 = time.perf_counter()
    with cptune.context_parallel(buffers=[*leaves, grad], seq_dims=[2] * 4, config=config, causal=True,
                                 documents=ids, window=window, no_restore=[grad]) as cp, A.counting() as sent:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        (out * grad).sum().backward()
        positions = cp._require().setup.positions
    elapsed = time.perf_counter() - t0
    ring, kv = positions.shape[0], 2 * 4 * (seq_len // positions.shape[0]) * 16 * 4  # K and V, float32
    work = A.token_work(ids, seq_len, True, window)
    return {"sent": sent.sent, "full": 3 * (ring - 1) * kv, "work": float(work[positions[cp.cp_rank]].sum()),
            "seconds": elapsed}


def run_traffic(run, quick: bool) -> list[dict]:
    rows = []
    s = 8192 if quick else 32768
    for name, documents, window_div in TRAFFIC:
        for rotate in ("alltoall", "allgather"):
            run(traffic_on_rank, s, documents, window_div, rotate)  # warm-up: plans, kernels, groups
            per_rank = run(traffic_on_rank, s, documents, window_div, rotate)
            works = [r["work"] for r in per_rank]
            row = {"seq_len": s, "workload": name, "rotate": rotate, "ranks": len(per_rank),
                   "sent_max": max(r["sent"] for r in per_rank), "full": per_rank[0]["full"],
                   "sent_ratio": sum(r["sent"] for r in per_rank) / sum(r["full"] for r in per_rank),
                   "imbalance": max(works) / (sum(works) / len(works)),
                   "seconds": max(r["seconds"] for r in per_rank)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows



HF_MODES = {"documents=": "the block's documents=", "found by cptune.hf": "position ids named in the buffers",
            "found late": "position ids in a list of buffers"}


def hf_on_rank(seq_len: int, mode: str, repeats: int) -> dict:
    """A tiny transformers Llama's step on a long-tailed packed row (position ids restarting per document), its
    packing given to the block as ``mode`` says: the median step time and the imbalance of the layout dealt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import cptune
    import cptune.hf

    torch.manual_seed(0)
    model = cptune.hf.enable(LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq_len, attn_implementation="sdpa")))
    lengths = A.lengths_from_spec("longtail", seq_len)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.randint(0, 256, (1, seq_len))
    labels = cptune.shift_labels(ids)
    docs = cptune.documents_from_position_ids(positions)
    buffers, dims = [ids, labels, positions], [1, 1, 1]
    if mode == "found by cptune.hf":
        buffers, dims = {"input_ids": ids, "labels": labels, "position_ids": positions}, {"input_ids": 1, "labels": 1,
                                                                                           "position_ids": 1}
    config = CPConfig(mesh_shape=(1, dist.get_world_size()), rotate_method="alltoall", load_balance=True)
    times, imbalance = [], 0.0
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        with cptune.context_parallel(buffers=buffers, seq_dims=dims, config=config,
                                     documents=docs if mode == "documents=" else None) as cp:
            model(input_ids=ids, position_ids=positions, shift_labels=labels, use_cache=False).loss.backward()
            layout = cp._require().setup.positions
        times.append(time.perf_counter() - t0)
        model.zero_grad()
        loads = A.token_work(docs, seq_len, True, None)[layout].sum(-1)
        imbalance = float(loads.max() / loads.mean())
    return {"seconds": statistics.median(times[1:]), "imbalance": imbalance}


def run_hf(run, quick: bool) -> list[dict]:
    s, rows = 16384 if quick else 65536, []
    measured = {mode: run(hf_on_rank, s, mode, 3) for mode in HF_MODES}
    base = max(r["seconds"] for r in measured["documents="])
    for mode, per_rank in measured.items():
        row = {"seq_len": s, "mode": mode, "seconds": max(r["seconds"] for r in per_rank),
               "imbalance": per_rank[0]["imbalance"]}
        row["ratio"] = row["seconds"] / base
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary_lines(results: dict) -> list[str]:
    lines = [f"Latest run: `{results['command']}` on {results['machine']} (4 for the traffic), {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min).", "",
             "Against PyTorch's CP with FlexAttention (forward, 2 ranks, causal equal documents, H=4, D=16, float32, "
             "slowest rank, median of 3; Flex's compilation and block mask not counted), time relative to the "
             "peer's:", "",
             "| tokens | documents | cptune / Flex, the same contiguous shards | cptune work-balanced / Flex |",
             "|---:|---|---:|---:|"]
    for r in results["flex"]:
        x = r["vs_flex"]
        lines.append(f"| {r['seq_len']} | {r['documents']} | {x['cptune']:.2f} | {x['cptune balanced']:.2f} |")
    lines += ["", "What the ring sends: a key/value block goes only to the ranks whose queries attend some key in it "
              "(both rotations, and the gradients back). Bytes per rank in one causal layer's forward + backward, "
              "4 ranks, load balancing, counted as sent; the full ring sends every block to every rank.", "",
              "| tokens | workload | rotate | bytes sent, busiest rank | full ring | sent / full (all ranks) | "
              "imbalance |", "|---:|---|---|---:|---:|---:|---:|"]
    for r in results["traffic"]:
        lines.append(f"| {r['seq_len']} | {r['workload']} | {r['rotate']} | {r['sent_max'] / 2**20:.1f} MiB | "
                     f"{r['full'] / 2**20:.1f} MiB | {r['sent_ratio']:.2f} | {r['imbalance']:.2f} |")
    lines += ["", "A transformers Llama (2 layers, hidden 64, 4 heads / 2 kv) on one long-tailed packed row under "
              "`cptune.hf`, 2 ranks, ring alltoall with load balancing: the step (forward + backward, slowest rank, "
              "median of 3) by how the block learns the packing.", "",
              "| tokens | packing | step / with documents= | imbalance of the layout |", "|---:|---|---:|---:|"]
    for r in results["hf"]:
        lines.append(f"| {r['seq_len']} | {HF_MODES[r['mode']]} | {r['ratio']:.2f} | {r['imbalance']:.2f} |")
    return lines


def main() -> None:
    from cptune.launch import WorkerGroup

    from .report import cpu_run, publish

    args, results = cpu_run("packed", "packed documents at the speed limit")
    started = time.monotonic()
    with WorkerGroup(2, timeout=3600) as group:
        results["flex"] = run_flex(lambda *a: group.run(*a, timeout=3600), args.quick)
        results["hf"] = run_hf(lambda *a: group.run(*a, timeout=3600), args.quick)
    with WorkerGroup(4, timeout=3600) as group:
        results["traffic"] = run_traffic(lambda *a: group.run(*a, timeout=3600), args.quick)
    results["total_seconds"] = time.monotonic() - started
    publish("packed", results, summary_lines(results), args.update_readme)


if __name__ == "__main__":
    main()
