"""The SDPA kernels that run ring attention: one :class:`RingBackend` per (device, kernel).

A backend's ``forward(group, q, k, v, is_causal, scale)`` returns ``(out, saved)``, where
``saved`` is what ``backward`` needs besides q, k, v and out; ``backward`` returns (dq, dk, dv).
The CPU backend runs ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward),
which PyTorch's own dispatcher has no sharding rule for; the CUDA flash / efficient / cuDNN
kernels are called as torch's ring wrappers (``_scaled_dot_product_ring_*_attention``) call
them. Grouped-query key/value travel the ring with their own head count and are expanded per
block, inside the kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _torch_cp

aten = torch.ops.aten


@dataclass(frozen=True)
class RingBackend:
    name: str
    forward: Callable[..., tuple[torch.Tensor, tuple[Any, ...]]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value repeated so each query head has its own (grouped-query attention); as given otherwise."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def fold_kv_grads(dk: torch.Tensor, dv: torch.Tensor, key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded key/value gradients summed back onto their own ``key_heads`` heads (in float32)."""
    if dk.shape[1] == key_heads:
        return dk, dv
    return (dk.unflatten(1, (key_heads, -1)).sum(2, dtype=torch.float32),
            dv.unflatten(1, (key_heads, -1)).sum(2, dtype=torch.float32))


def _gqa(op: Callable[..., Any]) -> Callable[..., Any]:
    """A forward kernel for key/value with fewer heads than the query: expanded per block, never on the wire."""

    def call(query, key, value, **kwargs):  # torch's ring passes q, k, v by position
        key, value = expand_kv(query, key, value)
        return op(query, key, value, **kwargs)

    return call


def _gqa_backward(op: Callable[..., Any]) -> Callable[..., Any]:
    """The backward kernel likewise; key/value grads are summed back onto their own heads (float32)."""

    def call(*, query, key, value, **kwargs):
        key_heads = key.shape[1]
        key, value = expand_kv(query, key, value)
        dq, dk, dv, *rest = op(query=query, key=key, value=value, **kwargs)
        return (dq, *fold_kv_grads(dk, dv, key_heads), *rest)

    return call


def _ring_fwd(group, op, **kwargs):
    return _torch_cp.templated_ring_forward(group, _gqa(op), **kwargs)


def _ring_bwd(group, op, grad_out, grad_out_name="grad_out", **kwargs):
    return _torch_cp.templated_ring_backward(group, _gqa_backward(op), grad_out.contiguous(), grad_out_name,
                                             **kwargs)[:3]


def _cpu_flash_forward(group, q, k, v, is_causal, scale):
    out, lse = _ring_fwd(group, aten._scaled_dot_product_flash_attention_for_cpu.default, query=q, key=k, value=v,
                         is_causal=is_causal, dropout_p=0.0, scale=scale)[:2]
    return out, (lse,)


def _cpu_flash_backward(group, grad_out, q, k, v, out, saved, is_causal, scale):
    (lse,) = saved
    return _ring_bwd(group, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out,
                     query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal, dropout_p=0.0,
                     scale=scale)


def _cuda_flash_forward(group, q, k, v, is_causal, scale):
    res = _ring_fwd(group, aten._scaled_dot_product_flash_attention, query=q, key=k, value=v, is_causal=is_causal,
                    dropout_p=0.0, scale=scale)
    # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
    return res[0], tuple(res[1:8])


def _cuda_flash_backward(group, grad_out, q, k, v, out, saved, is_causal, scale):
    lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
    return _ring_bwd(group, aten._scaled_dot_product_flash_attention_backward.default, grad_out,
                     query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal, cum_seq_q=cum_q,
                     cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0, philox_seed=seed,
                     philox_offset=offset, scale=scale)


def _cuda_efficient_forward(group, q, k, v, is_causal, scale):
    res = _ring_fwd(group, aten._scaled_dot_product_efficient_attention, query=q, key=k, value=v, is_causal=is_causal,
                    attn_bias=None, dropout_p=0.0, scale=scale, compute_log_sumexp=True)
    return res[0], tuple(res[1:4])  # (lse, philox_seed, philox_offset)


def _cuda_efficient_backward(group, grad_out, q, k, v, out, saved, is_causal, scale):
    lse, seed, offset = saved
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the kernel's own (B, S, H, D) layout
    return _ring_bwd(group, aten._scaled_dot_product_efficient_attention_backward.default, grad_out,
                     "grad_out_", query=q, key=k, value=v, attn_bias=None, out=out, logsumexp=lse,
                     philox_seed=seed, philox_offset=offset, dropout_p=0.0,
                     grad_input_mask=(True, True, True, False), is_causal=is_causal, scale=scale)


def _cuda_cudnn_forward(group, q, k, v, is_causal, scale):
    res = _ring_fwd(group, aten._scaled_dot_product_cudnn_attention, query=q, key=k, value=v, attn_bias=None,
                    compute_log_sumexp=True, dropout_p=0.0, is_causal=is_causal, return_debug_mask=False, scale=scale)
    # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
    return res[0], tuple(res[1:8])


def _cuda_cudnn_backward(group, grad_out, q, k, v, out, saved, is_causal, scale):
    lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
    return _ring_bwd(group, aten._scaled_dot_product_cudnn_attention_backward.default, grad_out,
                     query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed, philox_offset=offset,
                     attn_bias=None, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k,
                     dropout_p=0.0, is_causal=is_causal, scale=scale)


_RING_BACKENDS = {
    ("cpu", "flash"): RingBackend("flash", _cpu_flash_forward, _cpu_flash_backward),
    ("cuda", "flash"): RingBackend("flash", _cuda_flash_forward, _cuda_flash_backward),
    ("cuda", "efficient"): RingBackend("efficient", _cuda_efficient_forward, _cuda_efficient_backward),
    ("cuda", "cudnn"): RingBackend("cudnn", _cuda_cudnn_forward, _cuda_cudnn_backward),
}
_CUDA_KERNELS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}


def ring_backend_problem(device_type: str, backend: str, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run ring attention for ``dtype`` on ``device_type``, or None."""
    if backend == "math":
        return "the math kernel returns no log-sum-exp, so it cannot be merged across ranks"
    if (device_type, backend) not in _RING_BACKENDS:
        return f"there is no '{backend}' kernel on {device_type}"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this process"
        kernel = _CUDA_KERNELS[backend]
        if not hasattr(aten, kernel) or not hasattr(aten, kernel + "_backward"):
            return f"torch {torch.__version__} has no {backend} attention kernel"
        half = dtype in (torch.float16, torch.bfloat16)
        if backend == "flash" and not (half and torch.backends.cuda.is_flash_attention_available()):
            return "flash attention needs float16/bfloat16 and a GPU that supports it"
        if backend == "cudnn" and not (half and torch.backends.cudnn.is_available()):
            return "cuDNN attention needs float16/bfloat16 and cuDNN"
        if backend == "efficient" and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return "memory-efficient attention supports float16, bfloat16 and float32"
    elif dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"the CPU flash kernel does not support {dtype}"
    return None


def ring_backend(device_type: str, backend: str) -> RingBackend:
    _torch_cp.require_cp()
    return _RING_BACKENDS[(device_type, backend)]
