"""cptune's own ring for attention with documents, sliding windows or a dense mask: only attended pairs run.

PyTorch's ring (``_templated_ring_attention``) takes no mask, so this is cptune's loop. Every
rank knows every ring rank's token positions (``positions``, (R, L)) and the document ids of the
whole sequence, so it plans each (its queries, a ring rank's keys) pair without communication
(:mod:`._blocks`) and calls kernels only where something is attended; a ring step whose
block attends nothing calls no kernel. Key/value blocks still travel (they are the ring):

* ``allgather``: every rank's key/value gathered at once, as PyTorch's allgather rotation;
  backward sends each rank's key/value gradients back to their owner with one all-to-all.
* ``alltoall``: blocks passed to the next ring rank step by step, the next block's transfer
  overlapping the current block's kernels; in backward the key/value gradients travel with
  their block and reach its owner after a full turn.

Partial results merge by log-sum-exp in float32 (float64 for float64 inputs); backward runs each kernel with the merged
output and log-sum-exp, so the gradients are exact. With R == 1 (Ulysses: the whole sequence on
every rank) nothing travels. As with the plain ring, the forward and backward are
``torch.library`` custom ops (opaque to torch.compile, recorded with their configuration for
activation checkpointing and for a backward after the block).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import _torch_cp
from . import _hooks
from ._blocks import Task, plan, row_groups
from ._kernels import CAUSAL_SPLIT, accumulator, block_backward, block_forward, expand_kv, fold_kv_grads, own, \
    register_attention_autograd


def _plans(positions, docs, ring_rank, causal, window, dense, batch, device_type):
    """[source ring rank] -> [(batch rows, tasks)] for this rank's queries, row groups with no task left out."""
    out = []
    split = CAUSAL_SPLIT.get(device_type)
    for src in range(positions.shape[0]):
        per = []
        for rows, ids in row_groups(docs, batch):
            cut = dense[rows] if dense is not None and dense.ndim == 4 and dense.shape[0] > 1 else dense
            tasks = plan(positions[ring_rank], positions[src], ids, causal, window, cut, split)
            if tasks:
                per.append((rows if len(rows) < batch else slice(None), tasks))
        out.append(per)
    return out


def _task_inputs(q, k, v, rows, t: Task):
    """The task's slices (views on CPU, whose kernel takes strided inputs) and its mask on the device."""
    qt = q[rows, :, t.q0:t.q1]
    kt, vt = expand_kv(qt, k[rows, :, t.k0:t.k1], v[rows, :, t.k0:t.k1])
    mask = t.mask.to(q.device) if t.mask is not None else None
    if q.device.type != "cpu":
        qt, kt, vt = qt.contiguous(), kt.contiguous(), vt.contiguous()
    return qt, kt, vt, mask


def _forward_block(q, k, v, src_plans, backend, scale, out, lse, seen):
    """Run every task against one key/value block and merge it into ``out`` and ``lse`` by log-sum-exp
    (``seen``: (B, Lq) bool on the CPU, the rows some task wrote already; the first write is a copy)."""
    for rows, tasks in src_plans:
        for t in tasks:
            qt, kt, vt, mask = _task_inputs(q, k, v, rows, t)
            o, part = block_forward(backend, qt, kt, vt, t.causal, mask, scale)
            index = (rows, slice(None), slice(t.q0, t.q1))
            if not bool(seen[rows, t.q0:t.q1].any()):
                seen[rows, t.q0:t.q1] = True
                out[index], lse[index] = o, part
                continue
            old = lse[index]
            new = torch.logaddexp(old, part)
            ref = new.masked_fill(torch.isinf(new) & (new < 0), 0.0)  # rows nothing attends yet stay 0
            out[index] = out[index] * torch.exp(old - ref).unsqueeze(-1) + o.to(out.dtype) * \
                torch.exp(part - ref).unsqueeze(-1)
            lse[index] = new


def _backward_block(grad, q, k, v, out, lse, src_plans, backend, scale, dq, dk, dv, seen):
    """Add every task's gradients against one key/value block into ``dq`` and that block's ``dk``, ``dv``
    (``seen``: the rows of ``dq`` written already, as in :func:`_forward_block`)."""
    for rows, tasks in src_plans:
        for t in tasks:
            qt, kt, vt, mask = _task_inputs(q, k, v, rows, t)
            index = (rows, slice(None), slice(t.q0, t.q1))
            a, b, c = block_backward(backend, grad[index], qt, kt, vt, out[index], lse[index].contiguous(),
                                     t.causal, mask, scale)
            b, c = fold_kv_grads(b, c, k.shape[1])
            kindex = (rows, slice(None), slice(t.k0, t.k1))
            if bool(seen[rows, t.q0:t.q1].any()):
                dq[index] += a.to(dq.dtype)
            else:
                seen[rows, t.q0:t.q1] = True
                dq[index] = a
            dk[kindex] += b.to(dk.dtype)
            dv[kindex] += c.to(dv.dtype)


def _shift(tensors: list[torch.Tensor], group, ring_rank: int, ring: int) -> tuple[list, list]:
    """Start sending ``tensors`` to the next ring rank and receiving the previous one's: an all-to-all with
    one non-empty split each way, as PyTorch's alltoall rotation does (gloo carries it for CUDA tensors too)."""
    nxt, prv = (ring_rank + 1) % ring, (ring_rank - 1) % ring
    works, recv = [], []
    for t in tensors:
        flat = t.contiguous().view(-1)
        into = torch.empty_like(flat)
        sends = [flat.numel() if j == nxt else 0 for j in range(ring)]
        gets = [flat.numel() if j == prv else 0 for j in range(ring)]
        works.append(dist.all_to_all_single(into, flat, gets, sends, group=group, async_op=True))
        recv.append(into.view(t.shape))
    return works, recv


