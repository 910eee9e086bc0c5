"""Each embedding the tower made sent to the rank that holds its placeholder, in that rank's order.

The language model fills its placeholders (``input_ids == image_token_id``) with the tower's rows in order: row k of
the whole call's output fills the k-th placeholder of the whole batch (row-major: sample, then position). Under CP a
rank holds some positions of each row, in its layout's order (in order, load balancing's head-tail chunks, the
work-balanced chunks of packed documents, Ulysses and the hybrid alike: :meth:`cptune.attention.Layout.indices`);
its model fills its own placeholders, row-major over its shard, so it needs exactly the rows of those placeholders in
that order. :func:`routing` works out, the same on every rank from the whole batch's ids, which rank needs which
rows and which rank made each; :func:`route` trades them with one all-to-all (differentiable: each gradient goes back
the same way to the rank that encoded the row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._collectives import all_to_all_rows
from ._units import Unit


@dataclass(frozen=True)
class Routing:
    """Which rows each rank fills and where each row is made."""

    needed: list[torch.Tensor]
    """Per rank, the output rows it fills, in its fill order."""
    source: torch.Tensor
    """Per output row, the rank that encodes it."""
    offset: torch.Tensor
    """Per output row, its place among the rows its source encodes."""


def routing(placeholders: torch.Tensor, held: list[torch.Tensor], found: list[Unit], owners: list[int]) -> Routing:
    """``placeholders``: (B, S) bool, the whole batch's placeholders of one modality; ``held``: each rank's positions
    of the sequence in its local order; ``found`` and ``owners``: the units and the rank dealt each (their output rows
    in order make the placeholders' rows)."""
    ordinal = placeholders.reshape(-1).long().cumsum(0).sub(1).view_as(placeholders)
    needed = [ordinal[:, idx][placeholders[:, idx]] for idx in held]
    rows = found[-1].tokens[1] if found else 0
    source = torch.empty(rows, dtype=torch.long)
    offset = torch.empty(rows, dtype=torch.long)
    made = [0] * len(held)
    for unit, rank in zip(found, owners):
        a, b = unit.tokens
        source[a:b] = rank
        offset[a:b] = torch.arange(made[rank], made[rank] + b - a)
        made[rank] += b - a
    return Routing(needed, source, offset)


def route(encoded: torch.Tensor, plan: Routing, rank: int, group) -> torch.Tensor:
    """This rank's placeholders' rows, in its fill order, from ``encoded`` (the rows it made, in unit order)."""
    ranks = len(plan.needed)
    sends, in_sizes = [], []
    for dest in range(ranks):
        rows = plan.needed[dest]
        mine = rows[plan.source[rows] == rank]
        sends.append(plan.offset[mine])
        in_sizes.append(int(mine.numel()))
    rows = plan.needed[rank]
    sources = plan.source[rows]
    out_sizes = [int((sources == s).sum()) for s in range(ranks)]
    got = all_to_all_rows(encoded.index_select(0, torch.cat(sends).to(encoded.device)), out_sizes, in_sizes, group)
    order = torch.sort(sources, stable=True).indices  # received grouped by source, each group in fill order
    return got.index_select(0, torch.argsort(order).to(got.device))
