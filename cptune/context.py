"""``cptune.context_parallel`` (context manager and decorator) and ``cptune.unshard``."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from . import _sharding, _torch_cp
from .config import SDPA_BACKENDS, ConfigLike, CPConfig, as_config
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
        launch, prov = self.recipe.launch, self.recipe.provenance
        world = dist.get_world_size() if dist.is_initialized() else 1
        problems = []
        if world != launch.world_size:
            problems.append(Problem("recipe", f"is for {launch.world_size} ranks ({launch.nnodes} node(s) x "
                                    f"{launch.nproc_per_node}) but this job has {world}",
                                    f"launch with cptune launch (it starts {launch.world_size} ranks) or use a "
                                    f"recipe searched for {world} ranks"))
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


def _recipe_for(config: ConfigLike, recipe: Any) -> Any:
    """The recipe to follow: the one given, else $CPTUNE_RECIPE when no config is given."""
    import os

    from .recipe import ENV_VAR, Recipe, load_recipe

    if recipe is not None and config is not None:
        raise ValidationError([Problem("recipe", "is given together with config",
                                       "pass either config= or recipe=, not both")])
    if recipe is None and config is None and os.environ.get(ENV_VAR):
        recipe = os.environ[ENV_VAR]
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    return load_recipe(recipe)


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


class context_parallel:  # noqa: N801 - used like a function, as torch's own context_parallel
    """Run attention context-parallel: shard ``buffers`` along ``seq_dims`` and ring every SDPA call.

    As a context manager::

        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config=cfg) as cp:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        full_out = cp.unshard(out, 2)

    Buffers that do not require grad are sharded in place (inside the block each holds this
    rank's part of the sequence) and restored on exit unless listed in ``no_restore``.
    Buffers that require grad cannot be resized, so they keep their shape and are sharded
    where SDPA consumes them; their gradients come back full-size, in original order, as
    the gradient of the mean of the CP ranks' losses (DDP's convention).

    As a decorator, ``seq_dims`` maps argument names to sequence dims and the named tensor
    arguments are sharded for each call::

        @cptune.context_parallel(seq_dims={"input_ids": 1, "labels": 1}, config=cfg)
        def train_step(model, input_ids, labels): ...

    ``recipe``: a recipe file (or :class:`cptune.recipe.Recipe`) whose configuration to use;
    with neither ``config`` nor ``recipe`` given, the recipe named by $CPTUNE_RECIPE (set by
    ``cptune launch``) is used if set. A recipe for another world size or device is an error.

    ``mesh``: a 1-D mesh, or one with a dim named "cp"; None builds a ("dp", "cp") mesh of
    ``config.mesh_shape`` over the default process group. On exit every global cptune set
    (SDPA kernel choice, torch's rotate method and load-balance flag, the SDPA hook) is back
    as it was, also when the block raises.
    """

    def __init__(self, buffers: Any = None, seq_dims: Any = None, *, config: ConfigLike = None,
                 mesh: DeviceMesh | None = None, causal: bool = True, no_restore: Sequence[Any] = (),
                 recipe: Any = None) -> None:
        self.recipe = _recipe_for(config, recipe)
        self.config = self.recipe.config if self.recipe is not None else as_config(config)
        self.buffers, self.seq_dims, self.mesh = buffers, seq_dims, mesh
        self.causal, self.no_restore = bool(causal), tuple(no_restore)
        self._session: _Session | None = None

    def _new_session(self) -> _Session:
        if self._session is not None and self._session in _ACTIVE:
            raise CPTuneError("this context_parallel is already active; it cannot be entered twice at once")
        if any(isinstance(s, _Session) for s in _ACTIVE):
            raise CPTuneError("a cptune.context_parallel block is already active in this process; "
                              "nest attention inside one block instead of opening another")
        self._session = _Session(self.config, self.causal, self.recipe)
        return self._session

    def __enter__(self) -> context_parallel:
        self._new_session().start(self.mesh, self.buffers, self.seq_dims, self.no_restore, inplace=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._session is not None
        self._session.stop()

    def __call__(self, fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        problems = []
        if self.buffers is not None:
            problems.append(Problem("buffers", "is given to the decorator form",
                                    "name the arguments to shard in seq_dims={'arg': dim, ...} instead"))
        if not isinstance(self.seq_dims, Mapping) or not self.seq_dims:
            problems.append(Problem("seq_dims", "the decorator needs a dict of argument names to sequence dims",
                                    "use seq_dims={'input_ids': 1, 'labels': 1}"))
        else:
            unknown = [n for n in self.seq_dims if n not in sig.parameters]
            if unknown:
                problems.append(Problem("seq_dims", f"names {unknown} that {fn.__name__} does not take",
                                        f"use argument names of {fn.__name__}: {list(sig.parameters)}"))
        raise_if(problems)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            named = {n: bound.arguments[n] for n in self.seq_dims if bound.arguments.get(n) is not None}
            raise_if([Problem(n, f"is a {type(t).__name__}, not a tensor",
                              f"pass a tensor for {n} or drop it from seq_dims")
                      for n, t in named.items() if not isinstance(t, torch.Tensor)])
            session = self._new_session().start(
                self.mesh, named, {n: self.seq_dims[n] for n in named}, (), inplace=False)
            try:
                for name, path in zip(named, session.plan.names):
                    bound.arguments[name] = session.shards[path]
                return fn(*bound.args, **bound.kwargs)
            finally:
                session.stop()

        return wrapper

    # -- what the block knows ---------------------------------------------------------------
    def _require(self) -> _Session:
        if self._session is None:
            raise CPTuneError("this context_parallel has not run yet; use it in a with-block or as a decorator")
        return self._session

    @property
    def cp_size(self) -> int:
        return self._require().cp

    @property
    def cp_rank(self) -> int:
        return self._require().cp_rank

    @property
    def dp_size(self) -> int:
        return self._require().dp

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._require().mesh

    @property
    def load_balance(self) -> bool:
        """Whether load balancing is really on (it can be turned off, with a warning)."""
        return self._require().plan.load_balance

    @property
    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every buffer, by its path ('buffers[0]', "buffers['labels']")."""
        return dict(self._require().shards)

    def unshard(self, tensors: Any, seq_dims: Any) -> Any:
        return self._require().unshard(tensors, seq_dims)


def unshard(tensors: Any, seq_dims: Any, *, context: context_parallel | None = None) -> Any:
    """The full tensors back from every CP rank's shard, in original order (load balancing undone).

    ``tensors``: one tensor or a list; ``seq_dims``: one int for all or one per tensor.
    ``context``: the context_parallel that sharded them; by default the active one.
    This is a collective over the CP group: call it on every rank.
    """
    if context is not None:
        return context.unshard(tensors, seq_dims)
    if not _ACTIVE:
        raise CPTuneError("cptune.unshard outside a context_parallel block needs context=: "
                          "pass the object the with-statement returned (with ... as cp)")
    return _ACTIVE[-1].unshard(tensors, seq_dims)


__all__ = ["context_parallel", "unshard", "CPTuneWarning", "default_backends", "SDPA_BACKENDS"]
