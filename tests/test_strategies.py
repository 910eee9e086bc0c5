"""Ulysses and the hybrid (Ulysses x ring) equal single-device attention, on real gloo ranks.

Also what only Ulysses can do (a mask for the whole sequence, dropout, the math kernel),
grouped-query key/value moved with their own head count, and the clear errors the ring and
bad splits give before any collective.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cptune
from cptune.errors import ValidationError
from tests._helpers import make_qkv, max_err
from tests.test_numerics import FP32_TOL, _ring_case


def _exact(results):
    for r in results:
        assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, r


@pytest.mark.parametrize("world,heads,kv_heads", [(2, 4, 4), (3, 6, 6), (4, 8, 8), (2, 8, 2), (4, 8, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_fp32_matches_single_device(ranks, world, heads, kv_heads, causal):
    results = ranks(world).run(_ring_case, "allgather", causal, "auto", strategy="ulysses", heads=heads,
                               kv_heads=kv_heads)
    _exact(results)
    assert all(r["load_balance"] is False and r["local_len"] == 48 // world for r in results)


def test_ulysses_replicates_too_few_kv_heads(ranks):
    # 2 KV heads over 4 Ulysses ranks: each KV head is sent twice, and the result stays exact
    _exact(ranks(4).run(_ring_case, "allgather", True, "auto", strategy="ulysses", heads=8, kv_heads=2))


@pytest.mark.parametrize("rotate,causal,lb", [("alltoall", True, True), ("allgather", True, False),
                                              ("allgather", False, False)])
def test_hybrid_2x2_matches_single_device(ranks, rotate, causal, lb):
    results = ranks(4).run(_ring_case, rotate, causal, lb, strategy="hybrid", ulysses_degree=2)
    _exact(results)
    assert all(r["load_balance"] is lb and r["local_len"] == 12 for r in results)


def test_hybrid_gqa_and_dp(ranks):
    _exact(ranks(4).run(_ring_case, "alltoall", True, True, strategy="hybrid", ulysses_degree=2, heads=8,
                        kv_heads=2))
    # dp2 x cp2 with Ulysses: each replica's two ranks trade heads
    _exact(ranks(4).run(_ring_case, "allgather", True, "auto", strategy="ulysses", mesh_shape=(2, 2)))


@pytest.mark.parametrize("world,causal", [(2, True), (4, False)])
def test_gqa_ring_exact(ranks, world, causal):
    _exact(ranks(world).run(_ring_case, "alltoall", causal, causal, heads=8, kv_heads=2))


def test_bf16_ulysses_and_hybrid_no_worse_than_twice_single_device(ranks):
    runs = [ranks(2).run(_ring_case, "alltoall", True, "auto", "bfloat16", strategy="ulysses"),
            ranks(4).run(_ring_case, "alltoall", True, True, "bfloat16", strategy="hybrid", ulysses_degree=2)]
    for results in runs:
        for r in results:
            assert r["out"] <= 2 * r["single_out"], r
            for cp_err, single_err in zip(r["grads"], r["single_grads"]):
                assert cp_err <= 2 * single_err, r


def document_mask(seq_len, heads):
    """Packed documents of lengths 10, 20 and the rest: causal inside each, nothing across."""
    doc = torch.zeros(seq_len, dtype=torch.long)
    doc[10:] = 1
    doc[30:] = 2
    pos = torch.arange(seq_len)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def additive_head_mask(seq_len, heads):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(1, heads, seq_len, seq_len, generator=gen)


@pytest.mark.parametrize("mask", [document_mask, additive_head_mask])
def test_ulysses_attention_mask_for_the_whole_sequence(ranks, mask):
    _exact(ranks(2).run(_ring_case, "allgather", False, "auto", strategy="ulysses", mask=mask))


def test_ulysses_math_backend(ranks):
    _exact(ranks(2).run(_ring_case, "allgather", True, "auto", strategy="ulysses", backend="math"))


def _dropout_case(seq_len=32, heads=4):
    """Rank r's heads get the dropout plain SDPA gives them on the whole sequence with the same seed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    (q, k, v), _ = make_qkv(3, 1, heads, heads, seq_len, 8)
    mine = slice(rank * heads // world, (rank + 1) * heads // world)
    torch.manual_seed(1000 + rank)
    expected = F.scaled_dot_product_attention(q[:, mine], k[:, mine], v[:, mine], dropout_p=0.5)
    torch.manual_seed(1000 + rank)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    config = cptune.CPConfig(strategy="ulysses")
    with cptune.context_parallel(buffers=leaves, seq_dims=[2, 2, 2], config=config, causal=False) as ctx:
        out = F.scaled_dot_product_attention(*leaves, dropout_p=0.5)
        out.sum().backward()
    full = ctx.unshard(out, 2)
    no_dropout = F.scaled_dot_product_attention(q, k, v)
    return (max_err(full[:, mine], expected), max_err(full, no_dropout),
            all(t.grad is not None and torch.isfinite(t.grad).all().item() for t in leaves))


def test_ulysses_dropout_is_sdpa_dropout_on_each_ranks_heads(ranks):
    for same, differs, grads_ok in ranks(2).run(_dropout_case):
        assert same <= FP32_TOL and differs > 0.1 and grads_ok


def _error_case(strategy, ulysses_degree=None, heads=4, **sdpa):
    """The error a bad call raises, before any collective: (message, ranks still in step)."""
    (q, k, v), _ = make_qkv(0, 1, heads, heads, 16, 8)
    config = cptune.CPConfig(strategy=strategy, ulysses_degree=ulysses_degree)
    try:
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config=config, causal=False):
            F.scaled_dot_product_attention(q, k, v, **sdpa)
        message = None
    except ValidationError as exc:
        message = str(exc)
    dist.barrier()  # every rank got here: nothing hangs
    return message


