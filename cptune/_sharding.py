"""How a sequence is split over CP ranks, and how it is put back together.

Without load balancing rank r holds the r-th of ``cp`` equal chunks. With load balancing
(head-tail, the layout PyTorch's ring attention expects) the sequence is cut into ``2*cp``
chunks and rank r holds chunks r and 2*cp-1-r, so every rank gets the same amount of causal
work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_indices(seq_len: int, cp: int, rank: int, load_balance: bool, device: torch.device) -> torch.Tensor:
    """Positions of the full sequence that rank ``rank`` holds, in its local order."""
    if load_balance:
        chunk = seq_len // (2 * cp)
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail_start = (2 * cp - 1 - rank) * chunk
        tail = torch.arange(tail_start, tail_start + chunk, device=device)
        return torch.cat([head, tail])
    chunk = seq_len // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)


def shard(t: torch.Tensor, dim: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim`` (a copy, contiguous)."""
    seq_len = t.shape[dim]
    if not load_balance:
        return t.narrow(dim, rank * (seq_len // cp), seq_len // cp).contiguous()
    return t.index_select(dim, local_indices(seq_len, cp, rank, True, t.device))


def gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup, cp: int, load_balance: bool) -> torch.Tensor:
    """All ranks' shards of ``t`` along ``dim``, put back in original sequence order."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t, group=group)
    if not load_balance:
        return torch.cat(parts, dim=dim)
    seq_len = t.shape[dim] * cp
    shape = list(t.shape)
    shape[dim] = seq_len
    full = t.new_empty(shape)
    for r, part in enumerate(parts):
        full.index_copy_(dim, local_indices(seq_len, cp, r, True, t.device), part)
    return full


class ShardWithGrad(torch.autograd.Function):
    """Differentiable :func:`shard`: backward gathers every rank's gradient to the full shape.

    The gathered gradient is divided by ``cp``: it is the gradient of the *mean* of the CP
    ranks' losses, the convention of DDP/FSDP gradient averaging, so a loss averaged over each
    rank's local tokens gives exactly the single-device gradient.
    """

    @staticmethod
    def forward(ctx, t, dim, group, cp, rank, load_balance):
        ctx.args = (dim, group, cp, load_balance)
        return shard(t, dim, cp, rank, load_balance)

    @staticmethod
    def backward(ctx, grad):
        dim, group, cp, load_balance = ctx.args
        return gather(grad, dim, group, cp, load_balance) / cp, None, None, None, None, None
