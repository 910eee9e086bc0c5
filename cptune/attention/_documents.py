"""Packed documents and sliding windows: who may attend to whom, said in O(S), and the work it costs.

A packed batch is described by **document ids**, one integer per token, shape (B, S) or (S,):
token i may attend to token j only when ``ids[i] == ids[j]``. A **window** ``(left, right)``
further limits token i to keys ``i - left <= j <= i + right`` (with causal attention, ``j <= i``
as well). Nothing here builds an (S, S) mask except :func:`dense_mask`, the reference for tests
and for single-device calls outside a block.

Helpers build ids the ways transformers and data pipelines describe packing: from position ids
that restart at every document (``DataCollatorWithFlattening``), from document lengths or
flash-attention's ``cu_seqlens``, and from end-of-sequence tokens. The same module measures the
causal *work* of a packed sequence (attended pairs per token) and balances it over ring ranks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..errors import Problem, ValidationError, raise_if
from .._torch_cp import not_compiled

Window = tuple[int, int]


def documents_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids from position ids that restart (``[0,1,2,0,1,0,1,2,3]``), as transformers detects packing:
    a new document starts wherever a position is not the previous one plus 1. Shape (B, S) or (S,)."""
    _integer("position_ids", position_ids)
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    first = rows[:, :1] - 1
    starts = torch.diff(rows, prepend=first, dim=-1) != 1
    return starts.cumsum(-1).reshape(position_ids.shape)


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The positions a packing is read from, as transformers reads them: (B, S) or (S,) as given; a multimodal
    model's (4, B, S) (the text positions, then M-RoPE's time, height and width): its first row; its (3, B, S) (no
    text row): None, nothing is read as packed."""
    if position_ids is None or position_ids.ndim < 3:
        return position_ids
    return position_ids[0] if position_ids.ndim == 3 and position_ids.shape[0] == 4 else None


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """:func:`documents_from_position_ids`, or None when every row holds one document (nothing is packed)."""
    ids = documents_from_position_ids(position_ids)
    return ids if bool((ids[..., -1] > 0).any()) else None


def documents_from_lengths(lengths: Sequence[int] | Sequence[Sequence[int]], seq_len: int | None = None) -> torch.Tensor:
    """Document ids from document lengths: one list (one row) or one list per batch row; each row's
    lengths must add up to ``seq_len`` (default: the first row's total). Shape (B, S)."""
    rows = [list(lengths)] if lengths and isinstance(next(iter(lengths)), int) else [list(r) for r in lengths]
    total = seq_len if seq_len is not None else sum(rows[0]) if rows else 0
    problems = []
    for i, row in enumerate(rows):
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in row):
            problems.append(Problem("lengths", f"row {i} holds a length that is not a positive integer ({row})",
                                    "give each document's token count, 1 or more"))
        elif sum(row) != total:
            problems.append(Problem("lengths", f"row {i} adds up to {sum(row)} tokens, not {total}",
                                    "give lengths that fill the sequence (add the padding as a document of "
                                    "its own)"))
    raise_if(problems or ([] if rows else [Problem("lengths", "is empty", "give at least one document")]))
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def documents_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Document ids from flash-attention's cumulative lengths ``[0, l0, l0+l1, ...]`` (one packed row). Shape (1, S)."""
    cu = torch.as_tensor(cu_seqlens).tolist()
    if not cu or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValidationError([Problem("cu_seqlens", f"{cu} is not 0 followed by increasing offsets",
                                       "pass [0, l0, l0 + l1, ...] as flash-attention's varlen kernels take it")])
    return documents_from_lengths([b - a for a, b in zip(cu, cu[1:])])


