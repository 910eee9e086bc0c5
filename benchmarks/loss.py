"""The loss without the whole logits, measured: the loss alone and a whole training step, each path in a fresh
process (peak = the process's high-water mark over the call, less its resident memory before; time = the median of
3 calls after one warm-up), against the whole logits.

    python -m benchmarks.loss                              # 8192 tokens x hidden 512 x vocabulary 65536
    python -m benchmarks.loss --tokens 16384 --vocab 65536  # the issue's size (the whole path needs ~13 GiB)

Paths: "whole" (``F.linear`` then ``F.cross_entropy`` on float32 logits, what a causal LM's loss does), "torch"
(torch's chunked ``linear_cross_entropy``, cptune's default), "cptune" (cptune's own checkpointed chunks, what a
softcapped head takes). The step: a transformers Llama (2 layers, hidden 512, the same vocabulary) on one process,
forward and backward of ``model(...).loss`` against :func:`cptune.hf.causal_lm_loss`. Under tensor parallelism,
on real ranks (each rank's peak, the worst reported; 1 thread a rank): the loss alone on 2 tp ranks, each rank its
rows of the head ("vocab-parallel") against each rank the whole logits (what a head whole on every tp rank takes),
and the same Llama's step as tp2·cp2 on 4 ranks (``cptune.models.build_model`` on the model mesh, the CP block)
with ``causal_lm_loss`` against ``whole=True``. Goals (issue 52): the loss's peak <= 0.1x the whole logits', the
step's time <= 1.05x. Results: benchmarks/results/loss-<stamp>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from .report import print_worst_rank, run_json, save_results

ROOT = Path(__file__).resolve().parents[1]


def _measure(fn, repeats: int = 3) -> dict:
    """Peak rise (bytes) and median seconds of ``fn`` (one warm-up, then ``repeats`` timed calls, the peak over
    them)."""
    import torch

    from cptune.search.memory import current_usage, read_peak, reset_peak

    fn()
    times = []
    before = current_usage(torch.device("cpu"))
    reset_peak(torch.device("cpu"))
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"peak_rise": read_peak(torch.device("cpu")) - before, "seconds": statistics.median(times)}


def _loss_alone(path: str, tokens: int, hidden: int, vocab: int) -> dict:
    """The loss alone: "whole" logits, "torch" or "cptune" chunks, or "vocab-parallel" over the ranks (torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cptune.losses import loss_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))

    def call():
        if path == "whole":
            loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        elif path == "vocab-parallel":
            loss = loss_sum(h, w, labels, group=dist.group.WORLD)[0]
        else:
            loss = loss_sum(h, w, labels, path=path)[0]
        loss.backward()
        h.grad = w.grad = None

    return _measure(call)


def _step(path: str, tokens: int, hidden: int, vocab: int) -> dict:
    import torch
    import transformers

    import cptune
    from cptune import models
    from cptune.hf import causal_lm_loss

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=tokens)
    model = models.build_model(config, "cpu", ac="none")
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)

    def call():
        if path == "whole":
            loss = model(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels).loss
        else:
            loss = causal_lm_loss(model, ids, labels, position_ids=positions)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return _measure(call)


def _tp_step(path: str, tokens: int, hidden: int, vocab: int) -> dict:
    """On each of 4 ranks (torchrun): the Llama's step as tp2·cp2, the loss chunked (vocabulary-parallel) or whole."""
    import torch
    import transformers

    import cptune
    from cptune import models
    from cptune.hf import causal_lm_loss
    from cptune.mesh import ParallelDims

    dims = ParallelDims(1, 1, 2, 2)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=tokens)
    model = models.build_model(config, "cpu", fsdp_mesh=dims.model_mesh("cpu"), ac="none")
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)
    cp_config = cptune.CPConfig(mesh_shape=dims.shape)

    def call():
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=cp_config):
            causal_lm_loss(model, ids, labels, position_ids=positions, whole=path == "whole").backward()
        model.zero_grad(set_to_none=True)

    return _measure(call)


def rank_job(kind: str, path: str, tokens: int, hidden: int, vocab: int) -> None:
    """Under torchrun: one tp measurement on every rank; rank 0 prints the worst rank's peak and time as JSON."""
    import torch

    import cptune

    torch.set_num_threads(1)
    cptune.init_rank()
    print_worst_rank((_loss_alone if kind == "tp-loss" else _tp_step)(path, tokens, hidden, vocab))
    cptune.close_rank()


def _one(kind: str, path: str, tokens: int, hidden: int, vocab: int) -> dict:
    """One measurement in a fresh process (so no allocator state carries over); a tp one under torchrun."""
    ranks = {"tp-loss": 2, "tp-step": 4}.get(kind)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks else [sys.executable]
    return run_json([*launcher, "-m", "benchmarks.loss", "--one", kind, path, "--tokens", str(tokens), "--hidden",
                     str(hidden), "--vocab", str(vocab)], ROOT, env={"OMP_NUM_THREADS": "2", **os.environ})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "PATH"))
    args = parser.parse_args(argv)
    if args.one:
        kind, path = args.one
        if kind.startswith("tp-"):
            rank_job(kind, path, args.tokens, args.hidden, args.vocab)
            return 0
        fn = _loss_alone if kind == "loss" else _step
        print_worst_rank(fn(path, args.tokens, args.hidden, args.vocab))
        return 0
    size = (args.tokens, args.hidden, args.vocab)
    results = {"size": dict(zip(("tokens", "hidden", "vocab"), size)), "loss": {}, "step": {}, "tp-loss": {},
               "tp-step": {}}
    for path in ("whole", "torch", "cptune"):
        results["loss"][path] = _one("loss", path, *size)
    for path in ("whole", "chunked"):
        results["step"][path] = _one("step", path, *size)
    for path in ("whole", "vocab-parallel"):
        results["tp-loss"][path] = _one("tp-loss", path, *size)
        results["tp-step"][path] = _one("tp-step", path, *size)
    gib = 2 ** 30
    logits = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens x hidden {args.hidden} x vocabulary {args.vocab} (float32 logits "
          f"{logits / gib:.2f} GiB); loss and step: one process; tp-loss: 2 tp ranks; tp-step: tp2·cp2 on 4 ranks "
          "(the worst rank); median of 3")
    print("| what | path | peak rise | / whole | time | / whole |\n|---|---|---:|---:|---:|---:|")
    for kind in ("loss", "step", "tp-loss", "tp-step"):
        whole = results[kind]["whole"]
        for path, r in results[kind].items():
            print(f"| {kind} | {path} | {r['peak_rise'] / gib:.2f} GiB | {r['peak_rise'] / whole['peak_rise']:.3f} | "
                  f"{r['seconds']:.2f} s | {r['seconds'] / whole['seconds']:.2f} |")
    save_results(ROOT, "loss", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
