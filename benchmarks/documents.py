"""Packed documents on real ranks: what a packed step costs against the unpacked causal step, and balance.

    python -m benchmarks.documents                  # S = 32768 and 65536 on 2 gloo ranks (~5 min on 2 cores)
    python -m benchmarks.documents --quick          # S = 8192 and 16384, for a look (~1 min)
    python -m benchmarks.documents --update-readme  # also rewrite its section of README.md or docs/ (documents)

Each workload is one causal attention layer, forward + backward (the search's proxy step, H=4,
D=16, float32, batch 1) on 2 ranks, ring alltoall with load balancing. Document layouts: 16 and
64 equal documents and a long-tailed mix (``--documents longtail``: a few long documents and
many short ones). For each: step time and peak memory relative to the unpacked causal step of
the same length, measured in the same run, against the **ideal ratio** (attended pairs / causal
pairs, what the documents cost); the remaining load imbalance (max / mean attended pairs per
rank) under PyTorch's head-tail layout and under cptune's work balancing; and ring (allgather,
alltoall) against Ulysses on the same packed work. One more row compares, forward only at the
smaller length, the dense (S, S) mask that Ulysses needed before with ``documents=``.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune import attention as A
from cptune.attention import Layout
from cptune.config import CPConfig
from cptune.search import MeasureSettings, Workload
from cptune.search.measure import measure_on_rank

LAYOUTS = ("16", "64", "longtail")
RING = CPConfig(mesh_shape=(1, 2), rotate_method="alltoall", load_balance=True, sdpa_backend="flash")
STRATEGY_CONFIGS = {"ring allgather": RING.model_copy(update={"rotate_method": "allgather"}), "ring alltoall": RING,
                    "ulysses": CPConfig(mesh_shape=(1, 2), strategy="ulysses", sdpa_backend="flash")}


def workload(seq_len: int, documents: str | None) -> Workload:
    return Workload(seq_len=seq_len, heads=4, head_dim=16, batch=1, documents=documents)


def ideal(seq_len: int, documents: str) -> float:
    """Attended pairs of the packed causal sequence / those of the unpacked one."""
    packed = A.token_work(workload(seq_len, documents).document_ids(), seq_len, True, None).sum()
    return float(packed) / (seq_len * (seq_len + 1) / 2)


def imbalances(seq_len: int, documents: str, ring: int = 2) -> dict[str, float]:
    """Max / mean attended pairs per ring rank: PyTorch's head-tail layout and cptune's work balancing."""
    ids = workload(seq_len, documents).document_ids()
    work = A.token_work(ids, seq_len, True, None)
    found = A.work_chunks(work, ring)
    chunks = found[0] if found is not None else None

    def of(layout: Layout) -> float:
        per = [float(work[layout.ring_positions(seq_len, r)].sum()) for r in range(ring)]
        return max(per) / (sum(per) / ring)

    head_tail = of(Layout(ring, ring, True))
    return {"head_tail": head_tail, "balanced": of(Layout(ring, ring, True, chunks)) if chunks else head_tail}


def _settings(seq_len: int) -> MeasureSettings:
    return MeasureSettings(warmup=1, min_repeats=2, max_repeats=5, min_seconds=0.0 if seq_len >= 32768 else 1.0)


def _measure(run, w: Workload, config: CPConfig) -> dict:
    per_rank = run(measure_on_rank, w, config, _settings(w.seq_len))
    steps = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    return {"step_s": statistics.median(steps), "steps": len(steps),
            "peak_rise": max(r["peak"] - r["baseline"] for r in per_rank)}


def dense_forward(seq_len: int, documents: str, dense: bool) -> dict:
    """One forward under Ulysses: the (S, S) mask it took before, or documents=. On every rank."""
    ids = workload(seq_len, documents).document_ids()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, seq_len // dist.get_world_size(), 16, generator=gen)
    positions = torch.arange(seq_len).unsqueeze(0)
    import cptune
    from cptune.search.memory import current_usage, read_peak, reset_peak

    device = torch.device("cpu")
    reset_peak(device)
    base = current_usage(device)
    mask = A.dense_mask(ids, None, True, seq_len) if dense else None
    dist.barrier()
    t0 = time.perf_counter()
    with cptune.context_parallel(buffers=[positions], seq_dims=[1], config=STRATEGY_CONFIGS["ulysses"],
                                 causal=not dense, documents=None if dense else ids), torch.no_grad():
        F.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=not dense)
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "peak_rise": read_peak(device) - base}


def run_all(run, quick: bool) -> dict:
    lengths = (8192, 16384) if quick else (32768, 65536)
    rows, strategies = [], []
    for s in lengths:
        base = _measure(run, workload(s, None), RING)
        for docs in LAYOUTS:
            packed = _measure(run, workload(s, docs), RING)
            row = {"seq_len": s, "documents": docs, "ideal": ideal(s, docs), "unpacked": base, "packed": packed,
                   "time_ratio": packed["step_s"] / base["step_s"],
                   "memory_ratio": packed["peak_rise"] / max(1, base["peak_rise"]), **imbalances(s, docs)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    s = lengths[0]
    for docs in ("16", "longtail"):
        measured = {name: _measure(run, workload(s, docs), c) for name, c in STRATEGY_CONFIGS.items()}
        row = {"seq_len": s, "documents": docs, "measured": measured,
               "speed": {n: measured["ring alltoall"]["step_s"] / m["step_s"] for n, m in measured.items()}}
        strategies.append(row)
        print(json.dumps(row), flush=True)
    slowest = {kind: max(run(dense_forward, s, "16", kind == "dense_mask"), key=lambda r: r["seconds"])
               for kind in ("dense_mask", "documents_kw")}
    dense = {"seq_len": s, "documents": "16", **slowest}
    print(json.dumps(dense), flush=True)
    return {"rows": rows, "strategies": strategies, "dense": dense}


def summary_lines(results: dict) -> list[str]:
    lines = [f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min). One causal attention layer, forward + backward, H=4, D=16, "
             "float32, 2 ranks, ring alltoall with load balancing. Ratios to the unpacked causal step of the same "
             "length, measured in the same run; ideal = attended pairs / causal pairs. Imbalance: max / mean "
             "attended pairs per rank.", "",
             "| tokens | documents | ideal | step time | within 1.5× of ideal | peak memory | imbalance, head-tail → "
             "balanced |", "|---:|---|---:|---:|---|---:|---|"]
    for r in results["rows"]:
        ok = "yes" if r["time_ratio"] <= 1.5 * r["ideal"] else "no"
        lines.append(f"| {r['seq_len']} | {r['documents']} | {r['ideal']:.3f} | {r['time_ratio']:.3f} | {ok} | "
                     f"{r['memory_ratio']:.2f} | {r['head_tail']:.2f} → {r['balanced']:.2f} |")
    names = list(STRATEGY_CONFIGS)
    lines += ["", "Strategies on the same packed work (throughput relative to ring alltoall):", "",
              "| tokens | documents | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
    for r in results["strategies"]:
        lines.append(f"| {r['seq_len']} | {r['documents']} | " + " | ".join(f"{r['speed'][n]:.2f}" for n in names)
                     + " |")
    d = results["dense"]
    lines += ["", f"Before documents= existed, packing needed a dense mask under Ulysses. Forward only, "
              f"{d['seq_len']} tokens, {d['documents']} documents, slowest rank: dense (S, S) mask "
              f"{d['dense_mask']['seconds']:.2f} s and {d['dense_mask']['peak_rise'] / 2**30:.2f} GiB peak rise per "
              f"rank; `documents=` {d['documents_kw']['seconds']:.2f} s and "
              f"{d['documents_kw']['peak_rise'] / 2**30:.2f} GiB "
              f"({d['dense_mask']['seconds'] / d['documents_kw']['seconds']:.1f}x faster)."]
    return lines


def main() -> None:
    from cptune.launch import WorkerGroup

    from .report import cpu_run, publish

    args, results = cpu_run("documents", "packed documents against the unpacked causal step")
    started = time.monotonic()
    with WorkerGroup(2, timeout=3600) as group:
        results.update(run_all(lambda *a: group.run(*a, timeout=3600), args.quick))
    results["total_seconds"] = time.monotonic() - started
    publish("documents", results, summary_lines(results), args.update_readme)


if __name__ == "__main__":
    main()
