"""The first-step check (``cptune.hf.check``; cptune/_check.py): its margins and its cost.

    python -m benchmarks.check --margins   # rounding against failures, every proven family, float32 and bfloat16
    python -m benchmarks.check --cost      # a training step's first step with the check and without

Margins: on 2 ranks (cp2), every family the support matrix proved on this transformers, the check forced at 512 tokens
under the ring (unpacked) and Ulysses (packed), in float32 and in bfloat16: the worst relative error each measures,
which only rounding makes (another order of the same sums), as a share of what the check allows it (at least the
dtype's ``cptune.verify.TOLERANCE``, or ``MARGIN`` times what perturbing one process's rounding moves it). Beside
them, the four ways families trained wrong or crashed before cptune's fixes (Llama 4's shard positions, Zamba2's cut
gradient, the DSA and QSA indexers vouched for; ``tests/_broken.py``): whether the check refused each.

Cost: a Llama-shaped model (hidden 1024, 8 layers, 16 heads, vocab 32000, float32), 2 ranks as ``train_hf`` runs it
(cp2 ring load balanced, FSDP2, full AC), 8192 tokens: the check up front then two steps, against two steps alone,
each in a fresh torchrun: the check's seconds, a step's, and each rank's peak rise over the run (the worst rank).

Results: benchmarks/results/check-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests._broken import BROKEN, broken

from .report import print_worst_rank, run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
def _errors(family: str, how: str, vouch: tuple, strategy: str, packed: bool, dtype: str) -> dict:
    """The check of ``family`` on this group's ranks: its report's errors, or the refusal's text."""
    import torch

    import cptune
    import cptune.hf
    from cptune import models

    from . import matrix as M

    with broken(how):
        model = models.build_model(M.tiny_config(family), "cpu")
        model.to(getattr(torch, dtype))
        cptune.hf.enable(model, check="always", token_wise=vouch)
        try:
            report = cptune.hf.check(model, config=cptune.CPConfig(strategy=strategy), packed=packed, tokens=512)
        except cptune.ValidationError as exc:
            return {"refused": str(exc)}
    return {"worst": report.worst, "line": report.line()}


def margins() -> dict:
    import transformers

    from cptune.hf import proven_families
    from cptune.launch import WorkerGroup

    from . import matrix as M

    proven = proven_families()[transformers.__version__.split(".", 1)[0]]
    found: dict = {"exact": {}, "broken": {}}
    group = WorkerGroup(2, timeout=600)
    try:
        for dtype in ("float32", "bfloat16"):
            for family in proven:
                for strategy, packed in (("ring", False), ("ulysses", True)):
                    got = group.run(_errors, family, "", (), strategy, packed, dtype)[0]
                    found["exact"][f"{family} {strategy}{' packed' if packed else ''} {dtype}"] = got
            for family, (how, vouch) in BROKEN.items():
                if M.tiny_config(family) is not None:
                    got = group.run(_errors, family, how, vouch, "ring", False, dtype)[0]
                    found["broken"][f"{family} {dtype}"] = got
    finally:
        group.close()
    return found


def print_margins(found: dict) -> None:
    """Per dtype: the proven families' worst measure as a share of what it is allowed (below 1: exact), and how
    many of the broken ones were refused."""
    for dtype in ("float32", "bfloat16"):
        exact = {k: v for k, v in found["exact"].items() if k.endswith(dtype)}
        refused = [k for k, v in exact.items() if "refused" in v]
        worst = max(exact.items(), key=lambda kv: kv[1].get("worst", 0.0))
        broken = {k: v for k, v in found["broken"].items() if k.endswith(dtype)}
        caught = [k for k, v in broken.items() if "refused" in v]
        print(f"{dtype}: {len(exact)} checks of proven families, the worst measure at {worst[1].get('worst', 0.0):.2f}"
              f" of what is allowed ({worst[0]}); refused {len(refused)} {refused}; of the {len(broken)} broken, "
              f"refused {len(caught)} {sorted(caught)}")


def rank_job(mode: str, tokens: int) -> None:
    """``plain`` (two steps), or ``check`` / ``check-N`` (the check up front, at its own length or at N tokens, then
    two steps), on this torchrun's ranks."""
    import time

    import torch
    import transformers

    import cptune
    import cptune.hf
    from cptune import models
    from cptune.mesh import world_mesh
    from cptune.search.memory import current_usage, read_peak, reset_peak

    torch.set_num_threads(1)
    _, world, _ = cptune.init_rank()
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1 << 16)
    config.use_cache = False
    model = models.build_model(config, "cpu", fsdp_mesh=world_mesh("cpu"), ac="full", cp=world)
    cptune.hf.enable(model, check="never" if mode == "plain" else "always")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels, positions = cptune.shift_labels(ids), torch.arange(tokens).view(1, tokens)
    cp_config = cptune.CPConfig(mesh_shape=(1, world))
    cpu = torch.device("cpu")
    before = current_usage(cpu)
    reset_peak(cpu)
    check_s, check_tokens = 0.0, 0
    if mode.startswith("check"):
        length = int(mode.split("-")[1]) if "-" in mode else None
        report = cptune.hf.check(model, config=cp_config, seq_len=tokens, tokens=length)
        check_s, check_tokens = report.seconds, report.tokens
    steps = []
    for _ in range(2):
        start = time.perf_counter()
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=cp_config):
            cptune.hf.causal_lm_loss(model, ids, labels, position_ids=positions).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - start)
    print_worst_rank({"peak_rise": read_peak(cpu) - before, "seconds": check_s}, step_seconds=min(steps),
                     check_tokens=check_tokens)
    cptune.close_rank()


def cost(tokens: int) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    job = ["-m", "benchmarks.check", "--tokens", str(tokens), "--rank-job"]
    return {mode: run_json([*torchrun, *job, mode], ROOT) for mode in ("plain", "check", "check-4096")}


def print_cost(found: dict, tokens: int) -> None:
    mib, plain = 2 ** 20, found["plain"]
    print(f"Llama-shaped, hidden 1024, 8 layers, vocab 32000, float32, 2 ranks (cp2 ring lb, FSDP2, full AC), "
          f"{tokens} tokens a step: a step {plain['step_seconds']:.2f} s, the worst rank's peak rise over two steps "
          f"{plain['peak_rise'] / mib:.0f} MiB")
    for mode in ("check", "check-4096"):
        check = found[mode]
        print(f"  the check at {check['check_tokens']} tokens: {check['seconds']:.2f} s = "
              f"{check['seconds'] / plain['step_seconds']:.2f}x a step; peak rise with it "
              f"{check['peak_rise'] / mib:.0f} MiB ({check['peak_rise'] / plain['peak_rise']:.2f}x)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--margins", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank-job", default=None)
    args = parser.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, args.tokens)
        return 0
    results: dict = {}
    if args.margins or not args.cost:
        results["margins"] = margins()
        print_margins(results["margins"])
    if args.cost or not args.margins:
        results["cost"] = cost(args.tokens)
        results["tokens"] = args.tokens
        print_cost(results["cost"], args.tokens)
    save_results(ROOT, "check", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
