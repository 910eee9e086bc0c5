"""The SDPA kernels that run ring attention: one :class:`RingBackend` per (device, kernel).

A backend's ``forward(group, q, k, v, is_causal, scale)`` returns ``(out, saved)``, where
``saved`` is what ``backward`` needs besides q, k, v and out; ``backward`` returns (dq, dk, dv).
The CPU backend runs torch's CPU flash kernel (and its backward), which PyTorch's own dispatcher
has no sharding rule for; the CUDA flash / efficient / cuDNN kernels are called as torch's ring
wrappers call them. The calls themselves (private aten ops) are in :mod:`cptune._torch_cp`.
Grouped-query key/value travel the ring with their own head count and are expanded per block,
inside the kernel call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend

from .. import _torch_cp
from .._torch_cp import expand_kv, fold_kv_grads  # noqa: F401  (the attention package's names for them)
from ..errors import Problem

SDPA_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
"""cptune's SDPA backend names (``config.sdpa_backend``) and the kernels they select: the one list."""
SDPA_BACKENDS: tuple[str, ...] = tuple(SDPA_KERNELS)
RING_BACKENDS: tuple[str, ...] = tuple(b for b in SDPA_BACKENDS if b != "math")
"""The backends that return a log-sum-exp, so can be merged across ranks."""


def default_backends() -> tuple[str, ...]:
    """PyTorch's SDPA priority order, as cptune backend names."""
    names = {int(v): k for k, v in SDPA_KERNELS.items()}
    return tuple(names[i] for i in _torch_cp.sdp_priority_order() if i in names)


@dataclass(frozen=True)
class RingBackend:
    name: str
    forward: Callable[..., tuple[torch.Tensor, tuple[Any, ...]]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that is no view: a custom op may not return views of its inputs or of its
    other outputs, and its fake kernel promises contiguous strides (the CUDA kernels return out in
    their own layout, which compiled code would otherwise misread)."""
    t = t.contiguous()
    return t.clone() if _torch_cp.is_view(t) else t


def register_attention_autograd(forward_op: Any, backward_op: Any) -> None:
    """Autograd for an attention op ``(q, k, v, *config) -> (out, lse)`` whose backward op is
    ``(grad_out, q, k, v, out, lse, *config) -> (dq, dk, dv[, d_config0])``: the configuration travels as plain
    arguments; a fourth gradient is the first configuration argument's (attention sinks), None where it is None."""

    def setup_context(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = tuple(backward_op(grad_out.contiguous(), q, k, v, out, lse, *ctx.args))
        if len(grads) > 3 and ctx.args[0] is None:
            grads = grads[:3] + (None,)
        return grads + (None,) * (3 + len(ctx.args) - len(grads))

    forward_op.register_autograd(backward, setup_context=setup_context)


def _backend(device_type: str, name: str) -> RingBackend:
    kernel = (device_type, name)
    return RingBackend(name, functools.partial(_torch_cp.ring_forward, kernel),
                       functools.partial(_torch_cp.ring_backward, kernel))


_RING_BACKENDS = {key: _backend(*key) for key in (("cpu", "flash"), ("cuda", "flash"), ("cuda", "efficient"),
                                                  ("cuda", "cudnn"))}


def ring_backend_problem(device_type: str, backend: str, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run ring attention for ``dtype`` on ``device_type``, or None."""
    if backend == "math":
        return "the math kernel returns no log-sum-exp, so it cannot be merged across ranks"
    if (device_type, backend) not in _RING_BACKENDS:
        return f"there is no '{backend}' kernel on {device_type}"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this process"
        if not _torch_cp.has_cuda_kernel(backend):
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


def backend_problem(device_type: str, backend: str, dtype: torch.dtype | None, ring: bool) -> str | None:
    """Why ``backend`` can't serve SDPA here (``ring``: under CP), or None."""
    if ring:
        return ring_backend_problem(device_type, backend, dtype or torch.float32)
    if device_type == "cpu" and backend in ("efficient", "cudnn"):
        return f"there is no '{backend}' kernel on cpu"
    if device_type == "cuda" and dtype is not None:
        return ring_backend_problem(device_type, backend, dtype) if backend != "math" else None
    return None


def pick_backend(backends: Sequence[str], device_type: str, dtype: torch.dtype | None,
                 ring: bool) -> tuple[str | None, list[Problem]]:
    """The first usable backend of ``backends``; if none is usable, one problem saying why each fails."""
    reasons = []
    for name in backends:
        why = backend_problem(device_type, name, dtype, ring)
        if why is None:
            return name, []
        reasons.append(f"'{name}': {why}")
    usable = [b for b in SDPA_BACKENDS if backend_problem(device_type, b, dtype, ring) is None]
    dtype_text = f", {dtype}".replace("torch.", "") if dtype is not None else ""
    return None, [Problem("config.sdpa_backend",
                          f"no requested backend works on {device_type}{dtype_text}"
                          f"{' under context parallelism' if ring else ''} ({'; '.join(reasons)})",
                          f"use one of {usable}" if usable else "use another device or dtype")]


def ring_backend(device_type: str, backend: str) -> RingBackend:
    _torch_cp.require_cp()
    return _RING_BACKENDS[(device_type, backend)]


# --------------------------------------------------------------------------------------
# One block: a single kernel call on (B, H, Lq, D) queries and (B, H, Lk, D) keys/values of
# equal head counts, causal (top-left aligned) and/or masked, returning (out, lse) with lse in
# float32 and -inf for rows that attend to nothing. The masked ring (:mod:`._masked_ring`)
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
        out, lse = _torch_cp.kernel_forward(backend, q, k, v, causal, bias, scale)
        return out, _empty_rows(mask, lse.to(accumulator(q.dtype)))
    if mask is not None:
        return _math_forward(q, k, v, causal, mask, scale)
    return _torch_cp.kernel_forward(backend, q, k, v, causal, None, scale)


def block_backward(backend: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged ``out`` and ``lse`` of its query rows (rows of lse
    that attend to nothing anywhere must be +inf, so they contribute nothing)."""
    if q.device.type == "cpu":
        bias = _additive(mask, q.dtype) if mask is not None else None
        return _torch_cp.kernel_backward(backend, grad_out, q, k, v, out, lse.to(accumulator(q.dtype)), causal, bias,
                                         scale)
    if mask is not None:
        return _math_backward(grad_out, q, k, v, out, lse, causal, mask, scale)
    return _torch_cp.kernel_backward(backend, grad_out, q, k, v, out, lse, causal, None, scale)
