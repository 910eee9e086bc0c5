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


def _cuda_case(backend, dtype_name):
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    qkv = [torch.randn(1, 8, 8192, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    ref = [t.detach().float().requires_grad_() for t in qkv]
    expected = F.scaled_dot_product_attention(*ref, is_causal=True)
    expected.square().mean().backward()
    low = [t.detach().clone().requires_grad_() for t in qkv]
    F.scaled_dot_product_attention(*low, is_causal=True).float().square().mean().backward()
    with cptune.context_parallel(buffers=qkv, seq_dims=[2, 2, 2], config=cptune.CPConfig(sdpa_backend=backend)) as cp:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
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
