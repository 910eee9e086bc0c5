"""Every form of ``F.scaled_dot_product_attention`` call a block accepts, checked and brought to one shape.

Plain SDPA takes more than (B, H, S, D) tensors of one shape; inside a block each form is either
run exactly or refused before any collective, with the argument and the fix (``tests/test_forms.py``
walks the table):

* 2-D (S, D), 3-D (B, S, D) and 5-D or more (..., H, S, D) inputs: leading dims are broadcast and
  flattened into the batch (3-D and 2-D inputs have one head);
* leading batch dims that broadcast (q with batch 1, k/v with batch 2): expanded;
* heads broadcast as plain SDPA broadcasts them: one query head against several key/value heads
  (the query is expanded), one key or value head against several (grouped-query attention), or
  ``enable_gqa`` with key heads dividing the query heads;
* a value head dim other than the query's: q, k and v are padded with zeros to the larger one and
  the output cut back (``scale`` made explicit, so the scores do not change);
* a batch of zero rows: nothing to exchange, computed on this rank;
* keys and values not sharded (cross-attention to a replicated context, non-causal): each rank's
  queries attend to all of them on this rank alone, no collective;
* any dtype the kernels take, non-contiguous views, ``scale``.

Refused: dtypes that differ, key/value head dims or lengths that differ from each other, key heads
that do not divide query heads, causal cross-attention, and what a strategy cannot do (a dense mask
of the wrong shape, dropout outside Ulysses' plain path).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import Problem


@dataclass
class Prepared:
    """A call in (B, H, S, D) form: run it, then :meth:`restore` the output to the caller's shape."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    local: bool  # run on this rank alone: no keys to exchange
    lead: tuple[int, ...]  # the output's dims before (S, D): the caller's, broadcast
    value_dim: int

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        out = out[..., :self.value_dim] if out.shape[-1] != self.value_dim else out
        return out.reshape(*self.lead, out.shape[-2], self.value_dim)


@functools.lru_cache(maxsize=None)
def mask_with_causal() -> bool:
    """Whether this torch's SDPA takes ``attn_mask`` together with ``is_causal=True`` (2.13 combines them;
    2.15 refuses): a block does what plain SDPA does."""
    x = torch.zeros(1, 1, 2, 1)
    try:
        torch.ops.aten.scaled_dot_product_attention.default(x, x, x, torch.ones(2, 2, dtype=torch.bool), 0.0, True)
    except RuntimeError:
        return False
    return True