def _arrived(pending: tuple[list, list]) -> list[torch.Tensor]:
    """Wait for a :func:`_shift`; what came in."""
    reqs, recv = pending
    for r in reqs:
        r.wait()
    return recv


def _gather(t: torch.Tensor, group, ring: int) -> torch.Tensor:
    """(ring, *t.shape): every ring rank's ``t``."""
    buf = torch.empty((ring * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(buf, t.contiguous(), group=group)
    return buf.view(ring, *t.shape)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _setup(q, k, v, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank, is_causal):
    group = _torch_cp.resolve_group(group_name) if group_name else None
    ring = positions.shape[0]
    window = None if window_left < 0 else (window_left, window_right)
    plans = _plans(positions.cpu(), doc_ids.cpu() if doc_ids is not None else None, ring_rank, is_causal, window,
                   mask.cpu() if mask is not None else None, q.shape[0], q.device.type)
    return group, ring, plans


@torch.library.custom_op("cptune::block_attention", mutates_args=())
def _block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window_left: int, window_right: int,
                        group_name: str, ring_rank: int, backend: str, is_causal: bool, scale: float | None,
                        rotate_method: str) -> tuple[torch.Tensor, torch.Tensor]:
    group, ring, plans = _setup(q, k, v, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank,
                                is_causal)
    s, acc = _scale(q, scale), accumulator(q.dtype)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    seen = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)
    if ring == 1:
        _forward_block(q, k, v, plans[0], backend, s, out, lse, seen)
    elif rotate_method == "allgather":
        ks, vs = _gather(k, group, ring), _gather(v, group, ring)
        for src in range(ring):
            _forward_block(q, ks[src], vs[src], plans[src], backend, s, out, lse, seen)
    else:
        cur = [k.contiguous(), v.contiguous()]
        for step in range(ring):  # the next block travels while this one's kernels run
            pending = _shift(cur, group, ring_rank, ring) if step < ring - 1 else None
            _forward_block(q, cur[0], cur[1], plans[(ring_rank - step) % ring], backend, s, out, lse, seen)
            if pending is not None:
                cur = _arrived(pending)
    _hooks.notify_forward()
    return own(out.to(q.dtype)), own(lse)


@_block_attention_op.register_fake
def _(q, k, v, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank, backend, is_causal, scale,
      rotate_method):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=accumulator(q.dtype))


@torch.library.custom_op("cptune::block_attention_backward", mutates_args=())
def _block_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, positions: torch.Tensor,
                                 doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window_left: int,
                                 window_right: int, group_name: str, ring_rank: int, backend: str, is_causal: bool,
                                 scale: float | None, rotate_method: str
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group, ring, plans = _setup(q, k, v, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank,
                                is_causal)
    s, acc = _scale(q, scale), accumulator(q.dtype)
    lse = lse.masked_fill(torch.isinf(lse) & (lse < 0), float("inf"))  # rows that attend to nothing: no gradient
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    seen = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)

    def zeros():
        return torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)

    if ring == 1:
        dk, dv = zeros()
        _backward_block(grad_out, q, k, v, out, lse, plans[0], backend, s, dq, dk, dv, seen)
    elif rotate_method == "allgather":
        ks, vs = _gather(k, group, ring), _gather(v, group, ring)
        dks = torch.zeros(ks.shape, dtype=acc, device=q.device)
        dvs = torch.zeros(vs.shape, dtype=acc, device=q.device)
        for src in range(ring):
            _backward_block(grad_out, q, ks[src], vs[src], out, lse, plans[src], backend, s, dq, dks[src], dvs[src],
                            seen)
        both = torch.stack([dks, dvs], 1)  # [owner] -> its key and value gradients from this rank
        back = torch.empty_like(both)
        dist.all_to_all_single(back, both, group=group)  # back[j]: my block's gradients from rank j
        dk, dv = back[:, 0].sum(0), back[:, 1].sum(0)
    else:
        kv, grads = [k.contiguous(), v.contiguous()], list(zeros())
        for step in range(ring):  # a block's gradients travel with it and reach its owner after a full turn
            pending = _shift(kv, group, ring_rank, ring) if step < ring - 1 else None
            _backward_block(grad_out, q, kv[0], kv[1], out, lse, plans[(ring_rank - step) % ring], backend, s, dq,
                            grads[0], grads[1], seen)
            grads = _arrived(_shift(grads, group, ring_rank, ring))
            if pending is not None:
                kv = _arrived(pending)
        dk, dv = grads
    return own(dq.to(q.dtype)), own(dk.to(k.dtype)), own(dv.to(v.dtype))


@_block_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank, backend,
      is_causal, scale, rotate_method):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_block_attention_op, _block_attention_backward_op)

BLOCK_ATTENTION_OPS = (torch.ops.cptune.block_attention.default,)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window: tuple[int, int] | None,
                    group: dist.ProcessGroup | None, ring_rank: int, backend: str, is_causal: bool,
                    scale: float | None, rotate_method: str) -> torch.Tensor:
    """Attention of this rank's queries over every ring rank's keys, documents / window / dense mask applied.

    ``positions``: (R, L) global positions held by each ring rank (R == 1: no ring, no group);
    ``doc_ids``: (B or 1, S) document ids; ``mask``: bool, (..., S, S) for the whole sequence.
    """
    left, right = window if window is not None else (-1, -1)
    out, _ = _block_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), positions, doc_ids, mask, left,
                                 right, group.group_name if group is not None else "", ring_rank, backend, is_causal,
                                 scale, rotate_method)
    return out
