"""Packed documents and sliding windows: exact against single-device SDPA with the equivalent dense mask,
under every strategy, rotate method and load balancing, on real gloo ranks; and the planner in isolation."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cptune
from cptune.attention import _blocks, _documents
from cptune.attention._sharding import Layout
from tests._helpers import max_err, sharded_call

FP32_TOL = 1e-5

# -- no process group ------------------------------------------------------------------------


def _coverage(tasks, lq, lk):
    cov = torch.zeros(lq, lk, dtype=torch.int32)
    for t in tasks:
        m = torch.ones(t.q1 - t.q0, t.k1 - t.k0, dtype=torch.bool)
        if t.causal:
            m = m.tril()
        if t.mask is not None:
            mask = t.mask if t.mask.dtype == torch.bool else ~torch.isneginf(t.mask)
            m = m & mask.reshape(-1, *mask.shape[-2:]).any(0)
        cov[t.q0:t.q1, t.k0:t.k1] += m.int()
    return cov


def test_the_planner_covers_every_attended_pair_exactly_once():
    rng = random.Random(0)
    for trial in range(200):
        ring = rng.choice([1, 2, 3, 4])
        seq_len = 4 * ring * rng.choice([2, 4, 6, 16])
        lengths, left = [], seq_len
        while left:
            lengths.append(min(left, rng.choice([1, 2, 5, 13, 40, 100])))
            left -= lengths[-1]
        docs = _documents.documents_from_lengths(lengths)[0] if rng.random() < 0.8 else None
        causal = rng.random() < 0.6
        window = (rng.randint(0, 20), 0 if causal else rng.randint(0, 20)) if rng.random() < 0.5 else None
        dense = torch.rand(seq_len, seq_len, generator=torch.Generator().manual_seed(trial)) < 0.7 \
            if rng.random() < 0.2 else None
        layout = Layout(ring, ring, rng.random() < 0.5)
        for qr, kr in itertools.product(range(ring), repeat=2):
            qp, kp = layout.ring_positions(seq_len, qr), layout.ring_positions(seq_len, kr)
            tasks = _blocks.plan(qp, kp, docs, causal, window, dense, split=(4, 64) if trial % 2 else None)
            want = _documents.visible(qp, kp, None if docs is None else docs[qp], None if docs is None else docs[kp],
                                      causal, window)
            if dense is not None:
                want &= dense[qp][:, kp]
            assert torch.equal(_coverage(tasks, len(qp), len(kp)), want.int()), (trial, lengths, causal, window)
            assert all(t.mask is None or t.mask.shape[-1] * t.mask.shape[-2] <= _blocks.MAX_TILE ** 2 for t in tasks)


def _random_layout(rng, ring, seq_len, work):
    """In order, head-tail, dealt by work, or a random dealing of a finer grid."""
    kind = rng.randrange(4)
    if kind == 3:
        grid = 4 * ring
        order = list(range(grid))
        rng.shuffle(order)
        return Layout(ring, ring, True, tuple(tuple(sorted(order[r::ring])) for r in range(ring)))
    if kind == 2:
        found = _documents.work_chunks(work, ring)
        return Layout(ring, ring, True, found[0] if found else None)
    return Layout(ring, ring, kind == 1)


def test_a_block_travels_exactly_where_some_query_attends_it():
    """The send rule: ring rank s's block goes to rank d exactly when d's queries attend some key in it,
    in some batch row, under every layout the block can deal."""
    rng = random.Random(1)
    for trial in range(150):
        ring = rng.choice([2, 3, 4])
        seq_len = 4 * ring * rng.choice([2, 4, 8])
        rows = []
        for _ in range(rng.choice([1, 2])):
            lengths, left = [], seq_len
            while left:
                lengths.append(min(left, rng.choice([1, 3, 7, 16, 50])))
                left -= lengths[-1]
            rows.append(_documents.documents_from_lengths(lengths)[0])
        docs = torch.stack(rows) if rng.random() < 0.8 else None
        causal = rng.random() < 0.6
        window = (rng.randint(0, 12), 0 if causal else rng.randint(0, 12)) if rng.random() < 0.6 else None
        layout = _random_layout(rng, ring, seq_len, _documents.token_work(docs, seq_len, causal, window))
        positions = torch.stack([layout.ring_positions(seq_len, r) for r in range(ring)])
        need = _blocks.needs(positions, docs, len(rows), causal, window)
        for d, src in itertools.product(range(ring), repeat=2):
            qp, kp = positions[d], positions[src]
            want = any(bool(_documents.visible(qp, kp, None if docs is None else ids[qp],
                                               None if docs is None else ids[kp], causal, window).any())
                       for ids in (docs if docs is not None else [None]))
            assert need[d][src] == (want or d == src), (trial, layout, causal, window, d, src)


def test_blocks_with_nothing_attended_call_no_kernel():
    docs = _documents.documents_from_lengths([8, 8, 8, 8])[0]  # 4 documents, 2 per rank in order
    layout = Layout(2, 2, False)
    first, second = layout.ring_positions(32, 0), layout.ring_positions(32, 1)
    assert _blocks.plan(first, second, docs, True, None) == []  # rank 0's queries never see rank 1's keys
    assert _blocks.plan(second, first, docs, True, None) == []  # nor rank 1's rank 0's: other documents
    diagonal = _blocks.plan(first, first, docs, True, None)
    assert [(t.q0, t.q1, t.k0, t.k1, t.causal, t.mask) for t in diagonal] == [(0, 8, 0, 8, True, None),
                                                                              (8, 16, 8, 16, True, None)]


def test_grouped_query_heads_keep_float64_exact_on_short_documents():
    """The masked ring on one rank in float64, with grouped-query heads, batch rows with their own documents, a
    window and non-causal attention: single-device attention's output and gradients to 1e-12 (the key/value
    gradients were summed back onto their heads in float32: off by 1e-7)."""
    from cptune.attention import _masked_ring

    cases = [([[64] * 32], True, None), ([[256] * 4, [100, 300, 624]], True, None), ([[128] * 8], True, (100, 0)),
             ([[128] * 8], False, None)]
    for lengths, causal, window in cases:
        docs = torch.cat([cptune.documents_from_lengths(row) for row in lengths])
        batch, seq_len = docs.shape
        gen = torch.Generator().manual_seed(3)
        qkv = [torch.randn(batch, h, seq_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2)]
        out = _masked_ring.block_attention(*qkv, torch.arange(seq_len).unsqueeze(0), docs, None, window, None, 0,
                                           "flash", causal, None, "alltoall")
        grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(out, qkv, grad)
        q, k, v = qkv
        mask = _documents.dense_mask(docs, window, causal, seq_len)
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             attn_mask=mask.unsqueeze(1) if mask.ndim == 3 else mask)
        want = torch.autograd.grad(ref, qkv, grad)
        assert max((a - b).abs().max().item() for a, b in zip((out, *got), (ref, *want))) < 1e-12, lengths


def test_document_helpers_read_like_transformers():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = cptune.documents_from_position_ids(pos)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert torch.equal(cptune.documents_from_lengths([3, 2, 4]), ids)
    assert torch.equal(cptune.documents_from_cu_seqlens([0, 3, 5, 9]), ids)
    assert cptune.documents_from_eos(torch.tensor([5, 6, 2, 7, 2, 8]), 2).tolist() == [0, 0, 0, 1, 1, 2]
    with pytest.raises(cptune.ValidationError, match="adds up to 8 tokens, not 9"):
        cptune.documents_from_lengths([3, 5], seq_len=9)
    with pytest.raises(cptune.ValidationError, match="window: is 16"):
        _documents.check_window(16)


def test_work_balancing_beats_head_tail_on_a_long_tailed_mix():
    lengths = _documents.lengths_from_spec("longtail", 8192)
    work = _documents.token_work(_documents.documents_from_lengths(lengths), 8192, True, None)
    chunks = _documents.balanced_chunks(work, 2, 16)
    assert sorted(c for owned in chunks for c in owned) == list(range(16)) and {len(c) for c in chunks} == {8}
    assert _documents.imbalance(work, chunks, 16) < _documents.imbalance(work, _documents.head_tail_chunks(2), 4)
    assert _documents.imbalance(work, chunks, 16) < 1.05


def test_outside_a_block_the_same_call_is_single_device_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8) for _ in range(3))
    docs = cptune.documents_from_lengths([[10, 14], [5, 19]])
    mask = _documents.dense_mask(docs, (3, 0), True, 24)
    got = cptune.scaled_dot_product_attention(q, k, v, is_causal=True, documents=docs, window=(3, 0))
    assert max_err(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) < 1e-6


# -- on ranks ---------------------------------------------------------------------------------

CONFIGS = {  # name -> CPConfig fields (world size 4 for the hybrid)
    "ring-allgather": {"rotate_method": "allgather"},
    "ring-alltoall": {"rotate_method": "alltoall"},
    "ulysses": {"strategy": "ulysses"},
    "hybrid": {"strategy": "hybrid", "ulysses_degree": 2, "rotate_method": "alltoall"},
}
LAYOUTS = {  # document layouts, as lengths of a 48-token sequence (batch rows may differ)
    "equal": [[12, 12, 12, 12]],
    "spanning": [[30, 18]],  # a document across ranks
    "tiny": [[1, 1, 3, 1, 20, 1, 21]],  # length-1 documents, shorter than a shard
    "rows-differ": [[24, 24], [5, 40, 3]],
}


def _documents_case(config_name, layout_name, causal, lb, window, compiled=False, ac=False, heads=4, kv_heads=2):
    """Output and q/k/v grads of one packed call vs single-device SDPA with the dense mask."""
    torch.manual_seed(0)
    lengths = LAYOUTS[layout_name]
    batch, seq_len = len(lengths), 48
    docs = cptune.documents_from_lengths(lengths)
    gen = torch.Generator().manual_seed(7)
    qkv = [torch.randn(batch, h, seq_len, 16, generator=gen) for h in (heads, kv_heads, kv_heads)]
    grad = torch.randn(batch, heads, seq_len, 16, generator=gen)
    mask = _documents.dense_mask(docs, window, causal, seq_len)
    ref = [t.clone().requires_grad_() for t in qkv]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=kv_heads != heads)
    (ref_out * grad).sum().backward()
    leaves = [t.clone().requires_grad_() for t in qkv]
    config = cptune.CPConfig(load_balance=lb if config_name != "ulysses" else "auto", **CONFIGS[config_name])

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)

    full, cp = sharded_call(attend, leaves, grad, config, causal, docs, window, compiled, ac)
    return {"out": max_err(full, ref_out), "grads": [max_err(a.grad, b.grad) for a, b in zip(leaves, ref)],
            "lb": cp.load_balance}


def _sweep(cases):
    return [(case, _documents_case(*case)) for case in cases]


EAGER = [(c, lay, causal, lb, window) for c in ("ring-allgather", "ring-alltoall", "ulysses")
         for lay in LAYOUTS for causal, lb in ((True, True), (True, False), (False, False))
         for window in (None, (5, 0) if causal else (4, 3))]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_documents_and_windows_are_exact_everywhere(ranks, world):
    cases = [c for c in EAGER if not (c[0] == "ulysses" and 4 % world)]  # Ulysses: heads divide by the world
    if world == 4:
        cases += [("hybrid", lay, True, lb, w) for lay in LAYOUTS for lb in (True, False) for w in (None, (5, 0))]
    for per_rank in zip(*ranks(world).run(_sweep, cases)):
        for case, r in per_rank:
            assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, (case, r)


def test_packed_documents_under_compile_and_checkpointing(ranks):
    cases = [(c, "rows-differ", True, True, w, compiled, ac) for c in ("ring-alltoall", "ulysses")
             for w in (None, (5, 0)) for compiled, ac in ((True, False), (False, True), (True, True))]
    for per_rank in zip(*ranks(2).run(_sweep, cases)):
        for case, r in per_rank:
            assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, (case, r)


def _dense_mask_case(config_name, dtype_name):
    """A whole-sequence dense mask (bool and additive) under the ring: cut per block, exact."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(2, 4, 32, 8, generator=gen) for _ in range(4))
    keep = torch.rand(32, 32, generator=gen) < 0.6
    keep[:, 0] = True  # every query sees something
    mask = keep if dtype_name == "bool" else torch.zeros(32, 32).masked_fill(~keep, float("-inf")) + \
        torch.rand(32, 32, generator=gen)  # an additive bias, not only 0 / -inf
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=mask)
    (ref_out * grad).sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with cptune.context_parallel(buffers=[*leaves, grad], seq_dims=[2] * 4, causal=False, no_restore=[grad],
                                 config=cptune.CPConfig(**CONFIGS[config_name])) as cp:
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        (cp.cp_size * (out * grad).sum()).backward()
        full = cp.unshard(out, 2)
    return max([max_err(full, ref_out)] + [max_err(a.grad, b.grad) for a, b in zip(leaves, ref)])


