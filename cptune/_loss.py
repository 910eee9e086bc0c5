"""Next-token losses under CP: labels shifted before sharding, and the loss normalized over ranks.

Shifting labels inside each rank's shard (what a causal-LM loss does by default) pairs tokens
that are not neighbours: a shard ends where the next rank's begins, and under load balancing
a shard is two distant chunks. :func:`shift_labels` shifts over the whole sequence *before*
sharding, so each rank holds the right target for each of its tokens in any layout.

A mean over each rank's own valid tokens, averaged over ranks (what FSDP/DDP and cptune's
buffer gradients do), is the single-device mean only when every rank holds the same number of
valid tokens. :func:`num_items_in_batch` gives the divisor that makes ``sum of this rank's
token losses / divisor`` exact for any spread of ignored tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import CPTuneError, Problem, raise_if

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, seq_dim: int = -1) -> torch.Tensor:
    """Next-token targets for every position: ``out[..., i] = labels[..., i + 1]``, the last ignored.

    Call it on the whole sequence, before ``cptune.context_parallel`` shards it, and pass the
    result as a buffer (and to transformers as ``shift_labels=``). ``labels`` is usually
    ``input_ids``, or a copy with prompt/padding tokens set to ``ignore_index``.
    """
    raise_if([Problem("labels", f"is a {type(labels).__name__}, not an integer tensor",
                      "pass the token ids (or labels) tensor, shape (batch, seq)")]
             if not isinstance(labels, torch.Tensor) or labels.is_floating_point() else [])
    seq_dim = seq_dim % labels.ndim
    tail = labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1)
    pad_shape = list(labels.shape)
    pad_shape[seq_dim] = 1
    return torch.cat([tail, labels.new_full(pad_shape, ignore_index)], dim=seq_dim)


def count_items(labels: torch.Tensor, groups: list[dist.ProcessGroup], ranks: int,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Valid tokens summed over ``groups``, divided by the ``ranks`` that gradients are averaged over."""
    count = (labels != ignore_index).sum().to(torch.float32)
    for group in groups:
        dist.all_reduce(count, group=group)
    if count.item() == 0:
        raise CPTuneError(f"num_items_in_batch: every label is ignore_index ({ignore_index}) on every rank; "
                          "there is no token to take a loss over. Fix: check the labels (or ignore_index)")
    return count / ranks


def packed_labels_and_positions(input_ids: torch.Tensor, documents: torch.Tensor | None = None,
                                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels and position ids of (B, S) token ids, before sharding. With ``documents`` ((B, S)
    or (1, S) ids of packed documents), positions restart at each document and a document's last token
    has no target, so no loss crosses a boundary; without it, one document per row."""
    b, s = input_ids.shape
    labels = shift_labels(input_ids, ignore_index)
    index = torch.arange(s, device=input_ids.device)
    if documents is None:
        return labels, index.expand(b, s).contiguous()
    ids = documents.to(input_ids.device).expand(b, s)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    ends = torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], dim=1)
    return labels.masked_fill(ends, ignore_index), (index - first).contiguous()
