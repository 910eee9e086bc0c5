"""Ring attention as ``torch.library`` custom ops over the kernels of :mod:`._kernels`.

A custom op is opaque to torch.compile (no graph break, no tracing into collectives), is
recorded in the autograd graph with the configuration as plain arguments (so a checkpoint's
recompute and a backward after the block both run the ring as it was at forward time), and
names its process group by string, as torch's own compile-friendly CP ops do.
:func:`ring_attention` is what a block's attention calls; :data:`PYTORCH_RING_OPS` is what
selective-checkpointing policies name (through ``cptune.RING_ATTENTION_OPS``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_cp
from . import _hooks
from ._kernels import own, register_attention_autograd, ring_backend


def _cuda_saved(backend: str, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor) -> tuple[Any, ...]:
    """What the CUDA ring backwards take besides lse, rebuilt for dense inputs and dropout 0.

    Dense (not nested) inputs have no cumulative sequence lengths: the forward kernels return None
    there, and the backward takes a defined tensor for a variable-length batch."""
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    if backend == "efficient":
        return (lse, seed, seed)
    return (lse, None, None, q.shape[2], k.shape[2], seed, seed)


@torch.library.custom_op("cptune::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, backend: str,
                       is_causal: bool, scale: float | None, rotate_method: str,
                       load_balance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    group = _torch_cp.resolve_group(group_name)
    with _torch_cp.cp_options(rotate_method, load_balance and is_causal):
        out, saved = ring_backend(q.device.type, backend).forward(group, q, k, v, is_causal, scale)
    _hooks.notify_forward()
    return own(out), own(saved[0])


@_ring_attention_op.register_fake
def _(q, k, v, group_name, backend, is_causal, scale, rotate_method, load_balance):
    b, h, s, _ = q.shape
    lse = (b, h, s, 1) if q.device.type == "cuda" and backend == "cudnn" else (b, h, s)  # cuDNN keeps a last dim
    return q.new_empty(b, h, s, v.shape[-1]), q.new_empty(lse, dtype=torch.float32)


@torch.library.custom_op("cptune::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str, backend: str,
                                is_causal: bool, scale: float | None, rotate_method: str,
                                load_balance: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = _torch_cp.resolve_group(group_name)
    saved = (lse,) if q.device.type == "cpu" else _cuda_saved(backend, q, k, lse)
    with _torch_cp.cp_options(rotate_method, load_balance and is_causal):
        dq, dk, dv = ring_backend(q.device.type, backend).backward(
            group, grad_out, q, k, v, out, saved, is_causal, scale)
    return own(dq), own(dk), own(dv)  # dk and dv may be views of one flat buffer


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, backend, is_causal, scale, rotate_method, load_balance):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_ring_attention_op, _ring_attention_backward_op)


PYTORCH_RING_OPS = (torch.ops.cptune.ring_attention.default,)
"""The op that runs PyTorch's ring (see ``cptune.RING_ATTENTION_OPS`` for all of them)."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, backend: str,
                   is_causal: bool, scale: float | None, rotate_method: str, load_balance: bool) -> torch.Tensor:
    """Ring attention of this rank's q/k/v shards over ``group``; backward rings too."""
    out, _ = _ring_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), group.group_name, backend,
                                is_causal, scale, rotate_method, load_balance)
    return out