@pytest.mark.parametrize("config_name", ["ring-allgather", "ring-alltoall"])
@pytest.mark.parametrize("dtype_name", ["bool", "additive"])
def test_a_dense_mask_under_the_ring(ranks, config_name, dtype_name):
    for err in ranks(2).run(_dense_mask_case, config_name, dtype_name):
        assert err <= FP32_TOL


def _traffic_case(config_name, layout_name, window):
    """One packed or windowed call on 4 ranks, forward + backward: exact, and the bytes each rank's ring sent
    against what the send rule says it must send and against the full ring."""
    from cptune.attention import _hooks

    lengths = {"window": [64], "aligned": [16, 16, 16, 16], "spanning": [40, 24]}[layout_name]
    docs = cptune.documents_from_lengths(lengths)
    gen = torch.Generator().manual_seed(5)
    qkv = [torch.randn(1, h, 64, 8, generator=gen) for h in (4, 2, 2)]
    grad = torch.randn(1, 4, 64, 8, generator=gen)
    ref = [t.clone().requires_grad_() for t in qkv]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=_documents.dense_mask(docs, window, True, 64),
                                             enable_gqa=True)
    (ref_out * grad).sum().backward()
    leaves = [t.clone().requires_grad_() for t in qkv]
    with cptune.context_parallel(buffers=[*leaves, grad], seq_dims=[2] * 4, config=cptune.CPConfig(
            **CONFIGS[config_name]), causal=True, documents=docs, window=window, no_restore=[grad]) as cp, \
            _hooks.counting() as traffic:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (cp.cp_size * (out * grad).sum()).backward()
        full = cp.unshard(out, 2)
        positions = cp._require().setup.positions
    need, me, ring = _blocks.needs(positions, docs, 1, True, window), cp.cp_rank, positions.shape[0]
    block = 2 * 2 * 16 * 8  # this rank's key and value elements
    to, frm = sum(need[d][me] for d in range(ring) if d != me), sum(need[me][s] for s in range(ring) if s != me)
    return {"err": max([max_err(full, ref_out)] + [max_err(a.grad, b.grad) for a, b in zip(leaves, ref)]),
            "sent": traffic.sent, "rule": 4 * block * (2 * to + frm), "full": 4 * block * 3 * (ring - 1)}


