"""How a sequence is split over CP ranks, and how it is put back together.

Without load balancing rank r holds the r-th of ``cp`` equal chunks. With load balancing
(head-tail, the layout PyTorch's ring attention expects) the sequence is cut into ``2*cp``
chunks and rank r holds chunks r and 2*cp-1-r, so every rank gets the same amount of causal
work. Under Ulysses the sequence is split in order; under the hybrid, see :class:`Layout`. With
packed documents, load balancing balances the *work* instead (``chunks``: a finer grid of equal
chunks dealt to the ring ranks by attended pairs, see :func:`._documents.work_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._documents import head_tail_chunks, in_order_chunks


@dataclass(frozen=True)
class Layout:
    """How the sequence is split: over ``cp`` ranks, in ``ring`` ring shards (cp / ring ranks each).

    The ring shards follow the ring's layout (head-tail under load balancing); each is cut in
    order into cp / ring pieces, one per rank of a Ulysses group, so a Ulysses all-to-all
    inside the group puts the ring shard back together. Ring: ring == cp; Ulysses: ring == 1.
    """

    cp: int
    ring: int
    load_balance: bool
    chunks: tuple[tuple[int, ...], ...] | None = None
    """Chunk indices per ring rank, of a grid of equal chunks (None: head-tail under load balancing, else in order)."""

    def ring_positions(self, seq_len: int, ring_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Positions of the full sequence in ring shard ``ring_rank``, in its order."""
        chunks = self.chunks
        if chunks is None:
            chunks = head_tail_chunks(self.ring) if self.load_balance else tuple((r,) for r in range(self.ring))
        size = seq_len // sum(len(c) for c in chunks)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks[ring_rank]])

    def indices(self, seq_len: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Positions of the full sequence that CP rank ``rank`` holds, in its local order."""
        ulysses = self.cp // self.ring
        ring_rank, piece = divmod(rank, ulysses)
        size = seq_len // self.cp
        return self.ring_positions(seq_len, ring_rank, device)[piece * size:(piece + 1) * size]

    @property
    def contiguous(self) -> bool:
        if self.chunks is not None:
            return self.chunks == in_order_chunks(self.ring)
        return not (self.load_balance and self.ring > 1)


def shard(t: torch.Tensor, dim: int, layout: Layout, rank: int) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim`` (a copy, contiguous)."""
    seq_len = t.shape[dim]
    if layout.contiguous:
        size = seq_len // layout.cp
        return t.narrow(dim, rank * size, size).contiguous()
    return t.index_select(dim, layout.indices(seq_len, rank, t.device))


def gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup, layout: Layout) -> torch.Tensor:
    """All ranks' shards of ``t`` along ``dim``, put back in original sequence order."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(layout.cp)]
    dist.all_gather(parts, t, group=group)
    if layout.contiguous:
        return torch.cat(parts, dim=dim)
    seq_len = t.shape[dim] * layout.cp
    shape = list(t.shape)
    shape[dim] = seq_len
    full = t.new_empty(shape)
    for r, part in enumerate(parts):
        full.index_copy_(dim, layout.indices(seq_len, r, t.device), part)
    return full


class ShardWithGrad(torch.autograd.Function):
    """Differentiable :func:`shard`: backward gathers every rank's gradient to the full shape.

    The gathered gradient is divided by ``cp``: it is the gradient of the *mean* of the CP
    ranks' losses, the convention of DDP/FSDP gradient averaging, so a loss averaged over each
    rank's local tokens gives exactly the single-device gradient.
    """

    @staticmethod
    def forward(ctx, t, dim, group, layout, rank):
        ctx.args = (dim, group, layout)
        return shard(t, dim, layout, rank)

    @staticmethod
    def backward(ctx, grad):
        dim, group, layout = ctx.args
        return gather(grad, dim, group, layout) / layout.cp, None, None, None, None
