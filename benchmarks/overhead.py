"""Wrapper overhead: a step through cptune.context_parallel against the same ring attention called bare."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cptune
from cptune import attention as A


def interleaved_medians(ways: dict, repeats: int, before=None) -> dict[str, float]:
    """Median seconds per way, the ways interleaved; each time is the slowest rank's. Collective."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            if before is not None:
                before()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {k: statistics.median(v) for k, v in times.items()}


def overhead_on_rank(seq_len: int, repeats: int) -> dict:
    """Median step times (fwd + bwd, cp = world, alltoall, load balanced) three ways, interleaved."""
    world = dist.get_world_size()
    config = cptune.CPConfig(rotate_method="alltoall", sdpa_backend="flash", load_balance=True)
    gen = torch.Generator().manual_seed(0)
    local = [torch.randn(1, 4, seq_len // world, 32, generator=gen).requires_grad_() for _ in range(3)]
    full = [torch.randn(1, 4, seq_len, 32, generator=gen) for _ in range(3)]
    grad = torch.randn(1, 4, seq_len // world, 32, generator=gen)
    group = dist.group.WORLD

    def bare() -> None:
        out = A.ring_attention(*local, group, "flash", True, None, "alltoall", True)
        out.backward(grad)

    def wrapped() -> None:
        with cptune.context_parallel(config=config):
            F.scaled_dot_product_attention(*local, is_causal=True).backward(grad)

    def wrapped_with_buffers() -> None:  # also shards three full-length buffers in place and restores them
        with cptune.context_parallel(buffers=full, seq_dims=[2, 2, 2], config=config):
            F.scaled_dot_product_attention(*local, is_causal=True).backward(grad)

    ways = {"bare": bare, "wrapped": wrapped, "wrapped_with_buffers": wrapped_with_buffers}
    for fn in ways.values():
        fn()  # warm-up
    med = interleaved_medians(ways, repeats)
    return {"seq_len": seq_len, "repeats": repeats, "wrapped_over_bare": med["wrapped"] / med["bare"],
            "with_buffers_over_bare": med["wrapped_with_buffers"] / med["bare"]}
