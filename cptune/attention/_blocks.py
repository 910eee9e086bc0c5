"""Which kernel calls one (query block, key block) pair needs: attended pairs only, never an (S, S) mask.

A block is a list of global token positions (a rank's shard, in its order) of one batch row
group. Both blocks are cut into **runs**: maximal stretches of consecutive positions inside one
document. For each pair of runs of the same document, the rules (causal, window) give the
attended set, which is decomposed into kernel calls (:class:`Task`):

* a full rectangle (no mask): every query of the run sees every key of the other;
* a causal square (``is_causal``): the same run of queries and keys, top-left aligned;
* a masked tile: a band edge (sliding window) or a cut of the caller's dense mask, with an
  additive float mask no larger than ``MAX_TILE`` x ``MAX_TILE`` elements (windows: tiles about
  as long as the window, so little work is wasted).

Pairs with nothing attended give no task at all: their kernel is never called. The dense mask,
when given, is sliced at the tasks' positions and tiles it fully masks are dropped.

:func:`needs` says the same per block: whether a rank's queries attend any key of another rank's
block at all, so the ring sends a block only where it is attended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._documents import Window, visible

MAX_TILE = 1024
"""A masked task covers at most MAX_TILE x MAX_TILE (queries x keys), so its mask stays small."""
MIN_TILE = 64


@dataclass(frozen=True)
class Task:
    """One kernel call: local query rows ``q0:q1`` of the query block against local keys ``k0:k1``."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    mask: torch.Tensor | None = None  # (..., q1-q0, k1-k0): bool (True = attend) or an additive bias; None: all attend


def runs(positions: torch.Tensor, docs: torch.Tensor | None) -> list[tuple[int, int, int, int]]:
    """(local start, local end, global start, document) of each stretch of consecutive positions in one document."""
    n = positions.numel()
    if n == 0:
        return []
    cut = torch.zeros(n, dtype=torch.bool)
    cut[0] = True
    cut[1:] = positions[1:] != positions[:-1] + 1
    local = docs[positions] if docs is not None else torch.zeros(n, dtype=torch.int64)
    cut[1:] |= local[1:] != local[:-1]
    starts = torch.nonzero(cut).flatten()
    ends = starts[1:].tolist() + [n]
    return list(zip(starts.tolist(), ends, positions[starts].tolist(), local[starts].tolist()))


def _bounds(i0: int, i1: int, causal: bool, window: Window | None) -> tuple[float, float, float, float]:
    """For queries [i0, i1): the lowest / highest key any of them sees, and the lowest / highest every one sees."""
    left = window[0] if window is not None else math.inf
    right = 0 if causal else (window[1] if window is not None else math.inf)
    return i0 - left, i1 - 1 + right, i1 - 1 - left, i0 + right


def _causal_square(a: int, b: int, k0: int, split: tuple[int, int] | None, out: list[Task]) -> None:
    """Queries [a, b) against keys [k0, k0 + b - a), causal; cut in halves (two causal squares and the full
    rectangle below the diagonal) while longer than ``split[0]`` and not past ``split[1]``: a kernel that
    skips no work inside its own blocks below some length then does less."""
    n = b - a
    if split is None or not split[0] < n <= split[1]:
        out.append(Task(a, b, k0, k0 + n, causal=True))
        return
    half = n // 2
    _causal_square(a, a + half, k0, split, out)
    out.append(Task(a + half, b, k0, k0 + half))
    _causal_square(a + half, b, k0 + half, split, out)


def _pair(q: tuple[int, ...], k: tuple[int, ...], causal: bool, window: Window | None, out: list[Task],
          split: tuple[int, int] | None = None) -> None:
    """Tasks for one query run against one key run of the same document (see :func:`runs`)."""
    (qs, qe, qg, _), (ks, ke, kg, _) = q, k
    tile = qe - qs
    if window is not None:
        tile = min(tile, max(MIN_TILE, window[0] + window[1] + 1))
    for a in range(qs, qe, tile):
        b = min(qe, a + tile)
        i0, i1 = qg + (a - qs), qg + (b - qs)  # global query range of this tile
        lo_any, hi_any, lo_all, hi_all = _bounds(i0, i1, causal, window)
        j0, j1 = max(kg, lo_any), min(kg + (ke - ks) - 1, hi_any)  # keys any query sees
        if j0 > j1:
            continue
        k0, k1 = ks + int(j0) - kg, ks + int(j1) - kg + 1
        if lo_all <= j0 and j1 <= hi_all:  # every query sees every key in range
            out.append(Task(a, b, k0, k1))
        elif causal and window is None and j1 == i1 - 1 and j0 <= i0:  # keys up to the diagonal
            if j0 < i0:
                out.append(Task(a, b, k0, ks + i0 - kg))
            _causal_square(a, b, ks + i0 - kg, split, out)
        else:
            _masked(a, b, i0, k0, k1, ks, kg, causal, window, out)


def _masked(a: int, b: int, i0: int, k0: int, k1: int, ks: int, kg: int, causal: bool, window: Window | None,
            out: list[Task]) -> None:
    """Masked tiles of at most MAX_TILE x MAX_TILE for query rows [a, b) (global start i0) and keys [k0, k1)."""
    for qa in range(a, b, MAX_TILE):
        qb = min(b, qa + MAX_TILE)
        q_pos = torch.arange(i0 + qa - a, i0 + qb - a)
        for ka in range(k0, k1, MAX_TILE):
            kb = min(k1, ka + MAX_TILE)
            mask = visible(q_pos, torch.arange(kg + ka - ks, kg + kb - ks), None, None, causal, window)
            if mask.any():
                out.append(Task(qa, qb, ka, kb, mask=None if bool(mask.all()) else mask))


