"""Short causal convolutions split over cp (LFM2's ShortConv), by a halo exchange: memory split like attention's.

A short convolution of kernel k reads each token and the k - 1 before it. Inside a block of cp > 1 each rank runs
the layer on its own tokens (its projections, the gate, the convolution, the output projection) and receives, for
each run of consecutive positions it holds, the k - 1 tokens before the run from whichever rank holds them: each rank
all-gathers the last k - 1 tokens of every run it holds (a few tokens a rank), so any layout works (load balancing's
head-tail chunks, Ulysses' pieces). Backward sums each received token's gradient back to the rank that sent it.
Packed documents: a token's window keeps only the tokens of its own document (the convolution restarts at each
document, as one process running each document alone). Exact: the same products and sums as the model's ``Conv1d``,
in another order (float32 rounding).

A layer takes this path where :func:`splittable` recognizes it (LFM2's ``Lfm2ShortConv`` of transformers 4.56 and
5.x: ``in_proj`` to B, C and x, a depthwise causal ``conv``, ``out_proj``); others take the generic path
(:mod:`cptune.mixers._generic`). Outside a block, or with cp = 1, the layer is called as it is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ._generic import GatherSequence, segments
from ..attention import Layout


NAME = "halo"

def splittable(module: nn.Module) -> bool:
    """Whether ``module`` is a short-convolution layer this path runs split: a ``*ShortConv`` whose ``in_proj`` makes
    B, C and x (3 x the width), whose ``conv`` is a depthwise causal ``Conv1d`` over them, and an ``out_proj``."""
    conv, proj, out = (getattr(module, n, None) for n in ("conv", "in_proj", "out_proj"))
    return (type(module).__name__.endswith("ShortConv") and isinstance(conv, nn.Conv1d)
            and isinstance(proj, nn.Linear) and isinstance(out, nn.Linear)
            and conv.groups == conv.in_channels == conv.out_channels == out.in_features
            and proj.out_features == 3 * conv.in_channels and conv.padding == (conv.kernel_size[0] - 1,)
            and conv.stride == (1,) and conv.dilation == (1,))


def fits(module: nn.Module, cp: int) -> bool:
    """Any cp: a rank receives the kernel - 1 tokens before each of its runs, whatever the layout."""
    return True


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) indices into ``positions`` of each run of consecutive global positions."""
    return segments(positions - torch.arange(positions.numel(), device=positions.device))


@functools.lru_cache(maxsize=64)
def _plan(layout, seq_len: int, halo: int) -> tuple[list[list[tuple[int, int, int]]], list[list[int]],
                                                     dict[int, tuple[int, int]], int]:
    """Per rank, its runs (start, end in its local order, the first's global position) and the local indices of
    the last ``halo`` tokens of each run; where each such global position lies (rank, slot); and the most slots a
    rank sends."""
    runs, sends, where = [], [], {}
    for rank in range(layout.cp):
        positions = layout.indices(seq_len, rank)
        found = _runs(positions)
        runs.append([(a, b, int(positions[a])) for a, b in found])
        slots = [i for a, b in found for i in range(max(a, b - halo), b)]
        sends.append(slots)
        where.update({int(positions[i]): (rank, s) for s, i in enumerate(slots)})
    return runs, sends, where, max(len(s) for s in sends)


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, session) -> torch.Tensor:
    """A depthwise causal convolution (``weight`` (D, k), ``bias``: a ``Conv1d``'s, its channel dim dropped) over
    the whole sequence, at this rank's tokens: ``x`` (b, s, D) this rank's, in its local order; the tokens before
    each of its runs from the ranks that hold them."""
    k = weight.shape[-1]
    halo, layout, rank, group = k - 1, session.layout, session.cp_rank, session.group
    seq_len = x.shape[1] * layout.cp
    runs, sends, where, width = _plan(layout, seq_len, halo)
    mine = torch.tensor(sends[rank], dtype=torch.long, device=x.device)
    edges = x.new_zeros(x.shape[0], width, x.shape[2])
    edges = edges.index_copy(1, torch.arange(len(sends[rank]), device=x.device), x.index_select(1, mine))
    # every rank's edges, rank after rank (backward: each rank's part of the summed gradient)
    flat = GatherSequence.apply(edges, 1, group, Layout(layout.cp, layout.cp, False), rank)
    zero = flat.new_zeros(x.shape[0], 1, x.shape[2])
    table = torch.cat([flat, zero], dim=1)  # the last row: before the sequence's start
    documents = session.documents
    docs = None if documents is None or documents.shape[-1] != seq_len else documents.to(x.device)
    # out[t] = sum_j weight[:, k - 1 - j] * x[t - j]
    outs = []
    for a, b, start in runs[rank]:
        before = [where[p][0] * width + where[p][1] if p >= 0 else layout.cp * width for p in range(start - halo, start)]
        run = torch.cat([table[:, before], x[:, a:b]], dim=1)  # (b, halo + L, D)
        glob = torch.arange(start, start + b - a, device=x.device)
        out = run[:, halo:] * weight[:, k - 1]
        for j in range(1, k):
            term = run[:, halo - j:halo - j + b - a] * weight[:, k - 1 - j]
            if docs is not None:  # a token's window keeps to its own document
                same = (glob - j >= 0) & (docs[:, glob] == docs[:, (glob - j).clamp_min(0)])
                term = term * same.unsqueeze(-1).to(term.dtype)
            out = out + term
        outs.append(out)
    out = torch.cat(outs, dim=1)
    return out if bias is None else out + bias


def split_forward(module: nn.Module, hidden_states: torch.Tensor, session, *args, **kwargs) -> torch.Tensor:
    """The layer (:func:`splittable`) on this rank's tokens inside a block of cp > 1 (:mod:`cptune.mixers._choice` calls
    it)."""
    b, c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    y = c * halo_conv(b * x, module.conv.weight[:, 0], module.conv.bias, session)
    return module.out_proj(y)