@pytest.mark.parametrize("config_name", ["ring-allgather", "ring-alltoall"])
def test_the_ring_sends_only_attended_blocks_and_stays_exact(ranks, config_name):
    """A window of S/8 on 4 ranks: a rank's queries reach one neighbour's block, so forward, the backward's
    refetch and the gradients' return send a quarter of the full ring's bytes (rank 3's block goes nowhere, rank
    0 gets none); documents aligned with the shards send nothing; a document across shards dealt by work is
    attended everywhere, so every block travels, as many bytes as the rule says."""
    cases = {("window", (8, 0)): 0.25, ("aligned", None): 0.0, ("spanning", None): 1.0}
    for (layout_name, window), most in cases.items():
        per_rank = ranks(4).run(_traffic_case, config_name, layout_name, window)
        for r in per_rank:
            assert r["err"] <= FP32_TOL and r["sent"] == r["rule"], (layout_name, r)
        total = sum(r["sent"] for r in per_rank) / sum(r["full"] for r in per_rank)
        assert total <= most and (total > 0) == (layout_name != "aligned"), (layout_name, total)


def _balanced_case():
    lengths = _documents.lengths_from_spec("longtail", 256)
    docs = cptune.documents_from_lengths(lengths)
    x = torch.randn(1, 2, 256, 8)
    with cptune.context_parallel(buffers=[x], seq_dims=[2], documents=docs) as cp:
        positions = cp._require().setup.positions
    work = _documents.token_work(docs, 256, True, None)
    per_rank = [float(work[p].sum()) for p in positions]
    return max(per_rank) / (sum(per_rank) / len(per_rank)), dist.get_rank()


