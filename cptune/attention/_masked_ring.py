"""cptune's own ring for attention with documents, sliding windows or a dense mask: only attended pairs run.

PyTorch's ring (``_templated_ring_attention``) takes no mask, so this is cptune's loop. Every
rank knows every ring rank's token positions (``positions``, (R, L)) and the document ids of the
whole sequence, so it plans each (its queries, a ring rank's keys) pair without communication
(:mod:`._blocks`) and calls kernels only where something is attended. It also knows which
blocks each rank attends at all (:func:`._blocks.needs`), so a block travels only to the ranks
whose queries attend some key in it, in both directions: a window or documents that keep ranks
apart send nothing between them. Each owner sends its block straight to those ranks, one ring
step at a time (step t: to ring rank r + t), and in backward each block's key/value gradients go
straight back to its owner:

* ``allgather``: every step's transfer starts at once, as PyTorch's allgather rotation gathers
  every block; the gradients go back once all are computed.
* ``alltoall``: the next step's transfer overlaps the current block's kernels; each block's
  gradients go back while the next block is computed.

A step in which no rank sends runs no collective (every rank computes the same matrix).
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
from ._blocks import Task, needs, plan, row_groups
from ._kernels import CAUSAL_SPLIT, accumulator, block_backward, block_forward, expand_kv, fold_kv_grads, own, \
    register_attention_autograd


def _plans(positions, docs, ring_rank, causal, window, dense, batch, device_type, attended):
    """[source ring rank] -> [(batch rows, tasks)] for this rank's queries, row groups with no task left out
    (``attended[src]``: whether any query attends src's block; none: nothing to plan)."""
    out = []
    split = CAUSAL_SPLIT.get(device_type)
    for src in range(positions.shape[0]):
        per = []
        if not attended[src]:
            out.append(per)
            continue
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


def _active(need: tuple[tuple[bool, ...], ...], step: int) -> bool:
    """Whether any ring rank sends its block ``step`` ranks on (``need[d][s]``: rank d attends rank s's block)."""
    ring = len(need)
    return any(need[(r + step) % ring][r] for r in range(ring))


def _exchange(send: list[torch.Tensor] | None, like: list[torch.Tensor], to: int | None, frm: int | None, group,
              ring: int) -> tuple[list, list]:
    """Start sending ``send`` to ring rank ``to`` and receiving tensors shaped as ``like`` from ``frm`` (None: nothing
    that way). Every ring rank calls it for the same step: an all-to-all with at most one non-empty split each way,
    as PyTorch's alltoall rotation does (gloo carries it for CUDA tensors too)."""
    works, recv = [], []
    for i, t in enumerate(like):
        flat = send[i].contiguous().view(-1) if to is not None else t.new_empty(0)
        into = torch.empty(t.shape, dtype=t.dtype, device=t.device) if frm is not None else None
        out = into.view(-1) if into is not None else t.new_empty(0)
        sends = [flat.numel() if j == to else 0 for j in range(ring)]
        gets = [out.numel() if j == frm else 0 for j in range(ring)]
        works.append(dist.all_to_all_single(out, flat, gets, sends, group=group, async_op=True))
        recv.append(into)
        _hooks.count_sent(flat.numel() * flat.element_size())
    return works, recv


def _arrived(pending: tuple[list, list]) -> list[torch.Tensor | None]:
    """Wait for an :func:`_exchange`; what came in (None where nothing did)."""
    reqs, recv = pending
    for r in reqs:
        r.wait()
    return recv


def _incoming(kv: list[torch.Tensor], need, me: int, group, ahead: int):
    """(step, source ring rank, its [k, v] or None): this rank's own block at step 0, ring rank ``me - step``'s
    at each further step. Each owner sends its block straight to every rank that attends it and to no other;
    a step nobody sends in runs no collective. Transfers start ``ahead`` steps early: 1 overlaps the next
    block's transfer with this one's kernels (alltoall), ``ring - 1`` moves every block at once (allgather)."""
    ring, pending = len(need), {}

    def start(step):
        if step < ring and _active(need, step):
            to, frm = (me + step) % ring, (me - step) % ring
            pending[step] = _exchange(kv, kv, to if need[to][me] else None, frm if need[me][frm] else None, group,
                                      ring)

    for step in range(1, 1 + ahead):
        start(step)
    yield 0, me, kv
    for step in range(1, ring):
        start(step + ahead)
        got = _arrived(pending.pop(step)) if step in pending else None
        yield step, (me - step) % ring, got if got is not None and got[0] is not None else None


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _setup(q, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank, is_causal, rotate_method):
    group = _torch_cp.resolve_group(group_name) if group_name else None
    ring = positions.shape[0]
    window = None if window_left < 0 else (window_left, window_right)
    docs = doc_ids.cpu() if doc_ids is not None else None
    need = needs(positions.cpu(), docs, q.shape[0], is_causal, window)
    plans = _plans(positions.cpu(), docs, ring_rank, is_causal, window, mask.cpu() if mask is not None else None,
                   q.shape[0], q.device.type, need[ring_rank])
    ahead = ring - 1 if rotate_method == "allgather" else min(1, ring - 1)
    return group, plans, need, ahead


@torch.library.custom_op("cptune::block_attention", mutates_args=())
def _block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                        positions: torch.Tensor,
                        doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window_left: int, window_right: int,
                        group_name: str, ring_rank: int, backend: str, is_causal: bool, scale: float | None,
                        rotate_method: str) -> tuple[torch.Tensor, torch.Tensor]:
    group, plans, need, ahead = _setup(q, positions, doc_ids, mask, window_left, window_right, group_name,
                                       ring_rank, is_causal, rotate_method)
    s, acc = _scale(q, scale), accumulator(q.dtype)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    seen = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)
    for _, src, block in _incoming([k, v], need, ring_rank, group, ahead):
        if block is not None:
            _forward_block(q, block[0], block[1], plans[src], backend, s, out, lse, seen)
    if sinks is not None:  # one more term of every row's softmax denominator, whose value is zero
        total = torch.logaddexp(lse, _per_head(sinks, acc))
        out, lse = out * torch.exp(lse - total).unsqueeze(-1), total
    _hooks.notify_forward()
    return own(out.to(q.dtype)), own(lse)


