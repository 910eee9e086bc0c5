"""Per-rank memory: an analytic model of the proxy step's peak, budgets, and real peak readings. A ``--model``
workload's peak is the plan's instead (:func:`cptune.plan.predict` through :class:`cptune.search.guide.Guide`, which the
driver prunes on): its parameters, gradients and optimizer state as the config states them, a mixture of experts'
every expert and MLA's real projections included (:mod:`cptune.plan._experts`)."""

from __future__ import annotations


import torch

from ..workload import BUDGET_FRACTION
from .._env import total_device_memory
from ..attention import kv_replication
from ..config import CPConfig, decide_load_balance
from ..plan import kept_attention_layer, ring_blocks, ring_buffer_bytes
from ..workload import Workload

PRUNE_FACTOR = 1.5
"""Configs predicted above PRUNE_FACTOR x budget are recorded infeasible without running."""

def default_budget(device_type: str, nproc_per_node: int, fraction: float = BUDGET_FRACTION) -> int:
    """A fraction of one GPU's memory, or of this machine's RAM shared by its local ranks."""
    total = total_device_memory(device_type)
    return int(fraction * total if device_type == "cuda" else fraction * total / max(1, nproc_per_node))


def predict_peak(workload: Workload, config: CPConfig, baseline: int = 0) -> int:
    """Predicted peak bytes on one rank for the proxy step (fwd + bwd), plus ``baseline``.

    Counts what the step holds at its peak (during backward): inputs, output and its grad,
    the CPU/GPU kernels' float32 workspaces, the ring's communication buffers (allgather holds
    every ring rank's k/v; alltoall one block in flight each way), the float32 merge and
    accumulation buffers, q/k/v grads, and under Ulysses the head-sharded copies.
    """
    w = workload
    dp, cp = config.dp_cp()
    ulysses, ring_degree = config.degrees(cp)
    local = w.seq_len // cp
    e, f32 = w.itemsize, 4
    q = w.batch * w.heads * local * w.head_dim  # elements of one (B, H, S/cp, D) tensor
    kv = w.batch * (w.kv_heads or w.heads) * local * w.head_dim
    expanded = q if kv != q else 0  # GQA: k and v repeated to every query head, one block at a time
    # q, k, v, out, grad_out; dq, dk, dv; two fp32 kernel workspaces of q's size; lse; GQA copies
    held = (3 * q + 2 * kv) * e + (q + 2 * kv) * e + 2 * q * f32 + w.batch * w.heads * local * f32 \
        + 2 * expanded * 2 * e
    swapped = 0
    if ulysses > 1:  # head-sharded q, k, v and out kept for backward, and one all-to-all's send and receive
        kv = kv * kv_replication(w.heads, w.kv_heads or w.heads, ulysses)
        swapped = (2 * q + 2 * kv) * e
        held += swapped + 2 * q * e
    if ring_degree == 1:
        ring = 0
    else:
        kv_block = 2 * kv * e  # key and value travel with their own head count
        lb = decide_load_balance(config.load_balance, causal=w.causal, cp=cp, ring=ring_degree, seq_len=w.seq_len).on
        received = ring_blocks(w, ring_degree, lb)[0]
        rotate = ring_buffer_bytes(kv_block, ring_degree, config, w, received)
        merge = 2 * q * f32 + 2 * w.batch * w.heads * local * f32
        grads = (3 * q + 2 * 2 * kv) * f32  # fp32 dq, dk, dv and the dk/dv block in flight
        ring = rotate + max(merge, grads)
    per_layer = kept_attention_layer(q * e, ring_degree, swapped)  # each further layer, kept for backward
    return int(baseline + held + ring + (w.layers - 1) * per_layer)


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA allocator stats, or Linux VmHWM via clear_refs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: VmHWM then holds the peak since the process started (an upper bound)


def read_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_kb("VmHWM") * 1024


def current_usage(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_kb("VmRSS") * 1024


def _proc_status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
