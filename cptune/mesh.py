"""The named mesh: ``dp_replicate x dp_shard x cp x tp``, the four ways a job's ranks split its work.

torchtitan's ``ParallelDims`` and accelerate's ``ParallelismConfig`` name the same axes. Ranks are laid out
row-major in that order, so ``tp`` is innermost (its ranks are neighbours: one node) and ``dp_replicate``
outermost (across nodes, where HSDP only reduces gradients):

- ``dp_replicate``, ``dp_shard``: data parallelism, each replica its own rows of the global batch; FSDP2
  shards the model over ``dp_shard x cp`` and replicates it over ``dp_replicate``.
- ``cp``: context parallelism, each rank its slice of the sequence (the block shards buffers over it only).
- ``tp``: tensor parallelism, each rank its share of every layer's heads and columns; the tp ranks of a
  replica hold the same tokens and the same rows.
- ``ep``: expert parallelism, folded over ``dp_shard x cp`` as torchtitan and Megatron-Core fold it (not a dim of
  its own: it multiplies nothing): each MoE layer's experts split over groups of ``ep`` consecutive ranks
  (:mod:`cptune.experts`), every other parameter as above.

A configuration written as ``(dp, cp)`` (every recipe before the named mesh) is ``(1, dp, cp, 1)``.
"""

from __future__ import annotations

import atexit
import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _collectives, _torch_cp
from . import attention as A
from .errors import Problem, ValidationError, raise_if

DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dims, outermost first: the one list."""
MODEL_DIMS = ("dp_replicate", "dp_shard_cp", "tp")
"""The dims of the mesh a model's parameters live on (:meth:`ParallelDims.model_mesh`): FSDP2 shards over dp_shard x
cp flattened, HSDP replicates over dp_replicate, TP splits over tp."""
DATA_DIMS = ("dp_replicate", "dp_shard", "dp")
"""Names a device mesh's data-parallel dims may carry ('dp': the (dp, cp) mesh cptune built before the named mesh,
and a user's; read as dp_shard)."""


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dim of the mesh has, and ``ep`` folded over dp_shard x cp. Checked at construction: every
    degree a positive integer, and an ep the mesh can fold (:func:`ep_problems`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        raise_if([Problem(f"mesh.{f.name}", f"is {getattr(self, f.name)!r}", "give a positive integer")
                  for f in fields(self) if type(getattr(self, f.name)) is not int or getattr(self, f.name) < 1])
        raise_if(ep_problems(self.shape, self.ep))

    @classmethod
    def from_shape(cls, shape: Sequence[int] | None, world: int, argument: str = "config.mesh_shape", ep: int = 1
                   ) -> ParallelDims:
        """The mesh of ``world`` ranks a configuration's ``mesh_shape`` asks for: None (every rank CP), ``(dp, cp)``
        or ``(dp_replicate, dp_shard, cp, tp)``, one entry possibly -1 (inferred), and ``ep`` folded over it. Raises
        a ValidationError naming ``argument`` when the degrees do not multiply to the world."""
        if shape is None:
            return cls(cp=world, ep=ep)
        values = list(full_shape(shape))
        known = math.prod(v for v in values if v != -1)
        if -1 in values and known and world % known == 0:
            values[values.index(-1)] = world // known
        if math.prod(values) != world or min(values) < 1:
            raise ValidationError([Problem(argument, f"{tuple(shape)} does not multiply to the world size {world}",
                                           _shape_fix(len(shape), world))])
        return cls(*values, ep=ep)

    @classmethod
    def of_mesh(cls, mesh: Any) -> tuple[ParallelDims, list[Problem]]:
        """The dims of a user's device mesh: a 1-D mesh is all CP; otherwise its dims are named from
        :data:`DIM_NAMES` ('dp' read as dp_shard), one of them 'cp'. Problems name what cannot be read."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return cls(cp=mesh.size()), []
        unknown = [n for n in names if n not in DIM_NAMES and n != "dp"] if names else ["(unnamed)"]
        if "cp" not in names or unknown or len(set(names)) != len(names):
            return cls(), [Problem("mesh", f"has {mesh.ndim} dims named {names or None}", "name the dims from "
                                   "dp_replicate, dp_shard (or dp), cp and tp, one of them 'cp', each once; "
                                   "pipeline stages are not a cptune dim: pass the mesh of one stage")]
        if "dp" in names and "dp_shard" in names:
            return cls(), [Problem("mesh", f"names both 'dp' and 'dp_shard' {names}", "name the data-parallel "
                                   "dims dp_replicate and dp_shard (or one dim dp)")]
        size = dict(zip(names, mesh.mesh.shape))
        return cls(size.get("dp_replicate", 1), size.get("dp_shard", size.get("dp", 1)), size["cp"],
                   size.get("tp", 1)), []

    # -- what the mesh is ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each has its own rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_dp_cp(self) -> bool:
        """Whether this is the (dp, cp) mesh of every configuration before the named mesh (no tp, no HSDP)."""
        return self.tp == 1 and self.dp_replicate == 1

    def replica(self, rank: int) -> int:
        """The data-parallel replica of global ``rank`` (row-major: the cp x tp ranks of a replica are neighbours)."""
        return rank // (self.cp * self.tp)

    def label(self) -> str:
        """'dp2·cp4', 'dp1·cp2·tp2', 'dpr2·dp2·cp2·tp2', 'dp2·cp2 ep4': the (dp, cp) mesh's label as before, tp and
        HSDP when used, ep (folded: it multiplies nothing) when above 1."""
        return shape_label(self.shape) + (f" ep{self.ep}" if self.ep > 1 else "")

    # -- what it can run -----------------------------------------------------------------------
    def model_problems(self, *, heads: int | None = None, kv_heads: int | None = None,
                       intermediate: int | None = None, ulysses: int = 1, argument: str = "mesh.tp") -> list[Problem]:
        """Why a model cannot be split by this mesh's tp (and a Ulysses degree over the heads each tp rank holds):
        every problem at once."""
        problems = []
        for what, count in (("query heads", heads), ("key/value heads", kv_heads),
                            ("intermediate size", intermediate)):
            if count is not None and count % self.tp:
                problems.append(Problem(argument, f"{self.tp} does not divide the {count} {what}",
                                        f"use a tp that divides {count}"))
        if heads is not None and ulysses > 1 and self.tp == 1 and heads % ulysses:
            problems.append(Problem("config.ulysses_degree", f"{heads} heads do not divide among {ulysses} Ulysses "
                                    "ranks", "use a Ulysses degree that divides the heads, or the ring"))
        elif heads is not None and ulysses > 1 and heads % self.tp == 0 and (heads // self.tp) % ulysses:
            problems.append(Problem("config.ulysses_degree", f"{ulysses} Ulysses ranks do not divide the "
                                    f"{heads // self.tp} query heads each of tp={self.tp} ranks holds ({heads} in all)",
                                    "use a Ulysses degree that divides the heads of one tp rank, or the ring"))
        return problems

    def sequence_problems(self, seq_len: int, argument: str = "seq_len") -> list[Problem]:
        """Why ``seq_len`` tokens cannot split over this mesh with tp: sequence parallelism splits each cp rank's
        tokens over the tp ranks, so cp x tp must divide them."""
        if self.tp > 1 and seq_len % (self.cp * self.tp):
            return [Problem(argument, f"{seq_len} tokens do not split over cp={self.cp} x tp={self.tp} ranks "
                            "(sequence parallelism splits each cp rank's tokens over tp)",
                            f"use a sequence length divisible by {self.cp * self.tp}")]
        return []

    def node_warning(self, ranks_per_node: int | None) -> str | None:
        """What to say when tp crosses nodes (allowed, and priced by the plan; slow: every layer reduces over it)."""
        if ranks_per_node is None or ranks_per_node % self.tp == 0:
            return None
        return (f"tp={self.tp} spans more than one node of {ranks_per_node} ranks: every layer's reductions "
                "cross the inter-node link; use a tp that divides the ranks per node")

    def device_mesh(self, device_type: str) -> Any:
        """The torch DeviceMesh over the world: ('dp', 'cp') as before for a (dp, cp) mesh, else all four named
        dims (size-1 dims included, so every name is there to index). A collective: every rank calls it."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.is_dp_cp:
            return init_device_mesh(device_type, (self.dp_shard, self.cp), mesh_dim_names=("dp", "cp"))
        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)

    def model_mesh(self, device_type: str) -> Any:
        """The mesh a model's parameters live on, over the same ranks in the same order: (dp_replicate, dp_shard x cp,
        tp) named :data:`MODEL_DIMS` (for ``cptune.models.build_model``'s ``fsdp_mesh``). A collective."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard * self.cp, self.tp),
                                mesh_dim_names=MODEL_DIMS)


def ep_problems(shape: Sequence[int], ep: int, argument: str = "config.ep_degree") -> list[Problem]:
    """Why a mesh of degrees ``shape`` (dp_replicate, dp_shard, cp, tp) cannot fold ``ep`` over its dp_shard x cp
    ranks: the one rule the mesh, the search's space, the plan and ``build_model`` apply."""
    dpr, dps, cp, tp = shape
    name = argument.rsplit(".", 1)[-1]  # ep_degree of a configuration, ep of build_model
    if ep <= 1:
        return []
    if tp > 1 or dpr > 1:
        return [Problem(argument, f"is {ep} on {shape_label(shape)}", f"use {name}=1 with tp or dp_replicate, or "
                        "a (dp, cp) mesh with ep: experts beside tensor parallelism and HSDP are not built yet")]
    if (dps * cp) % ep:
        return [Problem(argument, f"is {ep}, which does not divide the {dps * cp} ranks of dp_shard x cp",
                        f"use an {name} that divides {dps * cp}")]
    return []