def from_transformers() -> bool:
    """Whether transformers' own SDPA attention made this call (a model cptune.hf.enable has not prepared)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("transformers.integrations.sdpa_attention"):
            return True
        frame = frame.f_back
    return False


def _hf_problem() -> Problem:
    return Problem("model", "is a transformers model whose attention was not prepared for context parallelism "
                   "(its SDPA attention builds masks for this rank's shard only)",
                   "call cptune.hf.enable(model) once after loading the model")


def _heads(t: torch.Tensor) -> int:
    return t.shape[-3] if t.ndim >= 4 else 1  # (B, S, D) and (S, D): one head


def sink_problems(sinks: Any, heads: int) -> list[Problem]:
    """Attention sinks that are not one logit a query head."""
    if isinstance(sinks, torch.Tensor) and sinks.shape == (heads,):
        return []
    shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
    return [Problem("sinks", f"is {shape}, not one logit per query head ({heads},)",
                    "pass the attention layer's sinks, shaped (num_attention_heads,)")]


def prepare(query: Any, key: Any, value: Any, *, attn_mask: Any, dropout_p: float, is_causal: bool,
            enable_gqa: bool, scale: float | None, causal: bool, local_len: int | None, full_len: int | None,
            strategy: str, ulysses: int, masked: bool, sinks: Any = None) -> tuple[Prepared | None, list[Problem]]:
    """Check one SDPA call inside a block and bring it to (B, H, S, D): (the call, []) or (None, problems).

    ``masked``: documents or a window apply to this call; ``ulysses``: the Ulysses degree; ``sinks``: attention
    sinks (one logit a query head), which run on cptune's own ring as documents and windows do.
    """
    problems: list[Problem] = []
    if not torch.compiler.is_compiling() and from_transformers():  # every rank comes here: all refuse, none hangs
        problems.append(_hf_problem())
    if is_causal != causal:
        problems.append(Problem("is_causal", f"SDPA was called with is_causal={is_causal} but the CP block was "
                                f"declared causal={causal}",
                                f"pass causal={is_causal} to cptune.context_parallel (or fix the SDPA call)"))
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return None, problems + [Problem(name, f"is a {type(t).__name__}", "pass tensors to SDPA")]
        if not t.is_floating_point():
            problems.append(Problem(name, f"has dtype {t.dtype}", "pass floating-point query, key and value"))
        if t.ndim < 2:
            problems.append(Problem(name, f"has shape {tuple(t.shape)}", "pass (..., seq, head_dim) tensors, "
                                    "e.g. (batch, heads, seq, head_dim)"))
    if problems:
        return None, problems
    q, k, v = query, key, value
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        problems.append(Problem("query/key/value", f"have different dtypes ({q.dtype}, {k.dtype}, {v.dtype})",
                                "cast them to one dtype"))
    if len({q.ndim, k.ndim, v.ndim}) > 1:
        problems.append(Problem("query/key/value", f"have {q.ndim}, {k.ndim} and {v.ndim} dims",
                                "give them the same number of dims, e.g. (batch, heads, seq, head_dim) each"))
        return None, problems
    if k.shape[-2] != v.shape[-2]:
        problems.append(Problem("value", f"has {v.shape[-2]} tokens and key {k.shape[-2]}",
                                "give key and value the same sequence length"))
    if q.shape[-1] != k.shape[-1]:
        problems.append(Problem("key", f"has head dim {k.shape[-1]} and query {q.shape[-1]}",
                                "give query and key the same head dim (value's may differ)"))
    hq, hk, hv = _heads(q), _heads(k), _heads(v)
    if hk != hv and 1 not in (hk, hv) and not (enable_gqa and hq % hk == 0 and hq % hv == 0):
        problems.append(Problem("value", f"has {hv} heads and key {hk}", "give key and value the same heads"))
    hkv = max(hk, hv)
    if not (hq == hkv or hkv == 1 or hq == 1 or (enable_gqa and hq % hk == 0 and hq % hv == 0)):
        problems.append(Problem("key", f"has {hk} heads and query {hq}",
                                "pass enable_gqa=True (query heads a multiple of key heads) or repeat key/value heads"))
    try:
        lead = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])) if q.ndim > 3 else \
            tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except RuntimeError:
        lead = ()
        problems.append(Problem("query/key/value", f"have batch dims that do not broadcast ({tuple(q.shape[:-2])}, "
                                f"{tuple(k.shape[:-2])}, {tuple(v.shape[:-2])})",
                                "give them equal batch dims, or 1 where one is shared"))
    s_q, s_k = q.shape[-2], k.shape[-2]
    if local_len is not None:
        if s_q == full_len and s_q != local_len:
            problems.append(Problem("query", f"has the full sequence length {s_q}, not this rank's shard ({local_len})",
                                    "compute q/k/v inside the block from the sharded buffers, or list them in buffers"))
        elif s_q != local_len:
            seq = q.ndim - 2
            on = [d for d in range(q.ndim - 1) if d != seq and q.shape[d] == local_len]
            hint = (f"the sequence looks like dim {on[0]}; transpose it to dim {seq} ((B, H, S, D) layout)"
                    if on else f"make dim {seq} the sequence dim with this rank's {local_len} tokens")
            problems.append(Problem("query", f"shape {tuple(q.shape)} has {s_q} on dim {seq}, expected this rank's "
                                    f"{local_len} sequence tokens", hint))
    cross = s_k != s_q
    if cross and (causal or is_causal):
        problems.append(Problem("key", f"causal attention needs equal query/key lengths ({s_q} vs {s_k})",
                                "use causal=False for cross-attention"))
    if cross and masked:
        problems.append(Problem("documents", "apply to self-attention; this call attends to "
                                f"{s_k} keys from another sequence (cross-attention)",
                                "call cross-attention without documents/window (cptune.scaled_dot_product_attention"
                                "(..., documents=False))"))
    zero = any(n == 0 for n in lead)
    local = cross or zero
    heads = max(hq, hkv)
    if not local and ulysses > 1 and heads % ulysses:
        problems.append(Problem("query", f"has {heads} heads, not divisible by the Ulysses degree {ulysses}",
                                f"use strategy='ring', or strategy='hybrid' with a ulysses_degree that divides "
                                f"{heads}"))
    ringed = masked or sinks is not None  # on cptune's own ring
    plain = strategy == "ulysses" and not ringed  # Ulysses' whole-sequence SDPA: masks and dropout as on one device
    if dropout_p and not (plain or local):
        what = "with documents or a window" if masked else "with attention sinks" if ringed else \
            f"by {strategy} attention"
        problems.append(Problem("dropout_p", f"dropout_p={dropout_p} is not supported {what}",
                                "use dropout_p=0.0 inside the CP block (e.g. attention dropout 0 or model.eval())"
                                + ("" if ringed else ", or strategy='ulysses'")))
    if sinks is not None:
        problems += sink_problems(sinks, hq)
        if cross and not zero:
            problems.append(Problem("sinks", "are given for attention to keys that are not split over the CP ranks",
                                    "cptune applies attention sinks to self-attention only"))
    if attn_mask is not None and is_causal and not mask_with_causal():
        problems.append(Problem("attn_mask", "is given with is_causal=True, which this torch's SDPA refuses too",
                                "fold causality into attn_mask and pass is_causal=False, or drop attn_mask"))
    if attn_mask is not None:
        rows = full_len or s_q * ulysses  # the whole sequence's queries
        problems += _mask_problems(attn_mask, q, heads, lead, rows, s_k if local else rows)
    if problems:
        return None, problems
    return _normalize(q, k, v, lead, hq, hk, hv, scale, local), []


def _heads_to(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t`` with its heads repeated to ``heads`` (one head broadcast, or grouped heads spread out)."""
    have = t.shape[-3]
    if have == heads:
        return t
    if have == 1:
        return t.expand(*t.shape[:-3], heads, *t.shape[-2:])
    return t.repeat_interleave(heads // have, dim=-3)


def _normalize(q, k, v, lead, hq, hk, hv, scale, local) -> Prepared:
    value_dim, heads_dim = v.shape[-1], q.ndim > 3
    if not heads_dim:  # one head
        q, k, v = (t.unsqueeze(-3) for t in (q, k, v))
    if hk != hv:  # one of them broadcast, or both grouped differently: both to the larger count
        k, v = _heads_to(k, max(hk, hv)), _heads_to(v, max(hk, hv))
    hkv = max(hk, hv)
    if hq == 1 and hkv > 1:
        q = q.expand(*q.shape[:-3], hkv, *q.shape[-2:])
    batch = math.prod(lead) if lead else 1
    q, k, v = (t.expand(*lead, *t.shape[-3:]).reshape(batch, *t.shape[-3:]) for t in (q, k, v))
    if value_dim != q.shape[-1]:  # pad to one head dim: zero columns change neither the scores nor the rest
        width = max(value_dim, q.shape[-1])
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    prefix = (*lead, q.shape[1]) if heads_dim else lead
    return Prepared(q, k, v, scale, local, prefix, value_dim)


def _mask_problems(mask: Any, query: torch.Tensor, heads: int, lead: tuple[int, ...], rows: int,
                   key_len: int) -> list[Problem]:
    """A mask covers the whole sequence's queries: (..., rows, key_len), broadcastable to the scores."""
    if not isinstance(mask, torch.Tensor):
        return [Problem("attn_mask", f"is a {type(mask).__name__}", "pass a boolean or float tensor")]
    if mask.dtype != torch.bool and mask.dtype != query.dtype:
        return [Problem("attn_mask", f"has dtype {mask.dtype}", f"pass a boolean mask or an additive {query.dtype} one")]
    b = math.prod(lead) if lead else 1
    ok = 2 <= mask.ndim <= 4 and tuple(mask.shape[-2:]) == (rows, key_len) and \
        (mask.ndim < 3 or mask.shape[-3] in (1, heads)) and (mask.ndim < 4 or mask.shape[0] == 1 or
                                                            (len(lead) == 1 and mask.shape[0] == b))
    if ok:
        return []
    return [Problem("attn_mask", f"has shape {tuple(mask.shape)}; under context parallelism it is the mask for "
                    "the whole, unsharded sequence", f"pass a mask of shape ({rows}, {key_len}) or (B or 1, H or 1, {rows}, {key_len}), "
                    "built for the full sequence; for packed documents or a sliding window pass documents= / "
                    "window= to cptune.context_parallel instead, which cost O(S), not O(S²)")]
