"""What PyTorch's ring moves in memory per further ring step, outside its attention kernels, measured here.

    python -m benchmarks.ring_traffic

Each ring step after the first merges the block's partial output into the float32 output and log-sum-exp
(forward; under load balancing half the steps on the half of the queries that attend), concatenates K and V
for the next rotation, and in backward accumulates dq, dk and dv into float32 (half the steps a
``_partial_update``, which clones), concatenates the float32 dk/dv for their rotation and K/V again.
This times those operations as torch's ring runs them (its ``_SDPAMerger`` and ``_partial_update``; the
backward's own lines as torch 2.13 writes them), one thread, float32, on buffers the allocator reuses
(as a GPU's caching allocator does), and gives each as the bytes a plain copy moves in that time: per query
element and per key/value element (of K or V), forward and backward. The step model's
``cptune.plan._step.RING_STEP_BYTES`` are these figures; hardware only changes how fast the bytes move.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

from cptune.attention import require_cp

SHAPE = (1, 8, 2048, 128)  # 8 MiB per float32 tensor: under glibc's mmap ceiling (no fresh pages per allocation)
_EVICT = 64 * 2**20  # bytes written before each timed call: past this machine's last-level cache (32 MiB here)


def _reuse_freed_memory() -> None:
    """Keep freed blocks in the heap (no fresh pages per allocation), as a GPU's caching allocator does."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: the most glibc allows
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD


def _seconds(fn, repeats: int = 9) -> float:
    """The best time of ``fn`` from memory: the caches are flushed before each call (the tensors of one ring
    step fit a CPU's last-level cache; on a GPU they come from HBM); the best, since a shared machine only adds."""
    fn()
    junk = torch.empty(_EVICT // 4)
    times = []
    for _ in range(repeats):
        junk.fill_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure() -> dict:
    torch.set_num_threads(1)
    _reuse_freed_memory()
    cp = require_cp()
    torch.manual_seed(0)
    big = torch.empty(16 * 2**20)
    dst = torch.empty_like(big)
    copy_Bps = 2 * big.numel() * 4 / _seconds(lambda: dst.copy_(big))
    x = torch.randn(SHAPE)
    n = x.numel()
    lse = torch.randn(SHAPE[:-1])
    half = x.chunk(2, dim=2)[1].contiguous()
    half_lse = lse.chunk(2, dim=2)[1].contiguous()

    def merge(partial: bool) -> float:
        merger = cp._SDPAMerger(True, seq_dim=2)
        merger.step(x.clone(), lse.clone(), False)
        return _seconds(lambda: merger.step(half if partial else x, half_lse if partial else lse, partial))

    acc = torch.zeros(SHAPE)

    def accumulate(partial: bool) -> float:
        if partial:
            return _seconds(lambda: cp._partial_update(acc, half, dim=2, n_chunks=2, idx=0, add=True))
        return _seconds(lambda: acc.add_(x))

    pair = torch.empty(2 * n)  # into a buffer, as a caching allocator hands back the last step's
    cat = _seconds(lambda: torch.cat([x.flatten(), x.flatten()], out=pair)) / 2  # per tensor of the pair
    bytes_per = {name: t * copy_Bps / n for name, t in {
        "merge": (merge(False) + merge(True)) / 2,  # load balancing: half the steps full, half partial
        "accumulate": (accumulate(False) + accumulate(True)) / 2,
        "concatenate": cat}.items()}
    b = bytes_per
    return {"copy_GBps": copy_Bps / 1e9, "shape": list(SHAPE), "dtype": "float32", "operations": b,
            # per query element and per element of K (V has as many): forward, the merge; K and V concatenated
            "forward": (b["merge"], 2 * b["concatenate"]),
            # backward: dq accumulated; dk and dv accumulated, concatenated (float32), and K and V concatenated
            "backward": (b["accumulate"], 2 * b["accumulate"] + 4 * b["concatenate"])}


def summary_lines(r: dict) -> list[str]:
    f, b = r["forward"], r["backward"]
    ops = ", ".join(f"{k} {v:.1f}" for k, v in r["operations"].items())
    return [f"PyTorch's ring outside its kernels, per further ring step (float32, {r['copy_GBps']:.1f} GB/s copy): "
            f"forward {f[0]:.1f} B per query element + {f[1]:.1f} B per key element (K and V); backward {b[0]:.1f} + "
            f"{b[1]:.1f}. Operations (B per element): {ops}."]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    r = measure()
    print("\n".join(summary_lines(r)))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
