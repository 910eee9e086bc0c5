"""Checks on what users hand to cptune: pure functions, no collectives, every problem at once.

Each check returns a list of :class:`~cptune.errors.Problem`; callers raise them together as
one :class:`~cptune.errors.ValidationError` before anything is sharded or communicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .config import balanced_multiple, decide_load_balance
from .errors import Problem


@dataclass
class BufferPlan:
    """Buffers flattened in order, with normalised seq dims and the common sequence length."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)
    seq_len: int | None = None
    load_balance: bool = False
    notes: list[str] = field(default_factory=list)


def flatten(buffers: Any, seq_dims: Any, prefix: str = "buffers") -> tuple[list[tuple[str, Any, Any]], list[Problem]]:
    """Walk ``buffers`` and ``seq_dims`` together; (path, buffer, dim) leaves plus structure problems."""
    if isinstance(buffers, Mapping):
        if not isinstance(seq_dims, Mapping):
            return [], [Problem("seq_dims", f"{prefix} is a dict but seq_dims is a {type(seq_dims).__name__}",
                                "give seq_dims as a dict with the same keys as buffers")]
        missing = [k for k in buffers if k not in seq_dims]
        extra = [k for k in seq_dims if k not in buffers]
        if missing or extra:
            return [], [Problem("seq_dims", f"keys differ from {prefix}: missing {missing}, extra {extra}",
                                "give one sequence dim per buffer, under the same keys")]
        leaves, problems = [], []
        for key in buffers:
            sub_leaves, sub_problems = flatten(buffers[key], seq_dims[key], f"{prefix}[{key!r}]")
            leaves += sub_leaves
            problems += sub_problems
        return leaves, problems
    if isinstance(buffers, (list, tuple)):
        if not isinstance(seq_dims, Sequence) or isinstance(seq_dims, (str, Mapping)):
            return [], [Problem("seq_dims", f"{prefix} is a {type(buffers).__name__} but seq_dims is a "
                                f"{type(seq_dims).__name__}", "give seq_dims as a list, one int per buffer")]
        if len(buffers) != len(seq_dims):
            return [], [Problem("seq_dims", f"{len(seq_dims)} seq dims for {len(buffers)} buffers in {prefix}",
                                "give exactly one sequence dim per buffer, in the same order")]
        leaves, problems = [], []
        for i, (b, d) in enumerate(zip(buffers, seq_dims)):
            sub_leaves, sub_problems = flatten(b, d, f"{prefix}[{i}]")
            leaves += sub_leaves
            problems += sub_problems
        return leaves, problems
    return [(prefix, buffers, seq_dims)], []


