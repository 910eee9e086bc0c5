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
:func:`registered_groups` (every process group of this process).

The kernels that run over the ring live in :mod:`cptune._kernels`, the ring's custom ops in
:mod:`cptune._ring`. Benchmarks reach torch's module through :func:`require_cp`.
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
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without DTensor's caches: nothing held
        return
    _clear_sharding_prop_cache()


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