def documents_from_eos(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Document ids from end-of-sequence tokens: each EOS ends the document it belongs to. Shape as ``input_ids``."""
    _integer("input_ids", input_ids)
    ends = (input_ids == eos_token_id).to(torch.int64)
    return ends.cumsum(-1) - ends  # the EOS token still belongs to the document it closes


def _integer(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool or t.ndim == 0:
        raise ValidationError([Problem(name, f"is {type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}",
                                       "pass an integer tensor of shape (batch, seq) or (seq,)")])


def check_window(window: object, argument: str = "window") -> Window | None:
    """``(left, right)`` as two ints >= 0 (None: no window), or a ValidationError naming the fix."""
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in window)
    if not ok:
        raise ValidationError([Problem(argument, f"is {window!r}", "give (left, right): how many earlier and later "
                                       "tokens each token may attend to besides itself, e.g. (4095, 0) for a "
                                       "Mistral-style sliding_window=4096")])
    return int(window[0]), int(window[1])


def document_problems(documents: object, seq_len: int | None, batch: int | None,
                      argument: str = "documents") -> list[Problem]:
    """What is wrong with ``documents`` for buffers of ``seq_len`` tokens and ``batch`` rows (None: not known)."""
    if not isinstance(documents, torch.Tensor) or documents.is_floating_point() or documents.dtype == torch.bool:
        what = documents.dtype if isinstance(documents, torch.Tensor) else type(documents).__name__
        return [Problem(argument, f"is {what}", "pass integer document ids per token, shape (batch, seq) or (seq,), "
                        "e.g. cptune.documents_from_position_ids(position_ids)")]
    if documents.ndim not in (1, 2):
        return [Problem(argument, f"has shape {tuple(documents.shape)}", "pass ids of shape (batch, seq) or (seq,)")]
    problems = []
    if seq_len is not None and documents.shape[-1] != seq_len:
        problems.append(Problem(argument, f"covers {documents.shape[-1]} tokens but the buffers hold {seq_len}",
                                "give one id per token of the whole (unsharded) sequence"))
    if batch is not None and documents.ndim == 2 and documents.shape[0] not in (1, batch):
        problems.append(Problem(argument, f"has {documents.shape[0]} rows for a batch of {batch}",
                                f"give 1 row (shared) or {batch}"))
    return problems


def as_rows(documents: torch.Tensor) -> torch.Tensor:
    """(B, S) int64 on the CPU: the form the attention planner reads."""
    ids = documents if documents.ndim == 2 else documents.unsqueeze(0)
    return ids.to(device="cpu", dtype=torch.int64).contiguous()


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
            causal: bool, window: Window | None) -> torch.Tensor:
    """(…, Lq, Lk) bool: which keys each query may attend to (positions are global token indices)."""
    i, j = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    keep = torch.ones(i.shape[:-1] + j.shape[-1:], dtype=torch.bool, device=q_pos.device)
    if causal:
        keep = keep & (j <= i)
    if window is not None:
        keep = keep & (j >= i - window[0]) & (j <= i + window[1])
    if q_doc is not None:
        keep = keep & (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2))
    return keep


def positions_in_documents(documents: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    """(B or 1, S): each token's position inside its document (0 at every document's first token)."""
    rows = as_rows(documents) if documents is not None else torch.zeros(1, seq_len, dtype=torch.int64)
    index = torch.arange(rows.shape[-1])
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


_CHUNKED: list[tuple[torch.Tensor | None, int, int, torch.Tensor]] = []  # the last few, for every layer of a step


@not_compiled
def chunked(documents: torch.Tensor | None, seq_len: int, chunk: int) -> torch.Tensor:
    """Document ids cut into chunks of ``chunk`` tokens, counted from each document's start (Llama 4's chunked
    attention: a token attends within its chunk only, block-diagonal like packed documents). (B or 1, S)."""
    for docs, length, size, ids in _CHUNKED:
        if docs is documents and length == seq_len and size == chunk:
            return ids
    rows = as_rows(documents) if documents is not None else torch.zeros(1, seq_len, dtype=torch.int64)
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    ids = (starts | (positions_in_documents(rows, seq_len) % chunk == 0)).cumsum(-1)
    _CHUNKED[:] = [(documents, seq_len, chunk, ids), *_CHUNKED[:3]]
    return ids


def dense_mask(documents: torch.Tensor | None, window: Window | None, causal: bool, seq_len: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The (B or 1, 1, S, S) bool mask these rules mean: for one device, and the reference in tests."""
    pos = torch.arange(seq_len, device=device)
    doc = as_rows(documents).to(device) if documents is not None else None
    mask = visible(pos, pos, doc, doc, causal, window)
    return mask.unsqueeze(-3) if mask.ndim == 3 else mask.expand(1, 1, seq_len, seq_len)  # (B, 1, S, S)


# -- work ---------------------------------------------------------------------------------------


def token_work(documents: torch.Tensor | None, seq_len: int, causal: bool, window: Window | None) -> torch.Tensor:
    """(S,) attended keys per query token, summed over batch rows: the work each token costs."""
    rows = as_rows(documents) if documents is not None else torch.zeros(1, seq_len, dtype=torch.int64)
    pos = torch.arange(seq_len)
    total = torch.zeros(seq_len, dtype=torch.float64)
    for ids in rows.unique(dim=0):
        count = int((rows == ids).all(-1).sum())
        starts = torch.ones(seq_len, dtype=torch.bool)
        starts[1:] = ids[1:] != ids[:-1]
        run = starts.cumsum(0) - 1  # each token's run of equal ids
        run_start = pos[starts]
        run_end = torch.cat([run_start[1:], torch.tensor([seq_len])]) - 1
        before, after = pos - run_start[run], run_end[run] - pos  # keys of its own document before / after it
        if window is not None:
            before, after = before.clamp(max=window[0]), after.clamp(max=window[1])
        total += count * (before + 1 + (0 if causal else after)).to(torch.float64)
    return total


