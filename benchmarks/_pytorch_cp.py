"""PyTorch's own ``context_parallel``, made to run on CPU, for side-by-side benchmarks only.

torch's DTensor dispatcher has ring handlers for the CUDA kernels only; this adds one for the
CPU flash kernel (the same templated ring functions cptune uses) while the block runs. torch's
private CP module is reached through ``cptune.attention.require_cp`` (``cptune._torch_cp``, its only importer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from cptune.attention import require_cp

aten = torch.ops.aten


def _native_cpu_handler(op_call, args, kwargs):
    from torch.distributed.tensor import DTensor, Shard

    cp = require_cp()
    mesh = next(a.device_mesh for a in [*args, *kwargs.values()] if isinstance(a, DTensor))
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    lkw = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    group = mesh.get_group()
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v, *rest = local
        dropout_p = rest[0] if rest else lkw.pop("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else lkw.pop("is_causal", False)
        results = cp._templated_ring_attention(group, 2, op_call, query=q, key=k, value=v, is_causal=is_causal,
                                               dropout_p=dropout_p, scale=lkw.get("scale"))[:2]
    else:
        grad_out, q, k, v, out, lse, dropout_p, is_causal = local[:8]
        results = cp._templated_ring_attention_backward(
            group, 2, op_call, grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, scale=lkw.get("scale"))[:3]
    return tuple(DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in results)


@contextlib.contextmanager
def torch_context_parallel(mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int],
                           rotate_method: str) -> Iterator[None]:
    """torch.distributed.tensor.experimental.context_parallel on CPU (benchmarks only)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel

    cp = require_cp()
    dispatcher = DTensor._op_dispatcher
    old_rotate = cp._cp_options.rotate_method
    cp.set_rotate_method(rotate_method)
    handlers = {aten._scaled_dot_product_flash_attention_for_cpu.default: _native_cpu_handler,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _native_cpu_handler}
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims):
            dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, **handlers}
            yield
    finally:
        for op in handlers:
            dispatcher._custom_op_handlers.pop(op, None)
        cp._cp_options.rotate_method = old_rotate


def flex_document_forward(mesh: Any, docs: torch.Tensor) -> Any:
    """PyTorch's CP with FlexAttention on packed causal documents, plain contiguous shards: the block mask of this
    rank's queries against the whole sequence (built once), and a forward that all-gathers K/V and runs the
    compiled ``flex_attention`` (``run(q, k, v)`` on this rank's shards)."""
    from torch.distributed.distributed_c10d import _get_process_group_name
    from torch.nn.attention.flex_attention import flex_attention

    cp = require_cp()

    def same_document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    seq_len = docs.numel()
    old = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = False  # contiguous shards, as cptune's side gets
    try:
        block_mask = cp._create_cp_block_mask(same_document_causal, 1, 1, seq_len, seq_len, mesh)
    finally:
        cp._cp_options.enable_load_balance = old
    flex = torch.compile(flex_attention, dynamic=False)  # a dynamic recompile at the next length fails to build on CPU
    group = _get_process_group_name(mesh.get_group())
    gather = torch.ops.cplib.flex_cp_allgather

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        full_k, full_v = gather(k, v, 2, group)
        return flex(q, full_k, full_v, block_mask=block_mask)

    return run
