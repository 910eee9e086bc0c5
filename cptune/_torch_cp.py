"""The only cptune module that touches PyTorch's private context-parallel code.

PyTorch ships context parallelism as a prototype whose internals move between releases
(``torch.distributed.tensor.experimental._attention`` became a package
``..._context_parallel`` in 2.7). Everything cptune needs from it is imported here, with
feature detection, so a torch release that moves things costs this one file:

* ``_templated_ring_attention`` / ``_templated_ring_attention_backward``: the ring
  algorithm (rotation, load-balanced causal blocks, log-sum-exp merging) over any SDPA op
  that returns ``(out, logsumexp, ...)``;
* ``_cp_options``: the process-global rotate method and load-balance flag, which the ring
  functions read while they run. cptune never leaves them changed: :func:`cp_options`
  sets them for the duration of one ring call (forward or backward) and restores them.

On top of that this module adds, in this order:

1. the CPU ring backend: ring attention over ``aten._scaled_dot_product_flash_attention_for_cpu``
   (and its backward), which PyTorch's own dispatcher has no sharding rule for, and the CUDA
   flash / efficient / cuDNN kernels called as torch's ring wrappers call them (one
   :class:`RingBackend` per kernel). Grouped-query key/value travel the ring with their own
   head count and are expanded per block, inside the kernel call;
2. the ``cptune::ring_attention`` custom op and its backward op, with the configuration as
   arguments, so an activation checkpoint's recompute, ``torch.compile`` and a backward after
   the ``with`` block all run the ring as it ran at forward time; :func:`ring_attention` is
   what the session calls, :data:`RING_ATTENTION_OPS` what selective-checkpointing policies name;
3. two small hooks for the session: :func:`forward_listener` (told of each ring forward, to
   spot activation checkpointing) and :func:`use_count` (whether autograd holds a buffer).

Benchmarks reach torch's module through :func:`require_cp` (``benchmarks/_pytorch_cp.py``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import CPTuneError

aten = torch.ops.aten

MIN_TORCH = (2, 7)
"""The oldest torch whose ring functions have the signatures used here."""

_CANDIDATE_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # torch >= 2.9
    "torch.distributed.tensor.experimental._attention",  # torch 2.5 - 2.8
)
_REQUIRED = (
    "_templated_ring_attention",
    "_templated_ring_attention_backward",
    "_cp_options",
    "_RotateMethod",
)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _find_cp_module() -> Any | None:
    for name in _CANDIDATE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, attr) for attr in _REQUIRED):
            return module
    return None


_cp = _find_cp_module() if dist.is_available() else None


def support_problem() -> str | None:
    """Why context parallelism cannot run with this torch, or None when it can."""
    if not dist.is_available():
        return "this torch build has no torch.distributed; install a build with distributed support"
    if torch_version() < MIN_TORCH:
        return (
            f"torch {torch.__version__} is too old for cptune's ring attention; "
            f"install torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"
        )
    if _cp is None:
        return (
            f"torch {torch.__version__} has no context-parallel ring functions where cptune "
            f"looks for them ({', '.join(_CANDIDATE_MODULES)}); pin torch to a verified "
            "release (2.13.0) or report the new location"
        )
    return None


def require_cp() -> Any:
    """torch's private CP module, or a CPTuneError saying why it cannot be used."""
    problem = support_problem()
    if problem is not None:
        raise CPTuneError(problem)
    return _cp


@contextlib.contextmanager
def cp_options(rotate_method: str, load_balance: bool) -> Iterator[None]:
    """Set torch's CP globals for one ring call and put the old values back after it."""
    cp = require_cp()
    options = cp._cp_options
    old = (options.rotate_method, options.enable_load_balance)
    options.rotate_method = (
        cp._RotateMethod.ALL_TO_ALL if rotate_method == "alltoall" else cp._RotateMethod.ALL_GATHER
    )
    options.enable_load_balance = load_balance
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance = old


def global_options() -> tuple[Any, bool] | None:
    """Torch's current (rotate method, load balance) globals; tests check they are untouched."""
    if _cp is None:
        return None
    return (_cp._cp_options.rotate_method, _cp._cp_options.enable_load_balance)