def balanced_chunks(work: torch.Tensor, ring: int, grid: int) -> tuple[tuple[int, ...], ...]:
    """Cut the sequence into ``grid`` equal chunks and give each of ``ring`` ranks grid / ring of them so the
    work is balanced: the heaviest chunk first to the lightest rank with room (greedy, by attended pairs)."""
    per_chunk = work.reshape(grid, -1).sum(-1).tolist()
    owners: list[list[int]] = [[] for _ in range(ring)]
    load = [0.0] * ring
    for c in sorted(range(grid), key=lambda c: (-per_chunk[c], c)):
        rank = min((r for r in range(ring) if len(owners[r]) < grid // ring), key=lambda r: (load[r], r))
        owners[rank].append(c)
        load[rank] += per_chunk[c]
    return tuple(tuple(sorted(o)) for o in owners)


def head_tail_chunks(ring: int) -> tuple[tuple[int, ...], ...]:
    """PyTorch's causal load balancing: 2 * ring chunks, rank r holding chunks r and 2 * ring - 1 - r."""
    return tuple((r, 2 * ring - 1 - r) for r in range(ring))


def imbalance(work: torch.Tensor, chunks: tuple[tuple[int, ...], ...], grid: int) -> float:
    """Max over ranks of their attended pairs / the mean: 1.0 is perfect balance."""
    per_chunk = work.reshape(grid, -1).sum(-1)
    loads = [float(per_chunk[list(c)].sum()) for c in chunks]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


IN_ORDER_SLACK = 1.05
"""Under documents or a window, ranks keep the sequence in order (rank r the r-th stretch) while that is within
this factor of the best dealing's balance: in order, a rank attends the fewest other ranks' blocks, so the ring
sends the fewest (a window of S/16 on 4 ranks: one neighbour's, against two under head-tail)."""


def in_order_chunks(ring: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holding the r-th of ``ring`` chunks: the layout without load balancing."""
    return tuple((r,) for r in range(ring))


def work_chunks(work: torch.Tensor, ring: int, by_work: bool = True) -> tuple[tuple[tuple[int, ...], ...], int] | None:
    """The load-balanced layout: (chunks each of ``ring`` ranks holds, the grid they index), or None when the
    sequence does not cut into 2 * ring chunks. ``work``: attended pairs per token (:func:`token_work`).

    Head-tail unless ``by_work`` (documents or a window). Then the finest grid of 8, 4 or 2 chunks per rank
    that divides the sequence, dealt by work, when it balances better than head-tail; and the sequence in
    order when that is within ``IN_ORDER_SLACK`` of the better of the two (it sends the fewest blocks). The one
    layout rule: the block deals tokens by it, the planner predicts with it."""
    seq_len, head_tail = work.numel(), head_tail_chunks(ring)
    if seq_len % (2 * ring):
        return None
    if not by_work:
        return head_tail, 2 * ring
    grid = next(g for g in (8 * ring, 4 * ring, 2 * ring) if seq_len % g == 0)
    dealt = balanced_chunks(work, ring, grid)
    best = (dealt, grid) if imbalance(work, dealt, grid) < imbalance(work, head_tail, 2 * ring) else \
        (head_tail, 2 * ring)
    if imbalance(work, in_order_chunks(ring), ring) <= IN_ORDER_SLACK * imbalance(work, *best):
        return in_order_chunks(ring), ring
    return best


def lengths_from_spec(spec: str, seq_len: int) -> list[int]:
    """A workload's document spec as lengths that fill ``seq_len``: ``'16'`` (16 equal documents),
    ``'longtail'`` (a fixed long-tailed mix: a few long documents and many short ones, seed 0) or
    ``'1024,512,...'`` (explicit lengths)."""
    spec = read_spec(spec)
    if spec == "longtail":
        rng, left, out = random.Random(0), seq_len, []
        while left > 0:  # Pareto(1) lengths from 1/256 of the sequence: most short, a few very long
            n = min(left, max(1, int(seq_len / 256 * rng.paretovariate(1.0))))
            out.append(n)
            left -= n
        return out
    if len(spec) == 1:
        n = spec[0]
        if seq_len % n:
            raise ValidationError([Problem("documents", f"{n} equal documents do not divide {seq_len} tokens",
                                           f"use a count that divides {seq_len}, or give lengths")])
        return [seq_len // n] * n
    if sum(spec) != seq_len:
        raise ValidationError([Problem("documents", f"lengths {','.join(map(str, spec))} add up to {sum(spec)}, "
                                       f"not {seq_len} tokens", "give lengths adding up to the sequence length")])
    return spec


def read_spec(spec: object) -> str | list[int]:
    """A documents spec's form, before any length: 'longtail', or the count / lengths as positive integers."""
    text = str(spec).strip()
    if text == "longtail":
        return text
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValidationError([Problem("documents", f"cannot read {text!r}",
                                       "give a count of equal documents (16), 'longtail', or lengths adding up to "
                                       "the sequence length (1024,512,...)")])
    return values
