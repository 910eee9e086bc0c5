"""A mixture of experts' training step under CP with and without expert parallelism, measured: one step (forward,
backward, AdamW) of a Qwen3-MoE-shaped model with many experts (64 a layer, 4 a token) on 4 CPU ranks, cp4 (the ring
load balanced), float32, built by ``cptune.models.build_model`` under FSDP2, for:

* FSDP2 alone (ep 1): each MoE layer gathered whole, all 64 experts, forward and backward;
* ep 2 and ep 4 (:attr:`cptune.CPConfig.ep_degree`): each rank keeps 64 / ep experts of a layer, FSDP2 shards them
  over their replicas only, and each routed copy of a token travels to its expert's rank and back by all-to-all.

Per mode: the worst rank's peak over the step (above the process before the model was built: its parameters,
gradients and optimizer state included), the bytes the busiest rank sends in the step (measured: what the process
writes, Linux's ``wchar``, which during a step is gloo's traffic to the other ranks), and the step's seconds (the
slowest rank).

    python -m benchmarks.experts_step                     # 64 experts x 512 wide, 2048 tokens
    python -m benchmarks.experts_step --report benchmarks/results/experts-step-<stamp>.json

Results: benchmarks/results/experts-step-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .report import run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
MODES = {"fsdp": 1, "ep2": 2, "ep4": 4}


def config(experts: int, width: int):
    import transformers

    made = transformers.Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                                       moe_intermediate_size=width, num_experts=experts, num_experts_per_tok=4,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=1 << 16, norm_topk_prob=True, output_router_logits=False)
    made.use_cache = False
    return made


def written() -> int:
    """The bytes this process has written so far (Linux's ``wchar``, all its threads): during a step, what gloo sends
    to the other ranks over its sockets (nothing else writes then)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def rank_job(mode: str, experts: int, width: int, tokens: int) -> None:
    """One step measured on each rank (torchrun): ``fsdp``, ``ep2`` or ``ep4``."""
    import torch

    import cptune
    import cptune.hf
    from cptune.search.memory import current_usage, read_peak, reset_peak

    from .report import print_worst_rank

    torch.set_num_threads(1)
    device, world, rank = cptune.init_rank()
    base = current_usage(device)
    ep = MODES[mode]
    mesh = cptune.ParallelDims(cp=world, ep=ep).model_mesh("cpu")
    model = cptune.models.build_model(config(experts, width), device, fsdp_mesh=mesh, ac="none", cp=world, ep=ep)
    cptune.hf.enable(model, check="never")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (1, tokens), generator=gen)
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)
    setup = cptune.CPConfig(mesh_shape=(1, world), load_balance=True, ep_degree=ep)

    def step() -> None:
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=setup):
            cptune.hf.causal_lm_loss(model, ids, labels, position_ids=positions).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm: the optimizer's state made
    reset_peak(device)
    start, before = time.perf_counter(), written()
    step()
    sent, seconds = written() - before, time.perf_counter() - start
    got = {"peak_rise": read_peak(device) - base, "seconds": seconds}
    print_worst_rank(got, mode=mode, ep=ep, tokens=tokens, experts=experts, width=width, sent=_most(sent))
    cptune.close_rank()


def _most(value: int) -> int:
    """The most any rank sent (every rank calls it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def report(results: dict) -> None:
    mib = 2 ** 20
    base = results["fsdp"]
    print(f"Qwen3-MoE-shaped, 2 layers, {base['experts']} experts x {base['width']} wide a layer (4 a token), "
          f"{base['tokens']} tokens on 4 CPU ranks (cp4 ring lb), float32, one step with AdamW")
    for mode in MODES:
        r = results[mode]
        if "failed" in r:
            print(f"  {mode}: {r['failed']}")
            continue
        print(f"  {mode:>4}: worst rank's peak {r['peak_rise'] / mib:,.0f} MiB = "
              f"{r['peak_rise'] / base['peak_rise']:.2f}x FSDP2 alone's; sent {r['sent'] / mib:,.1f} MiB a rank = {r['sent'] / base['sent']:.2f}x; step "
              f"{r['seconds']:.2f} s = {r['seconds'] / base['seconds']:.2f}x", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=512, help="an expert's intermediate width")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--report", metavar="RESULTS", help="print a saved run's figures")
    parser.add_argument("--rank-job", default=None)
    args = parser.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, args.experts, args.width, args.tokens)
        return 0
    if args.report:
        import json

        report(json.loads(Path(args.report).read_text()))
        return 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    job = ["-m", "benchmarks.experts_step", "--experts", str(args.experts), "--width", str(args.width), "--tokens",
           str(args.tokens), "--rank-job"]
    results = {}
    for mode in MODES:
        try:
            results[mode] = run_json([*torchrun, *job, mode], ROOT)
        except RuntimeError as exc:
            results[mode] = {"failed": str(exc)[-300:]}
    report(results)
    save_results(ROOT, "experts-step", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
