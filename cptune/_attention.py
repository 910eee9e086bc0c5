"""One SDPA call inside a block, run under the block's strategy: which ops, in which order.

* ring (u = 1): PyTorch's ring (:mod:`cptune._ring`) for plain causal / full attention; cptune's
  masked ring (:mod:`cptune._masked_ring`) when documents, a window or a dense mask apply, and for
  float64 (which it merges in float64, PyTorch's ring in float32);
* Ulysses (u = cp): sequence shards become head shards (:mod:`cptune._ulysses`), then the whole
  sequence is attended on each rank's heads: plain SDPA (any mask, dropout, the math kernel), or
  the masked path with R = 1 for documents and windows;
* hybrid: Ulysses inside groups, then either ring over the groups.

The call is first checked and brought to (B, H, S, D) by :mod:`cptune._sdpa_forms`; forms that
need no exchange (a zero-row batch, cross-attention to keys that are not sharded) run on this
rank alone.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _documents, _sdpa_forms, _ulysses
from ._kernels import expand_kv
from ._masked_ring import BLOCK_ATTENTION_OPS, block_attention
from ._ring import PYTORCH_RING_OPS, ring_attention
from .errors import CPTuneWarning, raise_if

if TYPE_CHECKING:
    from ._session import _Session

_aten_sdpa = torch.ops.aten.scaled_dot_product_attention.default  # below torch-function modes: not routed again

RING_ATTENTION_OPS = PYTORCH_RING_OPS + BLOCK_ATTENTION_OPS
"""The ring attention ops (PyTorch's ring, and cptune's for documents / windows / masks), e.g. for a
selective activation-checkpointing policy's save list."""


def attend(s: _Session, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False, *, window: Any = "block", documents: Any = "block") -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's shards, as the block runs it.

    ``window`` / ``documents``: ``"block"`` takes the block's; None or False turns them off for this call.
    """
    window = s.window if window == "block" else _documents.check_window(window or None, "window")
    docs = s.documents if isinstance(documents, str) and documents == "block" else _call_documents(s, documents)
    q, k, v = s._local(query), s._local(key), s._local(value)
    full = s.plan.seq_len
    masked = docs is not None or window is not None
    call, problems = _sdpa_forms.prepare(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa, scale=scale,
        causal=s.causal, local_len=full // s.cp if full and s.cp > 1 else None, full_len=full,
        strategy=s.config.strategy if s.cp > 1 else "ulysses", ulysses=s.ulysses, masked=masked)
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
        if attn_mask is not None and attn_mask.ndim >= 3 and attn_mask.shape[-3] > 1:  # per-head mask
            heads = q.shape[1]
            attn_mask = attn_mask.narrow(-3, (s.cp_rank % s.ulysses) * heads, heads)  # this rank's heads
    if masked or s.ring > 1:
        out = _ring_or_masked(s, q, k, v, attn_mask, is_causal, scale, docs, window, masked)
    else:
        k, v = expand_kv(q, k, v)  # after the all-to-all: the CPU flash kernel has no GQA
        out = _aten_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    if s.ulysses > 1:
        out = _ulysses.heads_to_seq(out, s.ulysses_group, s.ulysses)
    return call.restore(out)


def _ring_or_masked(s: _Session, q, k, v, attn_mask, is_causal, scale, docs, window, masked):
    backend = s.ring_backend(q.device.type, q.dtype)
    if not masked and attn_mask is None and q.dtype != torch.float64:  # PyTorch's ring merges in float32
        return ring_attention(q, k, v, s.ring_group, backend, is_causal, scale, s.config.rotate_method,
                              s.plan.load_balance)
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool and bool(mask.all()):
        mask = None  # nothing masked: the rules alone decide
    ring_rank = s.cp_rank // s.ulysses
    return block_attention(q, k, v, s.positions(), docs, mask, window, s.ring_group if s.ring > 1 else None,
                           ring_rank if s.ring > 1 else 0, backend, is_causal, scale, s.config.rotate_method)


def _to_heads(s: _Session, q, k, v):
    replicas = _ulysses.kv_replication(q.shape[1], k.shape[1], s.ulysses)
    if replicas > 1:
        if not torch.compiler.is_compiling() and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(f"cptune: {k.shape[1]} key/value heads do not divide among {s.ulysses} Ulysses ranks; each "
                          f"is sent {replicas} times (use a Ulysses degree that divides the key/value heads to "
                          "avoid it)", CPTuneWarning, stacklevel=4)
        k, v = k.repeat_interleave(replicas, dim=1), v.repeat_interleave(replicas, dim=1)
    return tuple(_ulysses.seq_to_heads(t, s.ulysses_group, s.ulysses) for t in (q, k, v))


def _call_documents(s: _Session, documents: Any) -> torch.Tensor | None:
    if documents is None or documents is False:
        return None
    problems = _documents.document_problems(documents, s.plan.seq_len, None, "documents")
    raise_if(problems)
    return _documents.as_rows(documents)


__all__ = ["RING_ATTENTION_OPS", "attend"]
