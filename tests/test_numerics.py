"""CP attention equals single-device attention: output and q/k/v grads, on real gloo ranks."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cptune
from tests._helpers import make_qkv, max_err, reference

FP32_TOL = 1e-5


def _ring_case(rotate, causal, lb, dtype_name="float32", batch=2, heads=4, kv_heads=4, seq_len=48,
               head_dim=16, scale=None, mesh_shape=None, strategy="ring", ulysses_degree=None, mask=None,
               backend=None):
    dtype = getattr(torch, dtype_name)
    world = dist.get_world_size()
    cp = mesh_shape[1] if mesh_shape else world
    replica = dist.get_rank() // cp  # the dp replica: each has its own data
    qkv, grad = make_qkv(100 + replica, batch, heads, kv_heads, seq_len, head_dim)
    kwargs = {"is_causal": causal, "scale": scale, "enable_gqa": kv_heads != heads}
    if mask is not None:
        kwargs["attn_mask"] = mask(seq_len, heads)
    ref_out, ref_grads = reference(qkv, grad, **kwargs)
    result = {}
    if dtype != torch.float32:  # what plain single-device attention loses at this dtype
        low_out, low_grads = reference([t.to(dtype) for t in qkv], grad.to(dtype), **kwargs)
        result["single_out"] = max_err(low_out, ref_out)
        result["single_grads"] = [max_err(a, b) for a, b in zip(low_grads, ref_grads)]
    leaves = [t.to(dtype).requires_grad_() for t in qkv]
    g = grad.to(dtype)
    config = cptune.CPConfig(rotate_method=rotate, load_balance=lb, mesh_shape=mesh_shape, strategy=strategy,
                             ulysses_degree=ulysses_degree, sdpa_backend=backend)
    with cptune.context_parallel(buffers=[*leaves, g], seq_dims=[2, 2, 2, 2], config=config, causal=causal,
                                 no_restore=[g]) as ctx:
        out = F.scaled_dot_product_attention(*leaves, **kwargs)
    # Each rank's loss covers its own tokens; cptune's buffer grads are the mean over CP ranks.
    (ctx.cp_size * (out.float() * g.float()).sum()).backward()
    result["out"] = max_err(ctx.unshard(out, 2), ref_out)
    result["grads"] = [max_err(t.grad, r) for t, r in zip(leaves, ref_grads)]
    result["local_len"] = out.shape[2]
    result["load_balance"] = ctx.load_balance
    result["cp"] = ctx.cp_size
    return result


FP32_CASES = [
    (world, rotate, causal, lb)
    for world in (2, 3, 4)
    for rotate in ("allgather", "alltoall")
    for causal, lb in ((True, True), (True, False), (False, False))
]


@pytest.mark.parametrize("world,rotate,causal,lb", FP32_CASES)
def test_fp32_matches_single_device(ranks, world, rotate, causal, lb):
    for r in ranks(world).run(_ring_case, rotate, causal, lb):
        assert r["cp"] == world and r["local_len"] == 48 // world
        assert r["load_balance"] is lb
        assert r["out"] <= FP32_TOL, r
        assert max(r["grads"]) <= FP32_TOL, r


@pytest.mark.parametrize("world,causal,lb", [(2, True, True), (4, False, False), (3, True, False)])
def test_bf16_no_worse_than_twice_single_device(ranks, world, causal, lb):
    for r in ranks(world).run(_ring_case, "alltoall", causal, lb, "bfloat16"):
        assert r["out"] <= 2 * r["single_out"], r
        for cp_err, single_err in zip(r["grads"], r["single_grads"]):
            assert cp_err <= 2 * single_err, r


def test_gqa_and_scale(ranks):
    for r in ranks(2).run(_ring_case, "allgather", True, True, heads=4, kv_heads=2, scale=0.3):
        assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, r


def test_batch_one_long_sequence(ranks):
    for r in ranks(4).run(_ring_case, "alltoall", True, True, batch=1, seq_len=256, head_dim=32):
        assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, r


@pytest.mark.parametrize("causal", [True, False])
def test_2d_mesh_dp2_cp2(ranks, causal):
    results = ranks(4).run(_ring_case, "alltoall", causal, "auto", mesh_shape=(2, 2))
    for r in results:
        assert r["cp"] == 2 and r["local_len"] == 24
        assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, r


# -- the decorator on a small model step ----------------------------------------------------


class TinyAttentionModel(nn.Module):
    """Embedding, one causal attention block with rotary positions, and an LM head. No CP code."""

    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def rotary(x, position_ids):
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = position_ids[:, None, :, None].float() * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _model_step_case(rotate, lb):
    torch.manual_seed(0)
    model = TinyAttentionModel()
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 32), generator=gen)
    labels = torch.randint(0, 64, (2, 32), generator=gen)
    position_ids = torch.arange(32).expand(2, 32)

    def loss_fn(model, input_ids, labels, position_ids):
        logits = model(input_ids, position_ids)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    ref_loss = loss_fn(model, input_ids, labels, position_ids)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    config = cptune.CPConfig(rotate_method=rotate, load_balance=lb)
    step = cptune.context_parallel(seq_dims={"input_ids": 1, "labels": 1, "position_ids": 1}, config=config)(loss_fn)
    loss = step(model, input_ids, labels, position_ids)
    loss.backward()
    world = dist.get_world_size()
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)
    global_loss = loss.item() / world
    grad_err = 0.0
    for p, ref in zip(model.parameters(), ref_grads):
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        grad_err = max(grad_err, max_err(p.grad / world, ref))
    return {"loss_err": abs(global_loss - ref_loss.item()), "grad_err": grad_err,
            "input_ids_after": tuple(input_ids.shape)}


@pytest.mark.parametrize("rotate,lb", [("allgather", "auto"), ("alltoall", False)])
def test_decorator_model_step_matches_single_device(ranks, rotate, lb):
    for r in ranks(2).run(_model_step_case, rotate, lb):
        assert r["loss_err"] <= FP32_TOL and r["grad_err"] <= FP32_TOL, r
        assert r["input_ids_after"] == (2, 32)  # the caller's tensors are not changed


def _canonical_case():
    torch.manual_seed(0)
    qkv = [torch.randn(1, 4, 256, 32, requires_grad=True) for _ in range(3)]
    with cptune.context_parallel(buffers=tuple(qkv), seq_dims=(2, 2, 2)):
        output = F.scaled_dot_product_attention(*qkv, is_causal=True)
    output.float().square().mean().backward()  # the canonical example's loss, after the block
    reference_leaves = [t.detach().clone().requires_grad_() for t in qkv]
    F.scaled_dot_product_attention(*reference_leaves, is_causal=True).square().mean().backward()
    rel = [max_err(t.grad, r.grad) / r.grad.abs().max().item() for t, r in zip(qkv, reference_leaves)]
    return {"shapes": [tuple(t.grad.shape) for t in qkv], "rel": rel, "local": tuple(output.shape)}


def test_canonical_example_backward_after_block(ranks):
    for r in ranks(2).run(_canonical_case):
        assert r["shapes"] == [(1, 4, 256, 32)] * 3  # full shape, original order
        assert r["local"] == (1, 4, 128, 32)
        assert max(r["rel"]) <= 1e-5, r
        assert not math.isnan(max(r["rel"]))
