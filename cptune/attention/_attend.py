"""One SDPA call inside a block, run under the block's strategy: which ops, in which order.

* ring (u = 1): PyTorch's ring (:mod:`._ring`) for plain causal / full attention; cptune's
  masked ring (:mod:`._masked_ring`) when documents, a window or a dense mask apply, and for
  float64 (which it merges in float64, PyTorch's ring in float32);
* Ulysses (u = cp): sequence shards become head shards (:mod:`._ulysses`), then the whole
  sequence is attended on each rank's heads: plain SDPA (any mask, dropout, the math kernel), or
  the masked path with R = 1 for documents and windows;
* hybrid: Ulysses inside groups, then either ring over the groups.

The call is first checked and brought to (B, H, S, D) by :mod:`._forms`; forms that
need no exchange (a zero-row batch, cross-attention to keys that are not sharded) run on this
rank alone.

Everything a call needs comes in one :class:`Setup`, which the block resolves once when it opens:
nothing here reads or calls the block.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import _documents, _forms, _ulysses
from ._kernels import default_backends, expand_kv, pick_backend
from ._masked_ring import BLOCK_ATTENTION_OPS, block_attention
from ._ring import PYTORCH_RING_OPS, ring_attention
from ._sharding import Layout, ShardWithGrad
from ..errors import CPTuneWarning, Problem, raise_if

_aten_sdpa = torch.ops.aten.scaled_dot_product_attention.default  # below torch-function modes: not routed again

RING_ATTENTION_OPS = PYTORCH_RING_OPS + BLOCK_ATTENTION_OPS
"""The ring attention ops (PyTorch's ring, and cptune's for documents / windows / masks), e.g. for a
selective activation-checkpointing policy's save list."""