def test_ring_refuses_dropout_and_a_shard_sized_mask_naming_the_alternatives(ranks):
    for message in ranks(2).run(_error_case, "ring", attn_mask=torch.ones(16, 16, dtype=torch.bool), dropout_p=0.1):
        assert "dropout_p" in message and "strategy='ulysses'" in message and "attn_mask" not in message
    for message in ranks(2).run(_error_case, "ring", attn_mask=torch.ones(8, 8, dtype=torch.bool)):
        assert "attn_mask" in message and "(16, 16)" in message and "documents=" in message and "window=" in message


def test_ulysses_preconditions(ranks):
    for message in ranks(2).run(_error_case, "ulysses", heads=3):
        assert "3 heads, not divisible by the Ulysses degree 2" in message
    for message in ranks(2).run(_error_case, "ulysses", attn_mask=torch.ones(8, 16, dtype=torch.bool)):
        assert "attn_mask" in message and "(16, 16)" in message
    for message in ranks(4).run(_error_case, "hybrid", ulysses_degree=4):
        assert "config.ulysses_degree" in message and "ring of at least 2" in message


def test_config_strategy_fields():
    with pytest.raises(ValidationError, match="ulysses_degree"):
        cptune.CPConfig(strategy="hybrid")
    with pytest.raises(ValidationError, match="drop ulysses_degree"):
        cptune.CPConfig(ulysses_degree=2)
    with pytest.raises(ValidationError, match="load_balance"):
        cptune.CPConfig(strategy="ulysses", load_balance=True)
    assert cptune.CPConfig(strategy="hybrid", ulysses_degree=2).degrees(8) == (2, 4)
    assert cptune.CPConfig(strategy="hybrid", ulysses_degree=4).degrees(4) == (1, 4)  # no ring left: see degree_problems
    assert cptune.CPConfig(strategy="ulysses").load_balance_for(True, 2) is False
    assert cptune.CPConfig(strategy="ulysses").load_balance_for(True, 1) is True  # cp = 1: as with buffers
    assert cptune.CPConfig(strategy="ulysses", mesh_shape=(1, 4)).label() == "dp1·cp4 ulysses default"
