"""The boundary to PyTorch's private code: every private torch name cptune uses is reached here.

PyTorch ships context parallelism as a prototype whose internals move between releases
(``torch.distributed.tensor.experimental._attention`` became a package
``..._context_parallel`` in 2.9). Everything cptune needs from it is imported here, with
feature detection, so a torch release that moves things costs this one file:

* ``_templated_ring_attention`` / ``_templated_ring_attention_backward``: the ring
  algorithm (rotation, load-balanced causal blocks, log-sum-exp merging) over any SDPA op
  that returns ``(out, logsumexp, ...)``; :func:`templated_ring_forward` / ``_backward`` call them;
* ``_cp_options``: the process-global rotate method and load-balance flag, which the ring
  functions read while they run. cptune never leaves them changed: :func:`cp_options`
  sets them for the duration of one ring call (forward or backward) and restores them.

The other private torch calls cptune makes, one function each: :func:`resolve_group` (a
process group from its name, as torch's compile-friendly collectives pass it),
:func:`in_backward` (whether autograd is running a backward pass), :func:`sdp_priority_order`
(SDPA's backend order), :func:`use_count` (how many references hold a tensor's storage),
:func:`clear_sharding_caches` (DTensor's sharding caches, which hold meshes and so process groups) and
:func:`registered_groups` (every process group of this process), and :func:`not_compiled` (``torch.compiler.disable``
made at the first call: importing dynamo, which that decorator does, is about a second of every cptune process).

And torch's private SDPA kernels (``aten._scaled_dot_product_*`` and their backwards), whose positional
signatures and returned layouts change between releases, are called only here: :func:`ring_forward` /
:func:`ring_backward` run them under torch's ring, :func:`kernel_forward` / :func:`kernel_backward` run one
block, each with one signature for every kernel. :func:`is_view` reads a tensor's ``_base``.

What runs over these kernels lives in :mod:`cptune.attention`: the backends and the block kernels'
dispatch in ``attention/_kernels.py``, the ring's custom ops in ``attention/_ring.py``. Benchmarks reach
torch's module through :func:`require_cp`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist

from ._deps import FLOORS, version_tuple
from .errors import CPTuneError

MIN_TORCH = version_tuple(FLOORS["torch"])[:2]
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
    return version_tuple(torch.__version__)[:2]


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


class _OneGroupMesh:
    """What an older ring function reads of a 1-D device mesh (torch 2.7's backward takes ``mesh``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def get_group(self) -> dist.ProcessGroup:
        return self._group


def _group_argument(fn: Callable[..., Any], group: dist.ProcessGroup) -> Any:
    """The group as ``fn`` takes it: itself (its first parameter is ``group``), or as a one-group mesh."""
    first = next(iter(inspect.signature(fn).parameters), "group")
    return _OneGroupMesh(group) if first == "mesh" else group


def templated_ring_forward(group: dist.ProcessGroup, op: Callable[..., Any], **kwargs: Any) -> Any:
    """torch's ring forward over ``op`` (q, k, v by keyword; sequence dim 2)."""
    fn = require_cp()._templated_ring_attention
    return fn(_group_argument(fn, group), 2, op, **kwargs)


def templated_ring_backward(group: dist.ProcessGroup, op: Callable[..., Any], grad_out: torch.Tensor,
                            grad_out_name: str, **kwargs: Any) -> Any:
    """torch's ring backward over ``op``: (dq, dk, dv, ...)."""
    fn = require_cp()._templated_ring_attention_backward
    return fn(_group_argument(fn, group), 2, op, grad_out=grad_out, grad_out_name=grad_out_name, **kwargs)


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (custom ops carry groups by name)."""
    return dist.distributed_c10d._resolve_process_group(name)


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (e.g. an activation checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def sdp_priority_order() -> list[int]:
    """SDPA's current backend priority, as ``SDPBackend`` values."""
    return list(torch._C._get_sdp_priority_order())


def use_count(t: torch.Tensor) -> int:
    """How many references the tensor's storage object has (autograd's saved copies included)."""
    counter = getattr(t, "_use_count", None)
    return counter() if counter is not None else 0


def clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches (the Python one and the C++ fast path's). Every DTensor op
    an FSDP2 model ran is cached there with its specs, so their meshes, and the process groups those hold,
    live as long as the cache: to the interpreter's teardown."""
    try:  # what torch.distributed.tensor.debug._clear_sharding_prop_cache does, without importing that package
        # (its debug tools import inductor and dynamo: a second of every process's exit, DTensor used or not)
        from torch.distributed.tensor._api import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        torch._C._clear_DTensor_sharding_propagator_cache()
        return
    except (ImportError, AttributeError):  # moved in another release: torch's own entry point
        pass
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without DTensor's caches: nothing held
        return
    _clear_sharding_prop_cache()


COMPILER = "torch._dynamo"
"""What :func:`not_compiled` imports at its first call: a fork server imports it once for all the ranks it forks."""


def not_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, the same to torch.compile (a graph break, or fullgraph's error), with dynamo
    imported at ``fn``'s first call rather than as cptune is imported (torch's own lazy form of it)."""
    return torch._compile._disable_dynamo(fn)


def registered_groups() -> list[weakref.ref]:
    """Every process group this process made (the default one and each subgroup), weakly held."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    return [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]


def keep_to_the_end(group: dist.ProcessGroup) -> None:
    """One reference to ``group`` that is never dropped: the interpreter's teardown, which frees what its
    modules held, never frees it (freed there, a gloo group joins worker threads that need the GIL of an
    interpreter being torn down, and the process aborts). The process's exit ends its idle threads."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage."""
    return t._base is not None


# -- torch's private SDPA kernels ---------------------------------------------------------------------------
# A kernel is named (device type, backend): ("cpu", "flash") is the CPU flash kernel, ("cuda", name) the
# CUDA flash / efficient / cuDNN kernels. Forward returns (out, saved), saved[0] the log-sum-exp.

_aten = torch.ops.aten
_CUDA_KERNELS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}


def expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value repeated so each query head has its own (grouped-query attention); as given otherwise."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def fold_kv_grads(dk: torch.Tensor, dv: torch.Tensor, key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded key/value gradients summed back onto their own ``key_heads`` heads (in float32; float64 stays)."""
    if dk.shape[1] == key_heads:
        return dk, dv
    acc = torch.float64 if dk.dtype == torch.float64 else torch.float32
    return dk.unflatten(1, (key_heads, -1)).sum(2, dtype=acc), dv.unflatten(1, (key_heads, -1)).sum(2, dtype=acc)


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


def has_cuda_kernel(backend: str) -> bool:
    """Whether this torch has the CUDA kernel ``backend`` (flash / efficient / cudnn) and its backward."""
    name = _CUDA_KERNELS[backend]
    return hasattr(_aten, name) and hasattr(_aten, name + "_backward")


def ring_forward(kernel: tuple[str, str], group: dist.ProcessGroup, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, tuple]:
    """torch's ring forward over ``kernel`` (grouped-query key/value expanded per call): (out, saved)."""
    device_type, backend = kernel
    common = dict(query=q, key=k, value=v, is_causal=is_causal, dropout_p=0.0, scale=scale)
    if device_type == "cpu":
        out, lse = templated_ring_forward(group, _gqa(_aten._scaled_dot_product_flash_attention_for_cpu.default),
                                          **common)[:2]
        return out, (lse,)
    if backend == "efficient":
        res = templated_ring_forward(group, _gqa(_aten._scaled_dot_product_efficient_attention), attn_bias=None,
                                     compute_log_sumexp=True, **common)
        return res[0], tuple(res[1:4])  # (lse, philox_seed, philox_offset)
    if backend == "cudnn":
        res = templated_ring_forward(group, _gqa(_aten._scaled_dot_product_cudnn_attention), attn_bias=None,
                                     compute_log_sumexp=True, return_debug_mask=False, **common)
    else:
        res = templated_ring_forward(group, _gqa(_aten._scaled_dot_product_flash_attention), **common)
    # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
    return res[0], tuple(res[1:8])


def ring_backward(kernel: tuple[str, str], group: dist.ProcessGroup,
                  grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  saved: tuple, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    """torch's ring backward over ``kernel`` (key/value gradients folded back per call): (dq, dk, dv)."""
    device_type, backend = kernel
    grad_out = grad_out.contiguous()
    common = dict(query=q, key=k, value=v, is_causal=is_causal, dropout_p=0.0, scale=scale)
    if device_type == "cpu":
        (lse,) = saved
        op, name = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out"
        extra: dict[str, Any] = dict(out=out, logsumexp=lse)
    elif backend == "efficient":
        lse, seed, offset = saved
        op, name = _aten._scaled_dot_product_efficient_attention_backward.default, "grad_out_"
        extra = dict(attn_bias=None, out=out.transpose(1, 2).contiguous().transpose(1, 2),  # the kernel's layout
                     logsumexp=lse, philox_seed=seed, philox_offset=offset, grad_input_mask=(True, True, True, False))
    else:
        lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
        op = (_aten._scaled_dot_product_cudnn_attention_backward if backend == "cudnn"
              else _aten._scaled_dot_product_flash_attention_backward).default
        name = "grad_out"
        extra = dict(out=out, logsumexp=lse, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k,
                     philox_seed=seed, philox_offset=offset)
        if backend == "cudnn":
            extra["attn_bias"] = None
    return templated_ring_backward(group, _gqa_backward(op), grad_out, name, **common, **extra)[:3]


def kernel_forward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one call of the kernel (the CPU flash kernel on CPU, ``backend`` on CUDA), lse (B, H, L);
    ``bias``: an additive mask (the CPU kernel only)."""
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if backend == "efficient":
        out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[-2]].float()
    if backend == "cudnn":
        res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[:-1]).float()
    out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.float()


def kernel_backward(backend: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, bias: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of one call of the kernel :func:`kernel_forward` ran, given its out and lse (B, H, L)."""
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)[:3]
    grad_out, out = grad_out.contiguous(), out.contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    if backend == "efficient":
        padded = torch.nn.functional.pad(lse, (0, -q.shape[-2] % 32))  # the kernel's own padded length
        return _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out.transpose(1, 2).contiguous().transpose(1, 2), padded, seed, seed, 0.0,
            (True, True, True, False), causal, scale=scale)[:3]
    if backend == "cudnn":
        return _aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, q.shape[-2], k.shape[-2], 0.0,
            causal, scale=scale)[:3]
    return _aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, seed, scale=scale)[:3]
