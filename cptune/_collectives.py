"""Collectives the packages share: an all-to-all of uneven rows that autograd differentiates (the same trade reversed
in backward). The experts send tokens to their experts' ranks with it, the vision tower its embeddings to the ranks
that hold their positions. And process groups made once per world (:func:`groups`), forgotten with cptune's meshes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


_GROUPS: dict[tuple, list[Any]] = {}


def groups(lists: list[list[int]]) -> list[Any]:
    """A process group for each list of ranks, made once per world and lists (every rank calls it: a collective the
    first time); a model built again (a search's next trial) reuses them instead of making more."""
    key = (id(dist.group.WORLD), tuple(map(tuple, lists)))
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(ranks) for ranks in lists]
    return _GROUPS[key]


def release_groups() -> None:
    """Forget the groups :func:`groups` made (:func:`cptune.mesh.release_groups`)."""
    _GROUPS.clear()


def all_to_all_rows(rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """Rows sent ``in_sizes[j]`` to rank j of ``group`` (in order), ``out_sizes[j]`` received from it; differentiable
    (the reverse trade in backward)."""
    return _AllToAll.apply(rows, out_sizes, in_sizes, group)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven rows, its gradient the same trade reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = rows.new_empty(sum(out_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_sizes, in_sizes = ctx.sizes
        return _AllToAll.apply(grad, in_sizes, out_sizes, ctx.group), None, None, None
