"""GPU checks: skipped without CUDA (CI has none). Run them where GPUs are: pytest -m gpu."""

import pytest
import torch
import torch.nn.functional as F

import cptune
from cptune.launch import WorkerGroup
from cptune.attention import pick_backend
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
    expected.square().sum().backward()
    low = [t.detach().clone().requires_grad_() for t in qkv]
    F.scaled_dot_product_attention(*low, is_causal=True, **gqa).float().square().sum().backward()
    config = cptune.CPConfig(sdpa_backend=backend, **strategy)
    with cptune.context_parallel(buffers=qkv, seq_dims=[2, 2, 2], config=config) as cp:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True, **gqa)
    (cp.cp_size * out.float().square().sum()).backward()  # buffer grads are the mean over CP ranks
    return {"out": max_err(cp.unshard(out, 2), expected),
            "grads": [max_err(t.grad, r.grad) for t, r in zip(qkv, ref)],
            "single_grads": [max_err(t.grad, r.grad) for t, r in zip(low, ref)],
            "scale": max(r.grad.abs().max().item() for r in ref)}


def _assert_close(results):
    """CP grads no worse than twice plain SDPA's at that dtype; float32 rounding (2e-5 relative) allowed."""
    for r in results:
        for cp_err, single in zip(r["grads"], r["single_grads"]):
            assert cp_err <= 2 * single + 2e-5 * r["scale"], r


def _shared_gpu_case(*args, **strategy):
    """Several ranks on GPU 0 over gloo (NCCL refuses two ranks on one GPU): the multi-rank CUDA paths
    on a one-GPU machine. The ring rotates by all-to-all: gloo has no all-gather for CUDA tensors."""
    import os

    os.environ["LOCAL_RANK"] = "0"  # the device mesh would otherwise select GPU <rank>
    torch.cuda.set_device(0)
    if strategy.get("strategy") != "ulysses":
        strategy.setdefault("rotate_method", "alltoall")
    return _cuda_case(*args, **strategy)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend,dtype", [("flash", "bfloat16"), ("efficient", "float32"), ("cudnn", "bfloat16")])
def test_ring_on_two_gpus(backend, dtype):
    if pick_backend([backend], "cuda", getattr(torch, dtype), ring=True)[0] is None:
        pytest.skip(f"{backend} not available here")
    with WorkerGroup(2, device="cuda", timeout=300) as group:
        _assert_close(group.run(_cuda_case, backend, dtype))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", [{}, {"strategy": "ulysses"}])
def test_gqa_ring_and_ulysses_on_two_gpus(strategy):
    with WorkerGroup(2, device="cuda", timeout=300) as group:
        _assert_close(group.run(_cuda_case, None, "bfloat16", 2, **strategy))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_hybrid_on_four_gpus():
    with WorkerGroup(4, device="cuda", timeout=300) as group:
        _assert_close(group.run(_cuda_case, None, "bfloat16", 2, strategy="hybrid", ulysses_degree=2))


SHARED_GPU_CASES = [
    (2, ("flash", "bfloat16"), {}),
    (2, ("efficient", "bfloat16"), {}),
    (2, ("efficient", "float32"), {}),
    (2, ("cudnn", "bfloat16"), {}),
    (2, ("flash", "bfloat16"), {"load_balance": False}),
    (2, ("cudnn", "bfloat16", 2), {}),
    (2, ("efficient", "float32", 2), {}),
    (2, (None, "bfloat16", 2), {"strategy": "ulysses"}),
    (4, ("flash", "bfloat16"), {}),
    (4, (None, "bfloat16", 2), {"strategy": "hybrid", "ulysses_degree": 2}),
]


@pytest.mark.parametrize("world,args,strategy", SHARED_GPU_CASES)
def test_ranks_sharing_one_gpu(world, args, strategy):
    if args[0] and pick_backend([args[0]], "cuda", getattr(torch, args[1]), ring=True)[0] is None:
        pytest.skip(f"{args[0]} not available here")
    with WorkerGroup(world, device="cpu", timeout=300) as group:  # gloo ranks holding CUDA tensors
        _assert_close(group.run(_shared_gpu_case, *args, **strategy))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ring_through_one_rank_group_on_one_gpu(dtype):
    """The CUDA ring backends and the custom op, eager and compiled, on a single GPU (< 5 min)."""
    from tests.test_training import _one_rank_ring_case

    with WorkerGroup(1, device="cuda", timeout=300) as group:
        rows = group.run(_one_rank_ring_case, "cuda", ["flash", "efficient", "cudnn"], dtype)[0]
    ran = [r for r in rows if "skipped" not in r]
    assert ran, rows  # at least one CUDA backend serves this dtype
    for r in ran:
        assert "error" not in r, r
        assert r["out_err"] <= 2 * r["single_out_err"] + 1e-6, r
        for cp_err, single in zip(r["grad_errs"], r["single_grad_errs"]):
            assert cp_err <= 2 * single + 1e-5, r


def _documents_cuda_case(backend, dtype_name, window=None, **strategy):
    """Packed documents (and a window) on CUDA: cptune's masked ring against plain SDPA with the dense mask."""
    import os

    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    from cptune.attention import _documents

    dtype, device = getattr(torch, dtype_name), torch.device("cuda", 0)
    docs = cptune.documents_from_lengths(_documents.lengths_from_spec("longtail", 8192))
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = [torch.randn(1, h, 8192, 64, device=device, dtype=dtype, generator=gen, requires_grad=True)
           for h in (8, 2, 2)]
    mask = _documents.dense_mask(docs, window, True, 8192, device)
    ref = [t.detach().float().requires_grad_() for t in qkv]
    expected = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=True)
    expected.square().sum().backward()
    low = [t.detach().clone().requires_grad_() for t in qkv]
    F.scaled_dot_product_attention(*low, attn_mask=mask, enable_gqa=True).float().square().sum().backward()
    strategy.setdefault("rotate_method", "alltoall")  # gloo ranks sharing one GPU: no all-gather of CUDA tensors
    config = cptune.CPConfig(sdpa_backend=backend, **strategy)
    with cptune.context_parallel(buffers=qkv, seq_dims=[2, 2, 2], config=config, documents=docs, window=window) as cp:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
    (cp.cp_size * out.float().square().sum()).backward()
    return {"out": max_err(cp.unshard(out, 2), expected), "grads": [max_err(t.grad, r.grad) for t, r in zip(qkv, ref)],
            "single_grads": [max_err(t.grad, r.grad) for t, r in zip(low, ref)],
            "scale": max(r.grad.abs().max().item() for r in ref)}


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("window", [None, (1023, 0)])
def test_packed_documents_on_one_gpu(backend, window):
    """The masked ring's CUDA kernels (unmasked blocks: the backend; window edges: the math formula), bf16."""
    if pick_backend([backend], "cuda", torch.bfloat16, ring=True)[0] is None:
        pytest.skip(f"{backend} not available here")
    with WorkerGroup(2, device="cpu", timeout=300) as group:
        _assert_close(group.run(_documents_cuda_case, backend, "bfloat16", window))
