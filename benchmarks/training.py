"""A training step under CP, side by side: PyTorch's own context_parallel, cptune eager, cptune compiled.

    python -m benchmarks.training                  # ~3 min on 2 cores; writes benchmarks/results/training-<date>.json
    python -m benchmarks.training --update-readme  # also rewrite its section of README.md or docs/ (training-step)

The step is the Llama example's (examples/train_llama_cp.py: embedding, 2 blocks with RMSNorm,
rotary positions, GQA attention and SwiGLU, LM head), forward + backward, on 2 gloo ranks x 1
thread, ring attention with alltoall rotation and load balancing. Input ids, labels and
positions are sharded in place by each context manager. PyTorch's own path runs through its
DTensor dispatcher, given a CPU ring handler (it ships CUDA ones only). The three ways are
interleaved, each rank's time is the slowest rank's, and the figure is the median; each
way's loss is checked against the others first, so no figure comes from a wrong step.
Ratios only: absolute times on a shared CPU are not quoted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._pytorch_cp import torch_context_parallel
from .overhead import interleaved_medians

NPROC = 2


def training_step_on_rank(seq_len: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import cptune
    from examples.train_llama_cp import Llama, make_batch, parallelize

    torch.manual_seed(0)
    eager = Llama()
    torch.manual_seed(0)  # the same weights
    compiled = parallelize(Llama(), "none", True)
    batch = make_batch(0, 1, seq_len, 256, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = cptune.CPConfig(rotate_method="alltoall", load_balance=True)

    def step(model):
        ids, labels, positions = model_batch[:]
        logits = model(ids, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    def pytorch():
        with torch_context_parallel(mesh, model_batch, [1, 1, 1], "alltoall"):
            return step(eager)

    def cptune_eager():
        with cptune.context_parallel(buffers=model_batch, seq_dims=[1, 1, 1], mesh=mesh, config=config):
            return step(eager)

    def cptune_compiled():
        with cptune.context_parallel(buffers=model_batch, seq_dims=[1, 1, 1], mesh=mesh, config=config):
            return step(compiled)

    def fresh() -> None:  # each step shards a fresh copy of the batch in place
        model_batch[:] = [t.clone() for t in batch]
        eager.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)

    ways = {"pytorch": pytorch, "cptune_eager": cptune_eager, "cptune_compiled": cptune_compiled}
    losses, model_batch = {}, []
    compile_s = 0.0
    for name, fn in ways.items():  # warm-up (compiles), and the same loss three ways
        fresh()
        t0 = time.perf_counter()
        losses[name] = fn().item()
        if name == "cptune_compiled":
            compile_s = time.perf_counter() - t0
    if max(losses.values()) - min(losses.values()) > 1e-5:
        raise RuntimeError(f"the three ways disagree on the loss: {losses}")
    med = interleaved_medians(ways, repeats, before=fresh)
    return {"seq_len": seq_len, "repeats": repeats, "losses": losses, "median_s": med,
            "cptune_over_pytorch": med["cptune_eager"] / med["pytorch"],
            "compiled_over_eager": med["cptune_compiled"] / med["cptune_eager"],
            "compiled_over_pytorch": med["cptune_compiled"] / med["pytorch"],
            "first_compiled_step_over_eager": compile_s / med["cptune_eager"]}


def summary_lines(results: dict) -> list[str]:
    lines = [f"Latest run: `{results['command']}` on {results['machine']}, {results['date']} "
             f"({results['total_seconds'] / 60:.0f} min). Step = forward + backward of the Llama example, "
             "2 ranks, alltoall, load balancing; median of interleaved repeats, ratios only.", "",
             "| tokens | cptune eager / PyTorch's context_parallel | cptune compiled / cptune eager "
             "| cptune compiled / PyTorch | first compiled step / eager step |",
             "|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        lines.append(f"| {r['seq_len']} | {r['cptune_over_pytorch']:.2f} | {r['compiled_over_eager']:.2f} "
                     f"| {r['compiled_over_pytorch']:.2f} | {r['first_compiled_step_over_eager']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="CP training step: PyTorch vs cptune eager vs compiled")
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    import os
    import platform

    from cptune.launch import WorkerGroup

    from .report import publish

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    started = time.monotonic()
    results = {"command": "python -m benchmarks.training", "date": stamp,
               "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {NPROC} gloo ranks x 1 thread, "
                          f"torch {torch.__version__}", "rows": []}
    with WorkerGroup(NPROC, timeout=1200) as group:
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            row = group.run(training_step_on_rank, seq_len, args.repeats)[0]
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    results["total_seconds"] = time.monotonic() - started
    publish("training", results, summary_lines(results), args.update_readme)


if __name__ == "__main__":
    main()