def test_causal_load_balancing_deals_packed_work_evenly(ranks):
    for imbalance, _ in ranks(2).run(_balanced_case):
        assert imbalance < 1.1


def _flex_case(compiled):
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8)
    attend = torch.compile(flex_attention) if compiled else flex_attention
    try:
        with cptune.context_parallel(buffers=[q], seq_dims=[2]):
            attend(q, q, q)
    except cptune.ValidationError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_attention_inside_a_block_is_refused_not_run_on_a_shard(ranks, compiled):
    for message in ranks(2).run(_flex_case, compiled):
        assert message.startswith("cptune: flex_attention:") and "documents=" in message, message


def _rules_off_case(layout_name, rotate):
    """A block whose documents or window dealt the tokens by work (or kept them in order) and one call that turns
    them off: plain causal attention over the whole sequence, exact, although the layout is not PyTorch's."""
    lengths = {"longtail": _documents.lengths_from_spec("longtail", 64), "equal": [16] * 4}[layout_name]
    docs = cptune.documents_from_lengths(lengths)
    gen = torch.Generator().manual_seed(11)
    q, k, v, grad = (torch.randn(1, 2, 64, 8, generator=gen) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    (ref_out * grad).sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with cptune.context_parallel(buffers=[*leaves, grad], seq_dims=[2] * 4, documents=docs, window=(8, 0),
                                 no_restore=[grad], config=cptune.CPConfig(rotate_method=rotate)) as cp:
        chunks = cp._require().layout.chunks
        out = cptune.scaled_dot_product_attention(*leaves, is_causal=True, documents=False, window=False)
        (cp.cp_size * (out * grad).sum()).backward()
        full = cp.unshard(out, 2)
    return chunks, max([max_err(full, ref_out)] + [max_err(a.grad, b.grad) for a, b in zip(leaves, ref)])


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_a_call_that_turns_the_blocks_rules_off_is_exact_on_any_layout(ranks, rotate):
    for layout_name in ("longtail", "equal"):
        for chunks, err in ranks(2).run(_rules_off_case, layout_name, rotate):
            assert chunks is not None and err <= FP32_TOL, (layout_name, chunks, err)


def _decorated_case():
    """The decorator form reads each call's documents from an argument; cp = 1 applies them too."""
    docs = cptune.documents_from_lengths([[6, 10], [16]])
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_documents.dense_mask(docs, None, True, 16))

    @cptune.context_parallel(seq_dims={"q": 2, "k": 2, "v": 2}, documents="ids")
    def attend(q, k, v, ids):
        return cptune.unshard(F.scaled_dot_product_attention(q, k, v, is_causal=True), 2)

    single = cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], documents=docs,
                                     config=cptune.CPConfig(mesh_shape=(2, 1)))
    with single:
        alone = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return max_err(attend(q, k, v, docs), ref), max_err(alone, ref)


def test_the_decorator_reads_documents_per_call_and_cp1_applies_them(ranks):
    for sharded, alone in ranks(2).run(_decorated_case):
        assert sharded <= FP32_TOL and alone <= FP32_TOL