# --------------------------------------------------------------------------------------
# One ring backend per SDPA kernel. ``forward`` returns (out, saved) where ``saved`` is what
# ``backward`` needs besides q, k, v and out; ``backward`` returns (dq, dk, dv).
# --------------------------------------------------------------------------------------


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
        if dk.shape[1] != key_heads:
            dk = dk.unflatten(1, (key_heads, -1)).sum(2, dtype=torch.float32)
            dv = dv.unflatten(1, (key_heads, -1)).sum(2, dtype=torch.float32)
        return (dq, dk, dv, *rest)

    return call


def _ring_fwd(group, op, **kwargs):
    return _cp._templated_ring_attention(group, 2, _gqa(op), **kwargs)


def _ring_bwd(group, op, grad_out, grad_out_name="grad_out", **kwargs):
    return _cp._templated_ring_attention_backward(group, 2, _gqa_backward(op), grad_out=grad_out.contiguous(),
                                                  grad_out_name=grad_out_name, **kwargs)[:3]


# The calls below mirror torch's own ring wrappers (``_scaled_dot_product_ring_*_attention``)
# with the kernel wrapped for grouped-query key/value.


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
    require_cp()
    return _RING_BACKENDS[(device_type, backend)]


# --------------------------------------------------------------------------------------
# Ring attention as torch.library custom ops. A custom op is opaque to torch.compile (no
# graph break, no tracing into collectives), is recorded in the autograd graph with the
# configuration as plain arguments (so a checkpoint's recompute and a backward after the
# block both run the ring as it was at forward time), and names its process group by
# string, as torch's own compile-friendly CP ops do.
# --------------------------------------------------------------------------------------


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that is no view: a custom op may not return views of its inputs or of its
    other outputs, and its fake kernel promises contiguous strides (the CUDA kernels return out in
    their own layout, which compiled code would otherwise misread)."""
    t = t.contiguous()
    return t.clone() if t._base is not None else t


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
    group = dist.distributed_c10d._resolve_process_group(group_name)
    with cp_options(rotate_method, load_balance and is_causal):
        out, saved = ring_backend(q.device.type, backend).forward(group, q, k, v, is_causal, scale)
    notify_forward()
    return _own(out), _own(saved[0])


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
    group = dist.distributed_c10d._resolve_process_group(group_name)
    saved = (lse,) if q.device.type == "cpu" else _cuda_saved(backend, q, k, lse)
    with cp_options(rotate_method, load_balance and is_causal):
        dq, dk, dv = ring_backend(q.device.type, backend).backward(
            group, grad_out, q, k, v, out, saved, is_causal, scale)
    return _own(dq), _own(dk), _own(dv)  # dk and dv may be views of one flat buffer


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, backend, is_causal, scale, rotate_method, load_balance):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = args


def _ring_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup_context)


RING_ATTENTION_OPS = (torch.ops.cptune.ring_attention.default,)
"""The ring attention op, e.g. for a selective activation-checkpointing policy's save list."""

_FORWARD_LISTENERS: list[Callable[[], None]] = []


def notify_forward() -> None:
    """Tell the listeners a CP attention forward ran, unless it is a recompute inside a backward pass."""
    if torch._C._current_graph_task_id() == -1:
        for listener in _FORWARD_LISTENERS:
            listener()


@contextlib.contextmanager
def forward_listener(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn`` after each ring forward that is not a recompute inside a backward pass.

    The op's own body runs in eager and in compiled code alike, so this sees every call.
    """
    _FORWARD_LISTENERS.append(fn)
    try:
        yield
    finally:
        _FORWARD_LISTENERS.remove(fn)


def use_count(t: torch.Tensor) -> int:
    """How many references the tensor's storage object has (autograd's saved copies included)."""
    counter = getattr(t, "_use_count", None)
    return counter() if counter is not None else 0


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, backend: str,
                   is_causal: bool, scale: float | None, rotate_method: str, load_balance: bool) -> torch.Tensor:
    """Ring attention of this rank's q/k/v shards over ``group``; backward rings too."""
    out, _ = _ring_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), group.group_name, backend,
                                is_causal, scale, rotate_method, load_balance)
    return out