@dataclass(frozen=True)
class Setup:
    """What one block's attention needs, resolved when the block opens (a plain value; the block replaces it
    when a transformers model's packed inputs bring documents)."""

    layout: Layout
    backends: tuple[str, ...]
    causal: bool = True
    strategy: str = "ring"
    rotate_method: str = "allgather"
    load_balance: bool = False
    seq_len: int | None = None
    cp_rank: int = 0
    group: dist.ProcessGroup | None = None  # the CP ranks
    ulysses_group: dist.ProcessGroup | None = None  # ranks that trade heads (Ulysses / hybrid)
    ring_group: dist.ProcessGroup | None = None  # ranks that pass key/value blocks round (ring / hybrid)
    documents: torch.Tensor | None = None
    window: _documents.Window | None = None
    positions: torch.Tensor | None = None  # (ring, S / ring): the global positions each ring rank holds
    grad_buffers: Mapping[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # id -> (buffer, seq dim)

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def ring(self) -> int:
        return self.layout.ring

    @property
    def ulysses(self) -> int:
        return self.layout.cp // self.layout.ring

    def local(self, t: Any) -> Any:
        """This rank's shard of ``t`` if it is a buffer that requires grad (sharded where it is used), else ``t``."""
        entry = self.grad_buffers.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None or entry[0] is not t:
            return t
        return ShardWithGrad.apply(t, entry[1], self.group, self.layout, self.cp_rank)


def ring_positions(layout: Layout, seq_len: int | None) -> torch.Tensor | None:
    """(ring degree, S / ring degree): the global positions each ring rank's block holds (None: no sequence)."""
    if seq_len is None:
        return None
    return torch.stack([layout.ring_positions(seq_len, r) for r in range(layout.ring)])


def attend(s: Setup, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False, *, window: Any = "block", documents: Any = "block", chunk: int | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's shards, as the block runs it.

    ``window`` / ``documents``: ``"block"`` takes the block's; None or False turns them off for this call.
    ``chunk``: each document cut into chunks of this many tokens, attended within each chunk (Llama 4's chunked
    layers). ``sinks``: (query heads,) a learned logit per head joining each row's softmax denominator with a
    zero value (GPT-OSS); such calls run on cptune's own ring (one log-sum-exp term more), under any strategy.
    """
    window = s.window if window == "block" else _documents.check_window(window or None, "window")
    docs = s.documents if isinstance(documents, str) and documents == "block" else _call_documents(s, documents)
    full = s.seq_len
    if chunk is not None and full is not None and chunk < full:
        docs = _documents.chunked(docs, full, chunk)
    q, k, v = s.local(query), s.local(key), s.local(value)
    masked = docs is not None or window is not None
    call, problems = _forms.prepare(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa, scale=scale,
        causal=s.causal, local_len=full // s.cp if full and s.cp > 1 else None, full_len=full,
        strategy=s.strategy if s.cp > 1 else "ulysses", ulysses=s.ulysses, masked=masked, sinks=sinks)
    if docs is not None and call is not None:
        problems += _documents.document_problems(docs, full, call.q.shape[0], "documents")
    raise_if(problems)
    q, k, v, scale = call.q, call.k, call.v, call.scale
    if call.local:  # nothing to exchange: a zero-row batch, or keys that are not sharded
        if attn_mask is not None and attn_mask.shape[-2] != q.shape[-2]:  # this rank's rows of the whole mask
            attn_mask = attn_mask.index_select(-2, s.layout.indices(attn_mask.shape[-2], s.cp_rank, attn_mask.device))
        k, v = expand_kv(q, k, v)
        return call.restore(_aten_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale))
    if s.ulysses > 1:
        q, k, v = _to_heads(s, q, k, v)
        heads = q.shape[1]
        if attn_mask is not None and attn_mask.ndim >= 3 and attn_mask.shape[-3] > 1:  # per-head mask
            attn_mask = attn_mask.narrow(-3, (s.cp_rank % s.ulysses) * heads, heads)  # this rank's heads
        if sinks is not None:
            sinks = sinks.narrow(0, (s.cp_rank % s.ulysses) * heads, heads)
    if masked or s.ring > 1 or sinks is not None:
        out = _ring_or_masked(s, q, k, v, attn_mask, is_causal, scale, docs, window, masked, sinks)
    else:
        k, v = expand_kv(q, k, v)  # after the all-to-all: the CPU flash kernel has no GQA
        out = _aten_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    if s.ulysses > 1:
        out = _ulysses.heads_to_seq(out, s.ulysses_group, s.ulysses)
    return call.restore(out)


def _ring_or_masked(s: Setup, q, k, v, attn_mask, is_causal, scale, docs, window, masked, sinks=None):
    # No cache: a side effect here would break torch.compile inside checkpointed regions.
    backend, problems = pick_backend(s.backends, q.device.type, q.dtype, ring=True)
    raise_if(problems)
    # PyTorch's ring merges in float32 and knows two layouts only: in order, or head-tail under load balancing
    if not masked and attn_mask is None and q.dtype != torch.float64 and s.layout.chunks is None and sinks is None:
        return ring_attention(q, k, v, s.ring_group, backend, is_causal, scale, s.rotate_method, s.load_balance)
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool and bool(mask.all()):
        mask = None  # nothing masked: the rules alone decide
    ring_rank = s.cp_rank // s.ulysses
    return block_attention(q, k, v, s.positions, docs, mask, window, s.ring_group if s.ring > 1 else None,
                           ring_rank if s.ring > 1 else 0, backend, is_causal, scale, s.rotate_method, sinks)


def _to_heads(s: Setup, q, k, v):
    replicas = _ulysses.kv_replication(q.shape[1], k.shape[1], s.ulysses)
    if replicas > 1:
        if not torch.compiler.is_compiling() and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(f"cptune: {k.shape[1]} key/value heads do not divide among {s.ulysses} Ulysses ranks; each "
                          f"is sent {replicas} times (use a Ulysses degree that divides the key/value heads to "
                          "avoid it)", CPTuneWarning, stacklevel=4)
        k, v = k.repeat_interleave(replicas, dim=1), v.repeat_interleave(replicas, dim=1)
    return tuple(_ulysses.seq_to_heads(t, s.ulysses_group, s.ulysses) for t in (q, k, v))


def alone(query, key, value, sinks, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
          documents: torch.Tensor | None = None, window: _documents.Window | None = None) -> torch.Tensor:
    """Attention with ``sinks`` on one device, outside a block: cptune's own ring with no ring (one log-sum-exp term
    more), documents (rows of ids), a window and a bool ``attn_mask`` applied."""
    problems = []
    if dropout_p:
        problems.append(Problem("dropout_p", f"is {dropout_p} with attention sinks", "set dropout_p=0.0"))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        problems.append(Problem("attn_mask", f"is {attn_mask.dtype} with attention sinks",
                                "pass a bool mask (True: attended)"))
    problems += _forms.sink_problems(sinks, query.shape[-3])
    backend, found = pick_backend(default_backends(), query.device.type, query.dtype, ring=True)
    raise_if(problems + found)
    positions = torch.arange(query.shape[-2]).unsqueeze(0)
    docs = _documents.as_rows(documents) if documents is not None else None
    return block_attention(query, key, value, positions, docs, attn_mask, window, None, 0, backend, is_causal, scale,
                           "allgather", sinks)


def _call_documents(s: Setup, documents: Any) -> torch.Tensor | None:
    if documents is None or documents is False:
        return None
    problems = _documents.document_problems(documents, s.seq_len, None, "documents")
    raise_if(problems)
    return _documents.as_rows(documents)


__all__ = ["RING_ATTENTION_OPS", "Setup", "alone", "attend", "ring_positions"]
