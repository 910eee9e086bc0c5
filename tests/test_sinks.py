"""Attention sinks (GPT-OSS: a learned logit per head in every row's softmax denominator, with a zero value) under
every strategy, exact against transformers' eager formula: the output, the query / key / value gradients and the
sinks' own gradient, with packed documents, sliding windows, load balancing, compile and checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cptune
from cptune.attention import _documents
from tests._helpers import max_err, sharded_call

FP32_TOL = 1e-5
SEQ, DIM = 48, 16


def eager(q, k, v, sinks, mask):
    """transformers' GPT-OSS eager attention (its ``eager_attention_forward``), on a bool mask (True: attended)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, dim=-1)
    return probs[..., :-1] @ v


def _inputs(batch, heads, kv_heads):
    gen = torch.Generator().manual_seed(7)
    qkv = [torch.randn(batch, h, SEQ, DIM, generator=gen) for h in (heads, kv_heads, kv_heads)]
    sinks = torch.randn(heads, generator=gen) * 2
    grad = torch.randn(batch, heads, SEQ, DIM, generator=gen)
    return qkv, sinks, grad


def _reference(qkv, sinks, grad, docs, window, causal):
    mask = _documents.dense_mask(docs, window, causal, SEQ)
    leaves = [t.clone().requires_grad_() for t in (*qkv, sinks)]
    out = eager(*leaves, mask)
    (out * grad).sum().backward()
    return out, [t.grad for t in leaves]


def test_outside_a_block_sinks_equal_the_eager_formula():
    for docs, window, causal in ((None, None, True), (cptune.documents_from_lengths([[20, 28]]), (5, 0), True),
                                 (None, (4, 3), False)):
        qkv, sinks, grad = _inputs(1, 4, 2)
        want, want_grads = _reference(qkv, sinks, grad, docs, window, causal)
        leaves = [t.clone().requires_grad_() for t in (*qkv, sinks)]
        got = cptune.scaled_dot_product_attention(*leaves[:3], is_causal=causal, enable_gqa=True, documents=docs,
                                                  window=window, sinks=leaves[3])
        (got * grad).sum().backward()
        assert max_err(got, want) <= FP32_TOL
        assert max(max_err(a.grad, b) for a, b in zip(leaves, want_grads)) <= FP32_TOL


def test_a_sink_per_head_is_checked_before_anything_runs():
    qkv, sinks, _ = _inputs(1, 4, 2)
    with pytest.raises(cptune.ValidationError, match=r"sinks: is \(3,\), not one logit per query head \(4,\)"):
        cptune.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True, sinks=sinks[:3])
    with pytest.raises(cptune.ValidationError, match="dropout_p: is 0.1 with attention sinks"):
        cptune.scaled_dot_product_attention(*qkv, dropout_p=0.1, is_causal=True, enable_gqa=True, sinks=sinks)


CONFIGS = {
    "ring-allgather": {"rotate_method": "allgather"},
    "ring-alltoall": {"rotate_method": "alltoall"},
    "ulysses": {"strategy": "ulysses"},
    "hybrid": {"strategy": "hybrid", "ulysses_degree": 2, "rotate_method": "alltoall"},
}
LAYOUTS = {"whole": None, "packed": [[30, 18], [5, 40, 3]]}


def _case(config_name, layout, causal, lb, window, compiled=False, ac=False):
    """Output and every gradient (q, k, v and the sinks, summed over the ranks) of one call vs the eager formula."""
    docs = cptune.documents_from_lengths(LAYOUTS[layout]) if LAYOUTS[layout] else None
    batch = docs.shape[0] if docs is not None else 2
    qkv, sinks, grad = _inputs(batch, 4, 2)
    want, want_grads = _reference(qkv, sinks, grad, docs, window, causal)
    leaves = [t.clone().requires_grad_() for t in qkv]
    sink = sinks.clone().requires_grad_()
    config = cptune.CPConfig(load_balance=lb if config_name != "ulysses" else "auto", **CONFIGS[config_name])

    def attend(q, k, v):
        return cptune.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, sinks=sink)

    full, block = sharded_call(attend, leaves, grad, config, causal, docs, window, compiled, ac)
    size = block.cp_size
    dist.all_reduce(sink.grad)  # each rank's query rows' share of a replicated parameter's gradient
    grads = [t.grad for t in leaves] + [sink.grad / size]
    return {"out": max_err(full, want), "grads": [max_err(a, b) for a, b in zip(grads, want_grads)]}


def _sweep(cases):
    return [(case, _case(*case)) for case in cases]


def _assert_exact(per_rank_results):
    for per_rank in zip(*per_rank_results):
        for case, r in per_rank:
            assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, (case, r)


def test_sinks_are_exact_under_ring_and_ulysses_packed_windowed_and_balanced(ranks):
    cases = [(c, lay, causal, lb, window) for c in ("ring-allgather", "ring-alltoall", "ulysses") for lay in LAYOUTS
             for causal, lb in ((True, True), (True, False), (False, False))
             for window in (None, (5, 0) if causal else (4, 3))]
    _assert_exact(ranks(2).run(_sweep, cases))


def test_sinks_are_exact_under_the_hybrid(ranks):
    cases = [("hybrid", lay, True, lb, w) for lay in LAYOUTS for lb in (True, False) for w in (None, (5, 0))]
    _assert_exact(ranks(4).run(_sweep, cases))


def test_sinks_under_compile_and_checkpointing(ranks):
    cases = [(c, "packed", True, True, (5, 0), compiled, ac) for c in ("ring-alltoall", "ulysses")
             for compiled, ac in ((True, False), (False, True))]
    _assert_exact(ranks(2).run(_sweep, cases))


def _dropout_case(strategy):
    qkv, sinks, _ = _inputs(2, 4, 2)
    try:
        with cptune.context_parallel(buffers=list(qkv), seq_dims=[2] * 3, config=cptune.CPConfig(strategy=strategy)):
            cptune.scaled_dot_product_attention(*qkv, dropout_p=0.1, is_causal=True, enable_gqa=True, sinks=sinks)
    except cptune.ValidationError as exc:
        return str(exc)
    return "nothing raised"


def test_dropout_with_sinks_is_refused_inside_a_block(ranks):
    """Ulysses runs plain attention with dropout, but a call with sinks takes cptune's ring, which has none: refused
    by name, never run without its dropout."""
    for strategy in ("ulysses", "ring"):
        for message in ranks(2).run(_dropout_case, strategy):
            assert "dropout_p: dropout_p=0.1 is not supported with attention sinks" in message, message