def full_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A mesh_shape as its four degrees, outermost first ((dp, cp) is (1, dp, cp, 1)); -1 stays -1."""
    return tuple(shape) if len(shape) == len(DIM_NAMES) else (1, shape[0], shape[1], 1)


def shape_label(shape: Sequence[int]) -> str:
    """A mesh's label from its degrees ('N' for one not yet inferred): tp and dp_replicate shown when not 1."""
    dpr, dps, cp, tp = (str(v) if v > 0 else "N" for v in full_shape(shape))
    return ("" if dpr == "1" else f"dpr{dpr}·") + f"dp{dps}·cp{cp}" + ("" if tp == "1" else f"·tp{tp}")


def data_dims(mesh: Any) -> list[str]:
    """The names of a named device mesh's data-parallel dims, outermost first."""
    return [n for n in (mesh.mesh_dim_names or ()) if n in DATA_DIMS] if mesh.ndim > 1 else []


def data_rank(mesh: Any) -> int:
    """This rank's data-parallel replica in ``mesh``: its coordinates in the data dims, row-major."""
    index = 0
    for name in data_dims(mesh):
        index = index * mesh[name].size() + mesh.get_local_rank(name)
    return index


def data_groups(mesh: Any) -> list[Any]:
    """The process groups of ``mesh``'s data-parallel dims with more than one rank: a sum over each in turn is
    the sum over every replica (one group per dim: no flattened mesh needed)."""
    return [mesh.get_group(name) for name in data_dims(mesh) if mesh[name].size() > 1]


def _shape_fix(length: int, world: int) -> str:
    if length == len(DIM_NAMES):
        return (f"use (dp_replicate, dp_shard, cp, tp) whose product is {world}, e.g. (1, 1, {world}, 1), "
                "or -1 for one of them to infer it")
    return f"use a (dp, cp) with dp * cp == {world}, e.g. (1, {world}), or -1 for one of them to infer it"


__all__ = ["DIM_NAMES", "ParallelDims"]


# -- the meshes cptune builds (reused: building one is a collective), and their release --------------------
_MESHES: dict[tuple, DeviceMesh] = {}  # meshes cptune built, reused: building one is a collective


def release_groups() -> None:
    """Forget every mesh and group cptune built, so that nothing of cptune's keeps a process group alive,
    and empty DTensor's sharding caches, which hold the meshes of every DTensor op an FSDP2 model ran.

    A gloo group's C++ object outlives :func:`torch.distributed.destroy_process_group` while anything still
    refers to it (these caches did), and is then freed during interpreter finalization: its worker thread,
    dropping its last finished work, needs the GIL of an interpreter being torn down and aborts the
    process ("terminate called without an active exception"). Freed here, its threads are joined while
    the interpreter is alive. Also called at exit, so a script that destroys its own group is covered."""
    _MESHES.clear()
    A.release_groups()
    _collectives.release_groups()
    _torch_cp.clear_sharding_caches()
    gc.collect()


atexit.register(release_groups)


def built_mesh(key: tuple, make) -> DeviceMesh:
    """The mesh cptune built for ``key`` (device type, what, the process group), made by ``make()`` the first time."""
    if key not in _MESHES:
        _MESHES[key] = make()
    return _MESHES[key]


def world_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank (FSDP2 over the flattened dp x cp ranks), built once per process group."""
    key = (device_type, "world", id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_cp",))
    return _MESHES[key]


def model_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh a model's parameters live on (:meth:`ParallelDims.model_mesh`), built once per process group."""
    key = (device_type, "model", dims, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = dims.model_mesh(device_type)
    return _MESHES[key]
