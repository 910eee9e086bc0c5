"""GPU checks: skipped without CUDA (CI has none). Run them where GPUs are: pytest -m gpu."""

import pytest
import torch
import torch.nn.functional as F

import cptune
from cptune.launch import WorkerGroup
from cptune.validate import pick_backend
from tests._helpers import max_err

pytestmark = pytest.mark.gpu


def test_backend_choice_on_one_gpu():
    name, problems = pick_backend(["flash", "efficient"], "cuda", torch.float32, ring=True)
    assert name == "efficient" and not problems  # flash needs half precision
    name, _ = pick_backend(["flash", "efficient"], "cuda", torch.bfloat16, ring=True)
    assert name == "flash"


def _cuda_case(backend, dtype_name, kv_heads=8, **strategy):
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    qkv = [torch.randn(1, h, 8192, 64, device=device, dtype=dtype, requires_grad=True) for h in (8, kv_heads, kv_heads)]
    gqa = {"enable_gqa": kv_heads != 8}
    ref = [t.detach().float().requires_grad_() for t in qkv]
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, **gqa)
    expected.square().mean().backward()
    low = [t.detach().clone().requires_grad_() for t in qkv]
    F.scaled_dot_product_attention(*low, is_causal=True, **gqa).float().square().mean().backward()
    config = cptune.CPConfig(sdpa_backend=backend, **strategy)
    with cptune.context_parallel(buffers=qkv, seq_dims=[2, 2, 2], config=config) as cp:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True, **gqa)
    out.float().square().mean().backward()
    return {"out": max_err(cp.unshard(out, 2), expected),
            "grads": [max_err(t.grad, r.grad) for t, r in zip(qkv, ref)],
            "single_grads": [max_err(t.grad, r.grad) for t, r in zip(low, ref)]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend,dtype", [("flash", "bfloat16"), ("efficient", "float32"), ("cudnn", "bfloat16")])
def test_ring_on_two_gpus(backend, dtype):
    if pick_backend([backend], "cuda", getattr(torch, dtype), ring=True)[0] is None:
        pytest.skip(f"{backend} not available here")
    with WorkerGroup(2, device="cuda", timeout=300) as group:
        for r in group.run(_cuda_case, backend, dtype):
            for cp_err, single in zip(r["grads"], r["single_grads"]):
                assert cp_err <= 2 * single + 1e-6, r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", [{}, {"strategy": "ulysses"}])
def test_gqa_ring_and_ulysses_on_two_gpus(strategy):
    with WorkerGroup(2, device="cuda", timeout=300) as group:
        for r in group.run(_cuda_case, None, "bfloat16", 2, **strategy):
            for cp_err, single in zip(r["grads"], r["single_grads"]):
                assert cp_err <= 2 * single + 1e-6, r


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_hybrid_on_four_gpus():
    with WorkerGroup(4, device="cuda", timeout=300) as group:
        for r in group.run(_cuda_case, None, "bfloat16", 2, strategy="hybrid", ulysses_degree=2):
            for cp_err, single in zip(r["grads"], r["single_grads"]):
                assert cp_err <= 2 * single + 1e-6, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ring_through_one_rank_group_on_one_gpu(dtype):
    """The CUDA ring backends and the custom op, eager and compiled, on a single GPU (< 5 min)."""
    from tests.test_training import _one_rank_ring_case

    with WorkerGroup(1, device="cuda", timeout=300) as group:
        rows = group.run(_one_rank_ring_case, "cuda", ["flash", "efficient", "cudnn"], dtype)[0]
    ran = [r for r in rows if "skipped" not in r]
    assert ran, rows  # at least one CUDA backend serves this dtype
    for r in ran:
        assert r["out_err"] <= 2 * r["single_out_err"] + 1e-6, r
        for cp_err, single in zip(r["grad_errs"], r["single_grad_errs"]):
            assert cp_err <= 2 * single + 1e-5, r
