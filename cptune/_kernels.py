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


# --------------------------------------------------------------------------------------
# One block: a single kernel call on (B, H, Lq, D) queries and (B, H, Lk, D) keys/values of
# equal head counts, causal (top-left aligned) and/or masked, returning (out, lse) with lse in
# float32 and -inf for rows that attend to nothing. The masked ring (:mod:`cptune._masked_ring`)
# merges such calls; backward takes the *merged* out and lse, so each call's gradient is exact.
# --------------------------------------------------------------------------------------


CAUSAL_SPLIT = {"cpu": (256, 2048)}
"""Causal squares a device's kernel runs faster cut in halves: on CPU, the flash kernel skips no work
inside its blocks below about 512 tokens (a causal 512 x 512 call costs a full one), so squares of
257-2048 tokens are cut down to 256 (measured in torch 2.13: 30 % less time at 512, 25 % at 1024, 7 % at
2048; at 4096 a whole call is faster)."""


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results merge in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as an additive bias; a float mask is a bias already."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _empty_rows(mask: torch.Tensor | None, lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf for rows the mask hides entirely (the CPU kernel reports 0 there)."""
    if mask is None:
        return lse
    seen = (mask if mask.dtype == torch.bool else ~torch.isneginf(mask)).any(-1).expand(lse.shape)
    return lse.masked_fill(~seen, float("-inf"))


def _scores(q, k, causal, mask, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # CUDA: float32 (no float64 kernels here)
    if mask is not None:
        s = s + _additive(mask, torch.float32)
    if causal:
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~tri, float("-inf"))
    return s


def _math_forward(q, k, v, causal, mask, scale):
    s = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v.float()).to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    s = _scores(q, k, causal, mask, scale)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    g = grad_out.float()
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, v.float().transpose(-1, -2))
    ds = p * (dp - (g * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, dv


def block_forward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block with ``backend``'s kernel, lse in :func:`accumulator` precision; masked blocks on
    CUDA by the math formula (tile-sized)."""
    if q.device.type == "cpu":
        bias = _additive(mask, q.dtype) if mask is not None else None
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, _empty_rows(mask, lse.to(accumulator(q.dtype)))
    if mask is not None:
        return _math_forward(q, k, v, causal, mask, scale)
    if backend == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[-2]].float()
    if backend == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[:-1]).float()
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.float()


def block_backward(backend: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged ``out`` and ``lse`` of its query rows (rows of lse
    that attend to nothing anywhere must be +inf, so they contribute nothing)."""
    if q.device.type == "cpu":
        bias = _additive(mask, q.dtype) if mask is not None else None
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(accumulator(q.dtype)), 0.0, causal, attn_mask=bias, scale=scale)[:3]
    if mask is not None:
        return _math_backward(grad_out, q, k, v, out, lse, causal, mask, scale)
    grad_out, out = grad_out.contiguous(), out.contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    if backend == "efficient":
        padded = torch.nn.functional.pad(lse, (0, -q.shape[-2] % 32))  # the kernel's own padded length
        return aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out.transpose(1, 2).contiguous().transpose(1, 2), padded, seed, seed, 0.0,
            (True, True, True, False), causal, scale=scale)[:3]
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, q.shape[-2], k.shape[-2], 0.0,
            causal, scale=scale)[:3]
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, seed, scale=scale)[:3]
