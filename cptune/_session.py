"""One activation of ``cptune.context_parallel``: validation, mesh, shards, the SDPA hook, and undo."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from . import _sharding, _torch_cp
from .config import CPConfig
from .errors import CPTuneError, Problem, ValidationError, raise_if
from .validate import BufferPlan, check_buffers, check_sdpa_call, pick_backend

_SDPA = F.scaled_dot_product_attention
_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_MESHES: dict[tuple, DeviceMesh] = {}  # meshes cptune built, reused: building one is a collective
_ACTIVE: list[_Session] = []  # sessions inside a with-block / decorated call, innermost last


class CPTuneWarning(UserWarning):
    """cptune changed something it was asked to do (e.g. turned load balancing off) and says why."""


def default_backends() -> tuple[str, ...]:
    """PyTorch's SDPA priority order, as cptune backend names."""
    names = {int(v): k for k, v in _KERNELS.items()}
    return tuple(names[i] for i in torch._C._get_sdp_priority_order() if i in names)


class _SDPAMode(TorchFunctionMode):
    """Routes every F.scaled_dot_product_attention call in the block to the session's ring."""

    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.session.sdpa(*args, **kwargs)
        return func(*args, **kwargs)


class _Session:
    """One activation of a context_parallel: validated inputs, mesh, shards, and what to undo."""

    def __init__(self, config: CPConfig, causal: bool, recipe: Any = None) -> None:
        self.config, self.causal, self.recipe = config, causal, recipe
        self.dp = self.cp = 1
        self.cp_rank = 0
        self.mesh: DeviceMesh | None = None
        self.cp_mesh: DeviceMesh | None = None
        self.group: dist.ProcessGroup | None = None
        self.plan = BufferPlan()
        self.backends: tuple[str, ...] = config.sdpa_backend or default_backends()
        self.device_type = "cpu"
        self.shards: dict[str, torch.Tensor] = {}
        self._grad_buffers: dict[int, tuple[torch.Tensor, int]] = {}
        self._ring_cache: dict[tuple[str, torch.dtype], _torch_cp.RingBackend] = {}
        self._stack = contextlib.ExitStack()

    # -- setting up ------------------------------------------------------------------
    def start(self, mesh: DeviceMesh | None, buffers: Any, seq_dims: Any, no_restore: Sequence[Any],
              inplace: bool) -> _Session:
        problems = self._resolve_mesh(mesh, _first_device_type(buffers))
        if self.recipe is not None:
            problems += self._recipe_problems()
        self.plan, buffer_problems = check_buffers(
            buffers, seq_dims, cp=self.cp, load_balance=self.config.load_balance, causal=self.causal,
            device_type=self.device_type, no_restore=no_restore)
        problems += buffer_problems
        if self.plan.seq_len is None:
            self.plan.load_balance = self.config.load_balance_for(self.causal)
        dtype = next((t.dtype for t in self.plan.tensors if t.is_floating_point()), None)
        if self.config.sdpa_backend is not None:
            problems += pick_backend(self.backends, self.device_type, dtype, ring=self.cp > 1)[1]
        raise_if(problems)  # nothing has been communicated or changed yet
        if self.cp > 1:
            problem = _torch_cp.support_problem()
            if problem:
                raise CPTuneError(problem)
        self._build_mesh()
        for note in self.plan.notes:
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(note, CPTuneWarning, stacklevel=4)
        try:
            self._shard(no_restore, inplace)
            if self.config.sdpa_backend is not None:
                self._stack.enter_context(
                    sdpa_kernel([_KERNELS[b] for b in self.backends], set_priority=True))
            if self.cp > 1:
                self._stack.enter_context(_SDPAMode(self))
        except BaseException:
            self._stack.close()
            raise
        _ACTIVE.append(self)
        return self

    def _resolve_mesh(self, mesh: DeviceMesh | None, buffer_device: str | None) -> list[Problem]:
        if mesh is not None:
            if not isinstance(mesh, DeviceMesh):
                return [Problem("mesh", f"is a {type(mesh).__name__}, not a DeviceMesh",
                                "pass a torch.distributed.device_mesh.DeviceMesh or mesh=None")]
            names = mesh.mesh_dim_names or ()
            if mesh.ndim == 1:
                self.cp_mesh = mesh
            elif "cp" in names:
                self.cp_mesh = mesh["cp"]
            else:
                return [Problem("mesh", f"has {mesh.ndim} dims named {names} and none is 'cp'",
                                "pass a 1-D mesh, or name the context-parallel dim 'cp'")]
            self.mesh, self.device_type = mesh, mesh.device_type
            self.cp = self.cp_mesh.size()
            self.dp = mesh.size() // self.cp
            if self.config.mesh_shape is not None:
                try:
                    wanted = self.config.resolve_mesh_shape(mesh.size())
                except ValidationError as exc:
                    return list(exc.problems)
                if wanted != (self.dp, self.cp):
                    return [Problem("config.mesh_shape", f"{wanted} disagrees with the mesh passed "
                                    f"(dp={self.dp}, cp={self.cp})", "drop config.mesh_shape or pass mesh=None")]
            return []
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            self.dp, self.cp = self.config.resolve_mesh_shape(world)
        except ValidationError as exc:
            problems = list(exc.problems)
            if not dist.is_initialized():
                problems.append(Problem("torch.distributed", "no process group is initialized (world size 1)",
                                        "launch with torchrun and call dist.init_process_group() first"))
            return problems
        if buffer_device is not None:
            self.device_type = buffer_device
        elif dist.is_initialized() and dist.get_backend() == "nccl":
            self.device_type = "cuda"
        return []

    def _recipe_problems(self) -> list[Problem]:
        from .recipe import world_size_problems  # recipe imports the search, which imports this module

        prov = self.recipe.provenance
        problems = world_size_problems(self.recipe, dist.get_world_size() if dist.is_initialized() else 1)
        if prov.device_type != self.device_type:
            problems.append(Problem("recipe", f"was measured on {prov.device_type} but these buffers are on "
                                    f"{self.device_type}", f"run on {prov.device_type} or search again on "
                                    f"{self.device_type}"))
        return problems

    def _build_mesh(self) -> None:
        if self.cp_mesh is None and self.cp > 1:
            key = (self.device_type, self.dp, self.cp, id(dist.group.WORLD))
            if key not in _MESHES:
                _MESHES[key] = init_device_mesh(self.device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            self.mesh = _MESHES[key]
            self.cp_mesh = self.mesh["cp"]
        if self.cp_mesh is not None:
            self.group = self.cp_mesh.get_group()
            self.cp_rank = self.cp_mesh.get_local_rank()

    def _shard(self, no_restore: Sequence[Any], inplace: bool) -> None:
        lb = self.plan.load_balance
        for name, t, dim in zip(self.plan.names, self.plan.tensors, self.plan.dims):
            if self.cp == 1:
                self.shards[name] = t
            elif t.requires_grad:
                # Autograd forbids resizing such tensors: shard them where they are used.
                self._grad_buffers[id(t)] = (t, dim)
                self.shards[name] = self._local(t) if not inplace else t
            elif not inplace:
                self.shards[name] = _sharding.shard(t, dim, self.cp, self.cp_rank, lb)
            else:
                with torch.no_grad():
                    saved = t.detach()
                    t.set_(_sharding.shard(t, dim, self.cp, self.cp_rank, lb))
                if not any(t is x for x in no_restore):
                    self._stack.callback(_restore, t, saved)
                self.shards[name] = t

    # -- inside the block --------------------------------------------------------------
    def _local(self, t: Any) -> Any:
        entry = self._grad_buffers.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None or entry[0] is not t:
            return t
        return _sharding.ShardWithGrad.apply(t, entry[1], self.group, self.cp, self.cp_rank, self.plan.load_balance)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        q, k, v = self._local(query), self._local(key), self._local(value)
        full = self.plan.seq_len
        raise_if(check_sdpa_call(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 enable_gqa=enable_gqa, causal=self.causal,
                                 local_len=full // self.cp if full else None, full_len=full))
        backend = self._ring_backend(q.device.type, q.dtype)
        if q.shape[1] != k.shape[1]:  # grouped-query attention: give every query head its kv head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return _torch_cp.RingAttention.apply(
            q.contiguous(), k, v, self.group, backend, is_causal, scale, self.config.rotate_method,
            self.plan.load_balance)

    def _ring_backend(self, device_type: str, dtype: torch.dtype) -> _torch_cp.RingBackend:
        key = (device_type, dtype)
        if key not in self._ring_cache:
            name, problems = pick_backend(self.backends, device_type, dtype, ring=True)
            raise_if(problems)
            self._ring_cache[key] = _torch_cp.ring_backend(device_type, name)
        return self._ring_cache[key]

    # -- afterwards ---------------------------------------------------------------------
    def stop(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._stack.close()

    def unshard(self, tensors: Any, seq_dims: Any) -> Any:
        single = isinstance(tensors, torch.Tensor)
        items = [tensors] if single else list(tensors)
        dims = [seq_dims] * len(items) if isinstance(seq_dims, int) else list(seq_dims)
        if len(dims) != len(items):
            raise ValidationError([Problem("seq_dims", f"{len(dims)} dims for {len(items)} tensors",
                                           "give one sequence dim per tensor (or one int for all)")])
        if self.cp == 1:
            out = [t.detach() for t in items]
        else:
            out = [_sharding.gather(t.detach(), d % t.ndim, self.group, self.cp, self.plan.load_balance)
                   for t, d in zip(items, dims)]
        return out[0] if single else out


def _restore(t: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_(saved)


def _first_device_type(buffers: Any) -> str | None:
    if isinstance(buffers, torch.Tensor):
        return buffers.device.type
    values = buffers.values() if isinstance(buffers, Mapping) else buffers if isinstance(buffers, (list, tuple)) else ()
    for b in values:
        found = _first_device_type(b)
        if found is not None:
            return found
    return None
