"""Every loss cptune takes, in one module: next-token labels shifted before sharding and a loss normalized over
the ranks (under CP), and the loss without the whole logits (the LM head in chunks; vocabulary-parallel under tp).

Shifting labels inside each rank's shard (what a causal-LM loss does by default) pairs tokens
that are not neighbours: a shard ends where the next rank's begins, and under load balancing
a shard is two distant chunks. :func:`shift_labels` shifts over the whole sequence *before*
sharding, so each rank holds the right target for each of its tokens in any layout.

A mean over each rank's own valid tokens, averaged over ranks (what FSDP/DDP and cptune's
buffer gradients do), is the single-device mean only when every rank holds the same number of
valid tokens. :func:`num_items_in_batch` gives the divisor that makes ``sum of this rank's
token losses / divisor`` exact for any spread of ignored tokens.

The loss without the whole logits: a causal LM's next-token loss taken from its final hidden states and its LM head
in chunks of tokens, never holding the (tokens x vocabulary) logits, their float32 copy or their gradient at once.

A transformers causal LM's head is its ``lm_head`` and what its forward does to the logits before the loss; the rule
(:func:`head_of`) reads that forward's own code between the ``lm_head`` call and the loss, and knows four transforms
by the config field they read: ``logits_scaling`` (Granite divides), ``logit_scale`` (Cohere multiplies),
``lm_head_multiplier`` (Falcon-H1 multiplies) and ``final_logit_softcapping`` (Gemma 2 and 3: ``c * tanh(z / c)``).
Any other statement on the logits there is a head cptune cannot chunk exactly: it is named, and that model keeps the
whole-logits loss.

Three paths (:func:`loss_sum`): a head that is a matrix product times a constant goes to torch's chunked
``torch.nn.functional.linear_cross_entropy`` ("torch"); softcapping, a bias, or a torch without it, to cptune's own
chunks, each recomputed in backward (activation checkpointing per chunk: "cptune"). Given a tensor-parallel
``group``, the loss is vocabulary-parallel ("vocab-parallel", :class:`_VocabParallel`): each tp rank takes its
rows of the head (its share of the vocabulary) for every token, in chunks, and the softmax's maximum, normalizer and
target logit are all-reduced over tp (Megatron's and torchtitan's loss_parallel, chunked); a rank holds a chunk of
tokens x vocabulary/tp logits at most. Imports nothing of cptune's.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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

CHUNK_BYTES = 2 ** 27
"""The float32 logits of one chunk, both paths: 128 MiB, 512 tokens of a 65,536-word vocabulary (at least
MIN_CHUNK tokens). torch's own choice on a CPU (its "auto", aspect-ratio chunks) took 1.35x the whole logits' time
at 8192 tokens x hidden 512 x vocabulary 65,536; chunks of 512 tokens took 0.85x (``benchmarks.loss``)."""
MIN_CHUNK = 128
_KNOWN = {"final_logit_softcapping": "softcap", "logits_scaling": "divide", "logit_scale": "multiply",
          "lm_head_multiplier": "multiply"}


@dataclass(frozen=True)
class Head:
    """A head cptune can chunk: logits = scale * (hidden @ weight.T + bias), then ``softcap * tanh(z / softcap)``."""

    scale: float = 1.0
    softcap: float | None = None


def _statements(model: torch.nn.Module) -> list[str] | None:
    """The lines of the model's forward from its ``lm_head`` call to its loss (None: no such call found)."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if "self.lm_head(" in line), None)
    if start is None:
        return None
    out = []
    for line in lines[start:]:
        if re.search(r"\bloss\b", line) and line is not lines[start]:
            break
        out.append(line.strip())
    return out


def head_of(model: torch.nn.Module) -> Head | str:
    """``model``'s head as cptune chunks it, or why it cannot (a sentence)."""
    statements = _statements(model)
    if statements is None:
        return f"{type(model).__name__}'s forward has no lm_head call cptune can read"
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    scale, softcap = 1.0, None
    for line in statements:
        if not re.search(r"\blogits\b", line) or line.startswith(("#", "if ")):
            continue
        known = [field for field in _KNOWN if field in line]
        code = line.split("#")[0].strip()
        if not known and code in ("logits = torch.tanh(logits)", "logits = logits.float()"):  # softcap's middle; upcast
            continue
        if not known and "self.lm_head(" in line and re.fullmatch(r"logits = self\.lm_head\([^()]*\)", code):
            continue
        if not known:
            return f"{type(model).__name__}'s forward does {line!r} to the logits, which cptune's chunked loss does " \
                   "not know"
        for field in known:
            value = getattr(config, field, None)
            if value is None:
                continue
            if _KNOWN[field] == "softcap":
                softcap = float(value)
            elif _KNOWN[field] == "divide":
                scale /= float(value)
            else:
                scale *= float(value)
    return Head(scale=scale, softcap=softcap)


