"""Ulysses attention: all-to-alls that turn sequence shards into head shards and back.

Each CP rank holds ``S / u`` tokens of every head. :func:`seq_to_heads` trades them so each
rank holds all ``S`` tokens of ``H / u`` heads; plain SDPA then runs on those heads (any
kernel, an attention mask for the whole sequence, dropout), and :func:`heads_to_seq` trades
the output back. Under the hybrid strategy the attention in the middle is the ring, over
the ranks that hold the same heads.

The two all-to-alls are ``torch.library`` custom ops with the group passed by name, each
the other's backward, so they run the same in eager code, in compiled graphs, in an
activation checkpoint's recompute and in a backward after the block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import _torch_cp
from . import _hooks


def _group(name: str) -> dist.ProcessGroup:
    return _torch_cp.resolve_group(name)


@torch.library.custom_op("cptune::seq_to_heads", mutates_args=())
def _seq_to_heads(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, degree, h // degree, s, d).transpose(0, 1).contiguous()  # [j]: heads for rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_group(group_name))  # recv[j]: rank j's tokens of my heads
    _hooks.notify_forward()
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // degree, degree * s, d).contiguous()


@_seq_to_heads.register_fake
def _(x, group_name, degree):
    b, h, s, d = x.shape
    return x.new_empty(b, h // degree, degree * s, d)


@torch.library.custom_op("cptune::heads_to_seq", mutates_args=())
def _heads_to_seq(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    b, h, full, d = x.shape
    s = full // degree
    send = x.reshape(b, h, degree, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [j]: rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_group(group_name))  # recv[j]: head group j of my tokens
    return recv.transpose(0, 1).reshape(b, degree * h, s, d).contiguous()  # h == 1: a view


@_heads_to_seq.register_fake
def _(x, group_name, degree):
    b, h, full, d = x.shape
    return x.new_empty(b, h * degree, full // degree, d)


def _setup(ctx, inputs, output):
    ctx.group_name, ctx.degree = inputs[1], inputs[2]


_seq_to_heads.register_autograd(
    lambda ctx, grad: (_heads_to_seq(grad.contiguous(), ctx.group_name, ctx.degree), None, None),
    setup_context=_setup)
_heads_to_seq.register_autograd(
    lambda ctx, grad: (_seq_to_heads(grad.contiguous(), ctx.group_name, ctx.degree), None, None),
    setup_context=_setup)

ULYSSES_OPS = (torch.ops.cptune.seq_to_heads.default, torch.ops.cptune.heads_to_seq.default)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """(B, H, S/u, D) on each of ``degree`` ranks -> (B, H/u, S, D): all tokens of this rank's heads."""
    return _seq_to_heads(x.contiguous(), group.group_name, degree)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`."""
    return _heads_to_seq(x.contiguous(), group.group_name, degree)


_SUBGROUPS: dict[tuple, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def release_groups() -> None:
    """Forget the hybrid groups built so far (:func:`cptune.close_rank`)."""
    _SUBGROUPS.clear()


def hybrid_groups(mesh: DeviceMesh, cp: int, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(Ulysses group, ring group) of this rank: CP rank c is Ulysses rank c % u of ring rank c // u.

    Ulysses groups are neighbouring ranks (inside a node, where all-to-all is cheap). Every
    rank creates every group (a collective), once per layout of ranks and split.
    """
    names = mesh.mesh_dim_names or ()
    ranks = mesh.mesh if mesh.ndim == 1 else mesh.mesh.movedim(names.index("cp"), -1)
    rows = ranks.reshape(-1, cp).tolist()
    key = (id(dist.group.WORLD), tuple(map(tuple, rows)), ulysses)  # same world, ranks, split: same groups
    if key not in _SUBGROUPS:
        ulysses_lists = [row[j:j + ulysses] for row in rows for j in range(0, cp, ulysses)]
        ring_lists = [row[i::ulysses] for row in rows for i in range(ulysses)]
        _SUBGROUPS[key] = (dist.new_subgroups_by_enumeration(ulysses_lists)[0],
                           dist.new_subgroups_by_enumeration(ring_lists)[0])
    return _SUBGROUPS[key]


def kv_replication(query_heads: int, kv_heads: int, degree: int) -> int:
    """How many copies of each key/value head the all-to-all must carry so every rank gets whole heads.

    1 when the KV heads divide by the Ulysses degree (each rank gets its own KV heads, no
    copies on the wire); otherwise the smallest factor that makes them divisible and still
    keeps every rank's query heads on its KV heads (at most query_heads / kv_heads: plain MHA).
    """
    groups = query_heads // kv_heads
    for factor in range(1, groups + 1):
        if groups % factor == 0 and (kv_heads * factor) % degree == 0:
            return factor
    return groups
