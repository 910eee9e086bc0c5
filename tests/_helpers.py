"""Helpers the tests share: reference attention on one device, error measures, and a recipe written by hand."""

import torch
import torch.nn.functional as F


def make_qkv(seed, batch, heads, kv_heads, seq_len, head_dim, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    return [t.to(dtype) for t in (q, k, v)], grad.to(dtype)


def reference(qkv, grad, **sdpa_kwargs):
    """Single-device output and q/k/v grads of loss = sum(out * grad), in float32."""
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = F.scaled_dot_product_attention(*leaves, **sdpa_kwargs)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def sharded_call(attend, leaves, grad, config, causal, docs, window, compiled=False, ac=False):
    """``attend(q, k, v)`` in a block over ``leaves`` (sequence dim 2), optionally checkpointed and compiled, its
    loss sum(out * grad) made cp times each rank's share and run backward: (the whole output, the block)."""
    import cptune

    def checkpointed(q, k, v):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(attend, q, k, v, use_reentrant=False)

    run = checkpointed if ac else attend
    run = torch.compile(run) if compiled else run
    g = grad.clone()
    with cptune.context_parallel(buffers=[*leaves, g], seq_dims=[2] * 4, config=config, causal=causal,
                                 documents=docs, window=window, no_restore=[g]) as cp:
        out = run(*leaves)
        (cp.cp_size * (out * g).sum()).backward()
        return cp.unshard(out, 2), cp


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def write_recipe(path, workload, config, script=None):
    """An unmeasured recipe of ``workload`` under ``config`` on one CPU node of as many ranks as its mesh holds,
    as a user writes one by hand; returns its path."""
    from cptune._env import environment
    from cptune.recipe import Launch, Metrics, Provenance, Recipe, save_recipe

    ranks = config.parallel_dims().world
    return save_recipe(Recipe(workload=workload, config=config, launch=Launch(nproc_per_node=ranks, script=script),
                              provenance=Provenance(**environment("cpu", ranks).provenance()),
                              metrics=Metrics(measured=False)), path)


def run_ok(args, cwd, timeout=600):
    """``args`` run as its own process (a script or cptune command forked from the session's warm interpreter,
    :mod:`tests._warm`), which must exit 0; what ``subprocess.run`` returns."""
    from tests._warm import run

    result = run(args, cwd, timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result
