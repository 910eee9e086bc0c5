"""A hybrid model's training step split over cp, measured: LFM2 (short convolutions and softmax attention), one step
(forward, backward) at a long sequence on 4 CPU ranks (cp4, ring, load balanced, FSDP2 over cp) against one process
on the whole sequence, float32. Each rank's peak rise over the step (the worst rank) over one process's: its short
convolutions split by the halo exchange (``cptune._halo``), and, for comparison, run whole by the generic path
(``cptune._gathered``). Issue 51's goal for split paths: <= 0.35.

    python -m benchmarks.hybrid_memory                 # 16384 tokens, hidden 512, 8 layers (6 convolutions)

Results: benchmarks/results/hybrid-memory-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .report import print_worst_rank, run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
LAYER_TYPES = ["conv", "conv", "conv", "full_attention"] * 2


def _config(hidden: int):
    import transformers

    config = transformers.CONFIG_MAPPING["lfm2"](
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=8, num_key_value_heads=8, layer_types=LAYER_TYPES, max_position_embeddings=1 << 20)
    config.use_cache = False
    return config


def rank_job(mode: str, tokens: int, hidden: int) -> None:
    """One step measured: ``one`` (one process), or on each rank (torchrun) ``halo`` / ``generic``."""
    import torch

    import cptune
    from cptune import _hf, models
    from cptune.hf import causal_lm_loss

    from .loss import _measure

    torch.set_num_threads(1 if mode != "one" else 2)
    _, world, _ = cptune.init_rank()
    if mode == "generic":
        _hf.splittable = lambda module: False  # every short convolution by the generic path
    mesh = cptune.ParallelDims(1, 1, world, 1).model_mesh("cpu") if world > 1 else None
    model = models.build_model(_config(hidden), "cpu", fsdp_mesh=mesh, ac="none", cp=world)
    ids = torch.randint(0, 4096, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)
    config = cptune.CPConfig(mesh_shape=(1, world), load_balance=world > 1)

    def call():
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=config):
            causal_lm_loss(model, ids, labels, position_ids=positions).backward()
        model.zero_grad(set_to_none=True)

    print_worst_rank(_measure(call, repeats=1))
    cptune.close_rank()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank-job", default=None)
    args = parser.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, args.tokens, args.hidden)
        return 0
    size = ["--tokens", str(args.tokens), "--hidden", str(args.hidden)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    results = {"tokens": args.tokens, "hidden": args.hidden, "layer_types": LAYER_TYPES,
               "one": run_json([sys.executable, "-m", "benchmarks.hybrid_memory", "--rank-job", "one", *size], ROOT)}
    for mode in ("halo", "generic"):
        results[mode] = run_json([*torchrun, "-m", "benchmarks.hybrid_memory", "--rank-job", mode, *size], ROOT)
    one, mib = results["one"], 2 ** 20
    print(f"LFM2, {len(LAYER_TYPES)} layers ({LAYER_TYPES.count('conv')} short convolutions), hidden {args.hidden}, "
          f"{args.tokens} tokens, float32, one step (forward + backward)")
    print(f"  one process: peak rise {one['peak_rise'] / mib:.0f} MiB, {one['seconds']:.1f} s")
    for mode in ("halo", "generic"):
        r = results[mode]
        print(f"  cp4 ring lb, convolutions {mode}: worst rank's peak rise {r['peak_rise'] / mib:.0f} MiB = "
              f"{r['peak_rise'] / one['peak_rise']:.2f}x one process's, step {r['seconds']:.1f} s")
    save_results(ROOT, "hybrid-memory", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
