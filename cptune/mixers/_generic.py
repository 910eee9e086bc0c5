"""The generic CP path for a layer that mixes tokens outside softmax attention (Gated DeltaNet, short convolutions,
Mamba): inside a block of cp > 1 the layer's input is all-gathered over cp (the whole sequence, in order, load
balancing undone), the model's own module runs on it (its own kernels: flash-linear-attention or mamba-ssm where
installed, torch's fallback elsewhere), and each rank keeps the output at its own positions. Backward sums every
rank's gradient of the whole input and hands each rank its positions' part, so the layer is exact: the same module
on the same sequence as one process.

Packed documents: the recurrence or convolution restarts at each document, as packing means, whatever the module's
own kernels read of the packing: the module runs once per document of the gathered row.

Its memory and time are the whole sequence's on every rank, for this layer (the layer's activations and the
gathered input are not split over cp); attention and the per-token modules around it stay split. Outside a block the
module is called as it is; in a block of cp = 1 too, but on each document alone when the block knows the packing
(the same restart as on cp ranks, whatever the module's kernels read of it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import attention as A
from .._session import active
from .._torch_cp import not_compiled

_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cache_position")
"""What a transformers layer may be told of the packing or of positions in its own shard: dropped, since the module
runs on each document of the whole sequence."""


class GatherSequence(torch.autograd.Function):
    """All ranks' shards along ``dim`` in sequence order; backward: the sum of every rank's gradient of the whole,
    this rank's positions of it."""

    @staticmethod
    def forward(ctx, t, dim, group, layout, rank):
        ctx.args = (dim, group, layout, rank)
        return A.gather(t, dim, group, layout)

    @staticmethod
    def backward(ctx, grad):
        dim, group, layout, rank = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return A.shard(grad, dim, layout, rank), None, None, None, None


def _map_sequence(value: Any, local: int, fn) -> Any:
    """``fn`` applied to each tensor in ``value`` (a tensor, or a dict, tuple or list of them) whose dim 1 is
    ``local`` tokens long; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.ndim >= 2 and value.shape[1] == local else value
    if isinstance(value, dict):
        return {k: _map_sequence(v, local, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map_sequence(v, local, fn) for v in value)
    return value


def _join(parts: list[Any], dim: int) -> Any:
    """The module's outputs on consecutive pieces, joined along ``dim`` (tensors; anything else: the first's)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=dim)
    if isinstance(first, (tuple, list)):
        return type(first)(_join([p[i] for p in parts], dim) if isinstance(first[i], torch.Tensor) else first[i]
                           for i in range(len(first)))
    return first


def segments(ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of one value along a row (a document id; the halo path: position - index)."""
    change = (ids[1:] != ids[:-1]).nonzero().flatten().add(1).tolist()
    return list(zip([0, *change], [*change, ids.numel()]))


def _per_document(forward, hidden: torch.Tensor, kwargs: dict[str, Any], documents: torch.Tensor) -> Any:
    """``forward`` on each document of the whole sequence, joined back: on every row at once where the rows share
    one packing, else row by row."""
    batch, length = hidden.shape[:2]
    shared = documents.shape[0] == 1
    rows = []
    for b in range(1 if shared else batch):
        parts = []
        for start, end in segments(documents[b]):
            def piece(t: torch.Tensor, b=b, start=start, end=end) -> torch.Tensor:
                return (t if shared or t.shape[0] != batch else t[b:b + 1])[:, start:end]

            parts.append(forward(piece(hidden), **_map_sequence(kwargs, length, piece)))
        rows.append(_join(parts, 1))
    return _join(rows, 0)


def by_document(session, forward, hidden: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """``forward(hidden, **kwargs)`` on the whole rows, or on each document alone where the block knows the packing
    of rows this long (:func:`_per_document`): every path's restart at each document."""
    documents = session.documents
    if documents is None or documents.shape[-1] != hidden.shape[1]:
        return forward(hidden, **kwargs)
    return _per_document(forward, hidden, kwargs, documents.to(hidden.device))


@not_compiled
def _whole_forward(module: nn.Module, forward, *args: Any, **kwargs: Any) -> Any:
    session = active()
    if session is None or session.cp == 1 and session.documents is None:
        return forward(*args, **kwargs)
    names = module._cptune_arg_names
    kwargs = {**dict(zip(names, args)), **kwargs}
    hidden = kwargs.pop(names[0])
    local = hidden.shape[1]
    kwargs = {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}
    if session.cp == 1:  # packed documents in one process: each alone, as on cp ranks
        return by_document(session, forward, hidden, kwargs)
    group, layout, rank = session.group, session.layout, session.cp_rank
    whole = GatherSequence.apply(hidden, 1, group, layout, rank)
    out = by_document(session, forward, whole, gather_inputs(kwargs, local, group, layout, rank))
    return _map_sequence(out, whole.shape[1], lambda t: A.shard(t, 1, layout, rank))


def gather_inputs(kwargs: dict[str, Any], local: int, group, layout, rank: int) -> dict[str, Any]:
    """A layer's other sequence inputs (``local`` tokens long) gathered whole too, the gradients of those that need one
    returned as the hidden states' are (Zamba2's Mamba layer adds the shared transformer's output, which trains
    through it)."""
    return _map_sequence(kwargs, local, lambda t: GatherSequence.apply(t, 1, group, layout, rank)
                         if t.requires_grad else A.gather(t.detach(), 1, group, layout))


def _arg_names(forward) -> list[str]:
    """The names ``forward`` takes positionally, in order (the hidden states first)."""
    return [n for n, p in inspect.signature(forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def run_whole(module: nn.Module) -> None:
    """Make ``module`` (a layer that mixes tokens, called with the hidden states first) take the generic path inside
    a block of cp > 1; idempotent."""
    if getattr(module, "_cptune_whole", False):
        return
    forward = module.forward
    module._cptune_arg_names = _arg_names(forward)
    module._cptune_path = "generic"
    module.forward = functools.partial(_whole_forward, module, forward)
    module._cptune_whole = True
