"""The meshes and groups cptune builds (reused: building one is a collective), and their release."""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _torch_cp
from . import attention as A
from .mesh import ParallelDims

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
    _torch_cp.clear_sharding_caches()
    gc.collect()


atexit.register(release_groups)


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
