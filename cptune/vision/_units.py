"""The vision tower's units of work and how they are dealt over the CP ranks.

A tower that attends within one image or one video frame (Qwen2-VL, Qwen2.5-VL and Qwen3-VL: their attention is
block-diagonal over ``grid_thw``'s temporal patches) splits into independent units: one temporal patch of an image
or a video, ``h x w`` patches in, ``h x w / merge²`` embeddings out, both contiguous rows of the whole call's input and
output. Each rank encodes the units dealt to it, as LongVILA spreads images and frames over its GPUs before the
language model; the tower's output of a unit is the same whichever rank runs it, since nothing crosses units.

A unit's cost is its patches (the projections and the MLP, per patch) plus its attention, which grows with the square
of its patches: ``n * (1 + n / (6 * width))`` for ``n`` patches and a tower ``width`` wide (per layer, the
projections and MLP take about ``24 n width²`` flops and attention ``4 n² width``). Units are dealt longest first to
the least loaded rank (ties to the lower rank), the same on every rank. A unit is the smallest piece: one frame's
tower work is on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Unit:
    """One temporal patch of an image or a video: what one rank encodes whole."""

    item: int
    """Which image or video: its row of ``grid_thw``."""
    rows: tuple[int, int]
    """Its patches: rows ``[start, stop)`` of the pixel values."""
    tokens: tuple[int, int]
    """Its embeddings: rows ``[start, stop)`` of the tower's output over every image (or video) of the call."""
    grid: tuple[int, int, int]
    """``(1, h, w)``: the grid the tower runs it with."""
    cost: float


def units(grid_thw: torch.Tensor, merge: int, width: int) -> list[Unit]:
    """The units of a call's ``grid_thw`` ((items, 3): temporal patches, height and width in patches), in the order
    of the tower's input and output; ``merge``: the tower's spatial merge (output rows = patches / merge²);
    ``width``: its hidden size, for the cost."""
    found, row, token = [], 0, 0
    for item, (t, h, w) in enumerate(grid_thw.tolist()):
        n = int(h) * int(w)
        out = n // (merge * merge)
        for _ in range(int(t)):
            found.append(Unit(item, (row, row + n), (token, token + out), (1, int(h), int(w)),
                              n * (1.0 + n / (6.0 * width))))
            row, token = row + n, token + out
    return found


def deal(found: list[Unit], ranks: int) -> list[int]:
    """The rank that encodes each unit: longest first to the least loaded rank (ties to the lower one)."""
    loads = [0.0] * ranks
    owners = [0] * len(found)
    for i in sorted(range(len(found)), key=lambda i: (-found[i].cost, i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += found[i].cost
    return owners


def loads(found: list[Unit], owners: list[int], ranks: int) -> list[float]:
    """Each rank's dealt cost."""
    out = [0.0] * ranks
    for unit, rank in zip(found, owners):
        out[rank] += unit.cost
    return out