def plan(q_pos: torch.Tensor, k_pos: torch.Tensor, docs: torch.Tensor | None, causal: bool,
         window: Window | None, dense: torch.Tensor | None = None, split: tuple[int, int] | None = None) -> list[Task]:
    """Every kernel call the pair (queries at ``q_pos``, keys at ``k_pos``) needs, for one row group.

    ``docs``: (S,) document ids of the rows (None: one document); ``dense``: the caller's bool
    mask for the whole sequence, (..., S, S), applied on top (tasks it fully masks are dropped);
    ``split``: the causal square lengths to cut in halves (see :func:`_causal_square`).
    """
    tasks: list[Task] = []
    by_doc: dict[int, list[tuple[int, ...]]] = {}
    for k in runs(k_pos, docs):
        by_doc.setdefault(k[3], []).append(k)
    for q in runs(q_pos, docs):
        for k in by_doc.get(q[3], ()):
            _pair(q, k, causal, window, tasks, split)
    return tasks if dense is None else _with_dense(tasks, q_pos, k_pos, dense)


def _with_dense(tasks: list[Task], q_pos: torch.Tensor, k_pos: torch.Tensor, dense: torch.Tensor) -> list[Task]:
    """The tasks cut to MAX_TILE tiles with the dense mask's slice on top (bool: attend; float: additive bias)."""
    out = []
    for t in tasks:
        for qa in range(t.q0, t.q1, MAX_TILE):
            qb = min(t.q1, qa + MAX_TILE)
            for ka in range(t.k0, t.k1, MAX_TILE):
                kb = min(t.k1, ka + MAX_TILE)
                cut = dense.index_select(-2, q_pos[qa:qb]).index_select(-1, k_pos[ka:kb])
                own = None
                if t.causal or t.mask is not None:
                    own = t.mask[..., qa - t.q0:qb - t.q0, ka - t.k0:kb - t.k0] if t.mask is not None else \
                        visible(q_pos[qa:qb], k_pos[ka:kb], None, None, True, None)
                if cut.dtype == torch.bool:
                    cut = cut & own if own is not None else cut
                    if cut.any():
                        out.append(Task(qa, qb, ka, kb, mask=None if bool(cut.all()) else cut))
                    continue
                if own is not None:
                    cut = cut.masked_fill(~own, float("-inf"))
                if not bool(torch.isneginf(cut).all()):
                    out.append(Task(qa, qb, ka, kb, mask=None if not bool(cut.any()) else cut))
    return out


def _attends(q_runs: list, k_runs: list, causal: bool, window: Window | None) -> bool:
    """Whether some query of ``q_runs`` attends some key of ``k_runs`` (:func:`runs` of one row group): exactly
    when :func:`plan` without a dense mask gives a task. A run's queries see one unbroken stretch of keys (each
    query's interval overlaps the next one's), so a pair of runs of one document is attended when that stretch
    meets the keys."""
    left = window[0] if window is not None else math.inf
    right = 0 if causal else (window[1] if window is not None else math.inf)
    by_doc: dict[int, list[tuple[int, int]]] = {}
    for ks, ke, kg, doc in k_runs:
        by_doc.setdefault(doc, []).append((kg, kg + ke - ks - 1))
    for qs, qe, qg, doc in q_runs:
        lo, hi = qg - left, qg + qe - qs - 1 + right
        if any(k0 <= hi and lo <= k1 for k0, k1 in by_doc.get(doc, ())):
            return True
    return False


def needs(positions: torch.Tensor, docs: torch.Tensor | None, batch: int, causal: bool,
          window: Window | None) -> tuple[tuple[bool, ...], ...]:
    """``need[d][s]``: whether ring rank ``d``'s queries attend some key of ring rank ``s``'s block in some batch
    row (``positions``: (R, L); ``docs``: (B or 1, S) or None). Every rank computes the same matrix without
    communication. A dense mask only removes pairs, so it is not read: a block it masks fully still travels."""
    ring = positions.shape[0]
    need = [[d == s for s in range(ring)] for d in range(ring)]
    for _, ids in row_groups(docs, batch):
        spans = [list(runs(positions[r], ids)) for r in range(ring)]  # each rank's runs, found once per group
        for d in range(ring):
            for s in range(ring):
                need[d][s] = need[d][s] or _attends(spans[d], spans[s], causal, window)
    return tuple(tuple(row) for row in need)


def row_groups(docs: torch.Tensor | None, batch: int) -> list[tuple[list[int], torch.Tensor | None]]:
    """Batch rows that share one document layout, with it: (rows, (S,) ids or None)."""
    if docs is None:
        return [(list(range(batch)), None)]
    if docs.shape[0] == 1:
        return [(list(range(batch)), docs[0])]
    groups: dict[tuple, list[int]] = {}
    for r in range(batch):
        groups.setdefault(tuple(docs[r].tolist()), []).append(r)
    return [(rows, docs[rows[0]]) for rows in groups.values()]