def _per_head(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return sinks.to(dtype).view(1, -1, 1)


@_block_attention_op.register_fake
def _(q, k, v, sinks, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank, backend, is_causal,
      scale, rotate_method):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=accumulator(q.dtype))


@torch.library.custom_op("cptune::block_attention_backward", mutates_args=())
def _block_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None,
                                 positions: torch.Tensor,
                                 doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window_left: int,
                                 window_right: int, group_name: str, ring_rank: int, backend: str, is_causal: bool,
                                 scale: float | None, rotate_method: str
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    group, plans, need, ahead = _setup(q, positions, doc_ids, mask, window_left, window_right, group_name,
                                       ring_rank, is_causal, rotate_method)
    s, acc = _scale(q, scale), accumulator(q.dtype)
    lse = lse.masked_fill(torch.isinf(lse) & (lse < 0), float("inf"))  # rows that attend to nothing: no gradient
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    seen = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)

    def zeros():
        return [torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)]

    mine, returns = zeros(), []  # this rank's block's gradients; gradient returns in flight

    def collect():
        for g, into in zip(_arrived(returns.pop(0)), mine):
            if g is not None:
                into += g

    ring = len(need)
    for step, src, block in _incoming([k, v], need, ring_rank, group, ahead):
        grads = mine if step == 0 else zeros() if block is not None else None
        if block is not None:
            _backward_block(grad_out, q, block[0], block[1], out, lse, plans[src], backend, s, dq, grads[0],
                            grads[1], seen)
        if step and _active(need, step):  # each block's gradients go straight back to its owner
            back = (ring_rank + step) % ring
            returns.append(_exchange(grads, mine, src if block is not None else None,
                                     back if need[back][ring_rank] else None, group, ring))
            if len(returns) > ahead:
                collect()
    while returns:
        collect()
    dk, dv = mine
    return own(dq.to(q.dtype)), own(dk.to(k.dtype)), own(dv.to(v.dtype)), _sink_grad(grad_out, out, lse, sinks, q, acc)


def _sink_grad(grad_out, out, lse, sinks, q, acc) -> torch.Tensor:
    """Each head's sink's gradient from this rank's query rows: minus its probability times the row's
    ``grad_out . out`` (the sink's value is zero); zeros when there are no sinks."""
    if sinks is None:
        return q.new_zeros(q.shape[1])
    rows = (grad_out.to(acc) * out.to(acc)).sum(-1)
    return -(torch.exp(_per_head(sinks, acc) - lse) * rows).sum((0, 2)).to(sinks.dtype)


@_block_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, sinks, positions, doc_ids, mask, window_left, window_right, group_name, ring_rank,
      backend, is_causal, scale, rotate_method):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(q.shape[1]) if sinks is None else sinks.new_empty(sinks.shape))


register_attention_autograd(_block_attention_op, _block_attention_backward_op)

BLOCK_ATTENTION_OPS = (torch.ops.cptune.block_attention.default,)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    doc_ids: torch.Tensor | None, mask: torch.Tensor | None, window: tuple[int, int] | None,
                    group: dist.ProcessGroup | None, ring_rank: int, backend: str, is_causal: bool,
                    scale: float | None, rotate_method: str, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries over every ring rank's keys, documents / window / dense mask applied.

    ``positions``: (R, L) global positions held by each ring rank (R == 1: no ring, no group);
    ``doc_ids``: (B or 1, S) document ids; ``mask``: bool, (..., S, S) for the whole sequence; ``sinks``: (H,) a
    learned logit per query head that joins every row's softmax denominator with a zero value (GPT-OSS), merged
    once into the ring's log-sum-exp, its gradient from the merged output and log-sum-exp.
    """
    left, right = window if window is not None else (-1, -1)
    out, _ = _block_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), sinks, positions, doc_ids, mask, left,
                                 right, group.group_name if group is not None else "", ring_rank, backend, is_causal,
                                 scale, rotate_method)
    return out