def check_buffers(
    buffers: Any,
    seq_dims: Any,
    *,
    cp: int,
    load_balance: str | bool,
    causal: bool,
    device_type: str | None,
    no_restore: Sequence[Any] = (),
    ring: int | None = None,
) -> tuple[BufferPlan, list[Problem]]:
    """Validate buffers and their sequence dims for sharding over ``cp`` ranks (``ring`` of them in the ring)."""
    ring = cp if ring is None else ring
    plan = BufferPlan()
    if buffers is None and seq_dims is None:
        return plan, []
    if buffers is None or seq_dims is None:
        missing = "seq_dims" if seq_dims is None else "buffers"
        return plan, [Problem(missing, "one of buffers/seq_dims is given without the other",
                              "pass both buffers= and seq_dims=, one sequence dim per buffer")]
    if isinstance(buffers, torch.Tensor):
        buffers, seq_dims = [buffers], [seq_dims] if isinstance(seq_dims, int) else seq_dims
    leaves, problems = flatten(buffers, seq_dims)
    lengths: dict[str, int] = {}
    seen: dict[int, str] = {}
    for path, buf, dim in leaves:
        if not isinstance(buf, torch.Tensor):
            problems.append(Problem(path, f"is a {type(buf).__name__}, not a tensor",
                                    "pass only tensors whose sequence dimension should be sharded"))
            continue
        if isinstance(buf, nn.Parameter):
            problems.append(Problem(path, "is an nn.Parameter; parameters are replicated, not sharded",
                                    "remove it from buffers (shard activations and inputs, not weights)"))
            continue
        if type(buf).__name__ == "DTensor":
            problems.append(Problem(path, "is already a DTensor", "pass the plain local tensor"))
            continue
        if id(buf) in seen:
            problems.append(Problem(path, f"is the same tensor as {seen[id(buf)]}",
                                    "list each tensor once"))
            continue
        seen[id(buf)] = path
        if isinstance(dim, bool) or not isinstance(dim, int):
            problems.append(Problem(f"seq_dims for {path}", f"{dim!r} is not an int",
                                    "give the index of the sequence dimension, e.g. 2 for (B, H, S, D)"))
            continue
        if not -buf.ndim <= dim < buf.ndim:
            problems.append(Problem(f"seq_dims for {path}",
                                    f"dim {dim} is out of range for a tensor of shape {tuple(buf.shape)}",
                                    f"use a dim in [{-buf.ndim}, {buf.ndim - 1}]"))
            continue
        dim %= buf.ndim
        if device_type is not None and buf.device.type != device_type:
            problems.append(Problem(path, f"is on {buf.device} but the device mesh is on {device_type}",
                                    f"move it with .to('{device_type}') or build the mesh on {buf.device.type}"))
        elif buf.device.type == "cuda" and buf.device.index != torch.cuda.current_device():
            problems.append(Problem(path, f"is on {buf.device} but this rank's device is "
                                    f"cuda:{torch.cuda.current_device()}",
                                    "call torch.cuda.set_device(local_rank) and create buffers on that device"))
        plan.names.append(path)
        plan.tensors.append(buf)
        plan.dims.append(dim)
        lengths[path] = buf.shape[dim]
    for item in no_restore:
        if not any(item is t for t in plan.tensors):
            problems.append(Problem("no_restore", "holds a tensor that is not one of the buffers",
                                    "list only tensors that are also in buffers"))
            break
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in lengths.items())
        problems.append(Problem("seq_dims", f"the buffers disagree on the sequence length ({listing})",
                                "check each buffer's seq dim; all must share one sequence length"))
        return plan, problems
    if lengths:
        plan.seq_len = seq_len = next(iter(lengths.values()))
        wanted = decide_load_balance(load_balance, causal=causal, cp=cp, ring=ring)
        if seq_len % cp:
            multiple = balanced_multiple(cp, ring) if wanted.on else cp
            problems.append(Problem("buffers", f"sequence length {seq_len} is not divisible by the CP degree {cp}",
                                    f"pad the sequence to a multiple of {multiple} or choose a CP degree that "
                                    "divides it"))
        decided = decide_load_balance(load_balance, causal=causal, cp=cp, ring=ring, seq_len=seq_len)
        plan.load_balance = decided.on
        problems += decided.problems
        plan.notes += [decided.note] if decided.note else []
    if cp > 1:
        plan.notes += unshifted_label_notes(plan)
    return plan, problems


def unshifted_label_notes(plan: BufferPlan) -> list[str]:
    """Warn when two integer buffers are equal: labels = input_ids, to be shifted inside each shard."""
    ints = [(n, t) for n, t in zip(plan.names, plan.tensors) if not t.is_floating_point() and t.dtype != torch.bool]
    for i, (name_a, a) in enumerate(ints):
        for name_b, b in ints[i + 1:]:
            if a.shape == b.shape and a.device == b.device and torch.equal(a, b):
                return [f"{name_a} and {name_b} are equal (labels = input_ids?): a causal-LM loss that shifts "
                        "labels inside each rank's shard pairs tokens that are not neighbours and gives wrong "
                        "gradients under CP. Shift before sharding: labels = cptune.shift_labels(input_ids), "
                        "and pass it to transformers as shift_labels= (see the README's language-model section)"]
    return []


def transport_problems(device_type: str, process_backend: str | None, ring: int, rotate_method: str) -> list[Problem]:
    """A ring the process group cannot carry: gloo has no all-gather for CUDA tensors (the ranks
    crash with a segmentation fault; seen on an H200 with torch 2.11), its all-to-all works."""
    if device_type == "cuda" and process_backend == "gloo" and ring > 1 and rotate_method == "allgather":
        return [Problem("config.rotate_method", "is 'allgather', but the process group is gloo, which cannot "
                        "all-gather CUDA tensors", "use an nccl process group for CUDA buffers "
                        "(init_process_group('nccl')), or rotate_method='alltoall'")]
    return []