def _chunk_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
               scale: float, softcap: float | None, ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunk_tokens_for(vocab: int) -> int:
    """Tokens a chunk: CHUNK_BYTES of float32 logits, at least MIN_CHUNK."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * vocab))


def loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, head: Head = Head(),
             bias: torch.Tensor | None = None, ignore_index: int = -100, chunk_tokens: int | None = None,
             path: str | None = None, group=None) -> tuple[torch.Tensor, str]:
    """(the sum of the next-token losses of ``hidden`` (..., H) against ``labels`` (...), pre-shifted; the path that
    ran: "torch" or "cptune"), in float32, never the whole logits. ``chunk_tokens``: default
    :func:`chunk_tokens_for` the vocabulary. ``path``: "cptune" takes cptune's own chunks where torch's would apply
    (the benchmark compares them). ``group``: a tensor-parallel process group over whose ranks ``hidden``,
    ``weight`` and ``labels`` are the same; with more than one rank the loss is vocabulary-parallel, each rank's
    logits its rows' (same tokens a chunk, 1/tp of the vocabulary), the loss and every gradient the same on each."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk_tokens = chunk_tokens or chunk_tokens_for(weight.shape[0])
    if group is not None and torch.distributed.get_world_size(group) > 1:
        total = _VocabParallel.apply(hidden, weight, bias, labels, head, ignore_index, chunk_tokens, group)
        return total, "vocab-parallel"
    torch_path = head.softcap is None and bias is None and hasattr(F, "linear_cross_entropy")
    if torch_path and path != "cptune":
        options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=chunk_tokens)
        total = F.linear_cross_entropy(hidden.float() * head.scale, weight.float(), labels, reduction="sum",
                                       ignore_index=ignore_index, options=options)
        return total, "torch"
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_sum, hidden[piece], weight, bias, labels[piece], head.scale, head.softcap,
                                   ignore_index, use_reentrant=False)
    return total, "cptune"


def head_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, ignore_index: int = -100
              ) -> torch.Tensor:
    """The summed next-token loss of ``hidden`` (..., H) through the linear LM ``head`` against ``labels`` (...),
    pre-shifted (:func:`cptune.shift_labels`), in float32 and in chunks: the (tokens x vocabulary) logits are never
    whole. Where :func:`cptune.parallelize` split the model over tp (a model whose ``get_output_embeddings()``
    returns ``head``) it is vocabulary-parallel over the tp ranks. For a model's own forward: it knows nothing of
    distribution and runs under python alone."""
    return loss_sum(hidden, head.weight, labels, bias=head.bias, ignore_index=ignore_index,
                    group=getattr(head, "_cptune_tp_group", None))[0]


def _rows(vocab: int, group) -> slice:
    """This tp rank's rows of a head of ``vocab`` rows (as even as they go)."""
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return slice(rank * vocab // size, (rank + 1) * vocab // size)


def _share(weight, bias, labels, ignore_index, group):
    """(this rank's rows, its head rows, bias rows, each label's row among them (0 where not), which are)."""
    rows = _rows(weight.shape[0], group)
    w, b = weight[rows], None if bias is None else bias[rows]
    local = labels - rows.start
    mine = (local >= 0) & (local < w.shape[0]) & (labels != ignore_index)
    return rows, w, b, torch.where(mine, local, 0), mine


def _capped(raw: torch.Tensor, head: Head) -> torch.Tensor:
    return raw if head.softcap is None else torch.tanh(raw / head.softcap) * head.softcap


class _VocabParallel(torch.autograd.Function):
    """The summed next-token loss with the head's rows split over a tp group, in chunks of tokens; it keeps each
    token's log-normalizer (one float) for backward and recomputes a chunk's logits there."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head, ignore_index, chunk_tokens, group):
        dist = torch.distributed
        rows, w, b, local, mine = _share(weight, bias, labels, ignore_index, group)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_tokens):
            piece = slice(start, start + chunk_tokens)
            z = _capped(F.linear(hidden[piece], w, b).float() * head.scale, head)
            top = z.max(-1).values
            dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            target = z.gather(1, local[piece, None]).squeeze(1) * mine[piece]
            sums = torch.stack([torch.exp(z - top[:, None]).sum(-1), target])
            dist.all_reduce(sums, group=group)
            lse[piece] = top + sums[0].log()
            total = total + ((lse[piece] - sums[1]) * (labels[piece] != ignore_index)).sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.args = (head, ignore_index, chunk_tokens, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        dist = torch.distributed
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        head, ignore_index, chunk_tokens, group = ctx.args
        rows, w, b, local, mine = _share(weight, bias, labels, ignore_index, group)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grad_b = None if b is None else torch.zeros(b.shape, dtype=torch.float32, device=b.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            piece = slice(start, start + chunk_tokens)
            raw = F.linear(hidden[piece], w, b).float() * head.scale
            dz = torch.exp(_capped(raw, head) - lse[piece, None])
            dz[torch.arange(dz.shape[0], device=dz.device)[mine[piece]], local[piece][mine[piece]]] -= 1
            dz = dz * ((labels[piece] != ignore_index) * grad)[:, None]
            if head.softcap is not None:
                dz = dz * (1 - torch.tanh(raw / head.softcap) ** 2)
            dz = (dz * head.scale).to(hidden.dtype)
            grad_hidden[piece] = (dz @ w).float()
            grad_w += dz.t().float() @ hidden[piece].float()
            if grad_b is not None:
                grad_b += dz.float().sum(0)
        dist.all_reduce(grad_hidden, group=group)  # each rank's rows' part: summed, the same on every tp rank
        full_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        full_w[rows] = grad_w
        dist.all_reduce(full_w, group=group)  # the head is whole on each tp rank: its gradient too
        full_b = None
        if grad_b is not None:
            full_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            full_b[rows] = grad_b
            dist.all_reduce(full_b, group=group)
            full_b = full_b.to(bias.dtype)
        return grad_hidden.to(hidden.dtype), full_w.to(weight.dtype), full_b, None, None, None, None, None
