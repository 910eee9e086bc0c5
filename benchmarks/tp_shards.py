"""Tensor parallelism keeping only its shards (``cptune.models.build_model``'s ``keep_tp_shards``), measured: a transformers Llama (8 layers,
hidden 1024, MLP 1024, vocabulary 4096) trained one step as tp2·cp2 on 4 CPU ranks at 8192 tokens, each split
block's input kept for backward as the tp rank's sequence shard and gathered again, against the matmuls keeping the
gathered input (what cptune did before). Each rank's peak rise over the step (the worst rank) and the step's time.

    python -m benchmarks.tp_shards

What it should save: a layer's two gathered inputs less their shards, per cp rank's 4096 tokens, 1024 wide, float32:
16 MiB a layer, 128 MiB in all. Results: benchmarks/results/tp-shards-<stamp>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .report import print_worst_rank, run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
TOKENS, LAYERS, HIDDEN = 8192, 8, 1024


def rank_job(mode: str) -> None:
    """Under torchrun: one step measured on every rank; rank 0 prints the worst rank's figures."""
    import torch
    import transformers

    import cptune
    from cptune import models
    from cptune.hf import causal_lm_loss
    from cptune.mesh import ParallelDims

    from .loss import _measure

    torch.set_num_threads(1)
    cptune.init_rank()
    dims = ParallelDims(1, 1, 2, 2)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=TOKENS)
    model = models.build_model(config, "cpu", fsdp_mesh=dims.model_mesh("cpu"), ac="none",
                               keep_tp_shards=mode != "gathered")  # gathered: the matmuls keep the gathered input
    ids = torch.randint(0, 4096, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(TOKENS).view(1, TOKENS)
    cp_config = cptune.CPConfig(mesh_shape=dims.shape)

    def call():
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=cp_config):
            causal_lm_loss(model, ids, labels, position_ids=positions).backward()
        model.zero_grad(set_to_none=True)

    print_worst_rank(_measure(call), kept_as_shard=models.tp_shard_stats["kept_as_shard"])
    cptune.close_rank()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank-job"]:
        rank_job(argv[1])
        return 0
    results = {}
    for mode in ("gathered", "shards"):
        results[mode] = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node=4", "-m", "benchmarks.tp_shards", "--rank-job", mode], ROOT)
    g, s = results["gathered"], results["shards"]
    mib = 2 ** 20
    print(f"tp2·cp2, 4 ranks, {TOKENS} tokens, {LAYERS} layers x hidden {HIDDEN}, float32 (worst rank, median of 3)")
    print(f"  kept gathered: peak rise {g['peak_rise'] / mib:.1f} MiB, step {g['seconds']:.2f} s")
    print(f"  kept as shards: peak rise {s['peak_rise'] / mib:.1f} MiB ({s['peak_rise'] / g['peak_rise']:.2f}x, "
          f"{(g['peak_rise'] - s['peak_rise']) / mib:.1f} MiB less), step {s['seconds'] / g['seconds']:.2f}x")
    save_results(ROOT, "tp-shards", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
