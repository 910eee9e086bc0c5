"""A hybrid model's training step split over cp, measured: one step (forward, backward) at a long sequence on 4 CPU
ranks (cp4, ring, load balanced, FSDP2 over cp) against one process on the whole sequence, float32, for each hybrid
kind cptune splits: LFM2 (short convolutions), Qwen3.5 (Gated DeltaNet) and Bamba (Mamba2), three of every four
layers the family's own mixer and the fourth softmax attention. Each rank's peak rise over the step (the worst rank)
over one process's: with the mixers split (``CPConfig(mixers="split")``: LFM2's by the halo exchange,
``cptune.mixers._halo``; Gated DeltaNet's and Mamba2's by an all-to-all over their heads, ``cptune.mixers._heads``), and, for
comparison, run whole by the generic path (``mixers="whole"``, ``cptune.mixers._generic``). Issue 51's goal for split
paths: <= 0.35. Beside each figure, the step model's (``cptune.plan.predict`` with the shipped ``cpu`` profile): the
activations' ratio and the step's.

    python -m benchmarks.hybrid_memory                          # every family, 16384 tokens, hidden 512, 8 layers
    python -m benchmarks.hybrid_memory --family qwen3_5_text    # one of them
    python -m benchmarks.hybrid_memory --report benchmarks/results/hybrid-memory-<stamp>.json   # a saved run again
    python -m benchmarks.hybrid_memory --family qwen3_5_text --config-out runs/qwen3_5-bench   # its model, to search

Results: benchmarks/results/hybrid-memory-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .report import print_worst_rank, run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
MIXER = {"lfm2": "conv", "qwen3_5_text": "linear_attention", "bamba": "mamba"}
FAMILIES = tuple(MIXER)


def layer_types(family: str) -> list[str]:
    return [MIXER[family]] * 3 + ["full_attention"] + [MIXER[family]] * 3 + ["full_attention"]


def _config(family: str, hidden: int):
    import transformers

    kinds = layer_types(family)
    extra = {"lfm2": {"layer_types": kinds},
             "qwen3_5_text": {"layer_types": kinds, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                              "linear_key_head_dim": hidden // 8, "linear_value_head_dim": hidden // 8,
                              "head_dim": hidden // 8},
             "bamba": {"attn_layer_indices": [i for i, k in enumerate(kinds) if k == "full_attention"],
                       "mamba_n_heads": 16, "mamba_d_head": hidden * 2 // 16, "mamba_d_state": 64,
                       "mamba_n_groups": 1}}[family]
    config = transformers.CONFIG_MAPPING[family](
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(kinds),
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 20, **extra)
    config.use_cache = False
    return config


def rank_job(family: str, mode: str, tokens: int, hidden: int) -> None:
    """One step measured: ``one`` (one process), or on each rank (torchrun) ``split`` / ``whole``."""
    import torch

    import cptune
    from cptune import models
    from cptune.hf import causal_lm_loss

    from .loss import _measure

    torch.set_num_threads(1 if mode != "one" else 2)
    _, world, _ = cptune.init_rank()
    mesh = cptune.ParallelDims(1, 1, world, 1).model_mesh("cpu") if world > 1 else None
    model = models.build_model(_config(family, hidden), "cpu", fsdp_mesh=mesh, ac="none", cp=world)
    ids = torch.randint(0, 4096, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)
    config = cptune.CPConfig(mesh_shape=(1, world), load_balance=world > 1, mixers="whole" if mode == "whole" else "split")

    def call():
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=config):
            causal_lm_loss(model, ids, labels, position_ids=positions).backward()
        model.zero_grad(set_to_none=True)

    print_worst_rank(_measure(call, repeats=1))
    cptune.close_rank()


def predicted(family: str, tokens: int, hidden: int) -> dict[str, dict[str, float]]:
    """The step model's figures for the same step (``cptune.plan.predict``, the shipped ``cpu`` profile, FSDP2 over
    cp, no AC): per mode, the step time and the activations over one process's."""
    import tempfile

    import cptune
    import cptune.plan as P

    with tempfile.TemporaryDirectory() as folder:
        _config(family, hidden).save_pretrained(folder)
        dims = P.dims_from_config(folder)
    work, hw = P.plan_workload(dims, tokens, dtype="float32"), P.load_hardware("cpu")
    one = P.predict(dims, work, P.Point(cptune.CPConfig(mesh_shape=(1, 1)), "none"), hw, 4)
    found = {}
    for mode in ("split", "whole"):
        config = cptune.CPConfig(mesh_shape=(1, 4), rotate_method="allgather", load_balance=True, mixers=mode)
        got = P.predict(dims, work, P.Point(config, "none"), hw, 4)
        found[mode] = {"step": got.step_s / one.step_s,
                       "activations": got.memory["activations"] / one.memory["activations"]}
    return found


def report(results: dict) -> None:
    """Each family's measured figures, the plan's predictions beside them."""
    mib, tokens, hidden = 2 ** 20, results["tokens"], results["hidden"]
    for family in FAMILIES:
        found = results.get(family)
        if found is None:
            continue
        one, plan = found["one"], predicted(family, tokens, hidden)
        print(f"{family}, {len(found['layer_types'])} layers (6 {MIXER[family]}), hidden {hidden}, {tokens} tokens, "
              "float32, one step (forward + backward)")
        print(f"  one process: peak rise {one['peak_rise'] / mib:.0f} MiB, {one['seconds']:.1f} s")
        for mode in ("split", "whole"):
            r, p = found[mode], plan[mode]
            beside = f"(plan: activations {p['activations']:.2f}x, step {p['step']:.2f}x)"
            if "failed" in r:
                print(f"  cp4 ring lb, mixers {mode}: {r['failed']} {beside}")
                continue
            print(f"  cp4 ring lb, mixers {mode}: worst rank's peak rise {r['peak_rise'] / mib:.0f} MiB = "
                  f"{r['peak_rise'] / one['peak_rise']:.2f}x one process's, step {r['seconds']:.1f} s = "
                  f"{r['seconds'] / one['seconds']:.2f}x {beside}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--report", metavar="RESULTS", help="print a saved run's figures with the plan's beside them")
    parser.add_argument("--config-out", metavar="DIR", help="write --family's config there (for cptune search "
                        "--model) and stop")
    parser.add_argument("--rank-job", default=None)
    args = parser.parse_args(argv)
    if args.config_out:
        _config((args.family or ["qwen3_5_text"])[0], args.hidden).save_pretrained(args.config_out)
        print(f"config written: {args.config_out}")
        return 0
    if args.rank_job:
        rank_job(args.family[0], args.rank_job, args.tokens, args.hidden)
        return 0
    if args.report:
        import json

        report(json.loads(Path(args.report).read_text()))
        return 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    results = {"tokens": args.tokens, "hidden": args.hidden}
    for family in args.family or FAMILIES:
        job = ["-m", "benchmarks.hybrid_memory", "--family", family, "--tokens", str(args.tokens), "--hidden",
               str(args.hidden), "--rank-job"]
        found = results[family] = {"layer_types": layer_types(family),
                                   "one": run_json([sys.executable, *job, "one"], ROOT)}
        for mode in ("split", "whole"):
            try:
                found[mode] = run_json([*torchrun, *job, mode], ROOT)
            except RuntimeError as exc:  # a rank killed for memory: 4 ranks did not fit this machine
                found[mode] = {"failed": "killed (SIGKILL: out of memory)" if "SIGKILL" in str(exc) else
                               str(exc)[-300:]}
    report(results)
    save_results(ROOT, "hybrid-memory", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
