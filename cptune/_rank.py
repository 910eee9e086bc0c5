"""The start and end of a training process, under ``python`` or ``torchrun``: ``cptune.init_rank()`` and
``cptune.close_rank()``, as the examples and recipes' scripts call them."""

from __future__ import annotations

import os
from typing import Any

from ._env import process_backend, return_freed_memory


def init_rank() -> tuple[Any, int, int]:
    """The start of a training process, under ``python`` or ``torchrun``: (device, world size, rank).

    The device is LOCAL_RANK's GPU, else the CPU at one thread (ranks share the machine's cores);
    under torchrun (RANK set) the process group is joined, nccl on GPUs, gloo on CPU. A process that
    has joined one already keeps its settings.
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
            return_freed_memory()  # as the search's ranks do: their measured peak is this process's
        if "RANK" in os.environ:
            dist.init_process_group(process_backend(device.type))
    return (device, dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (device, 1, 0)


def close_rank() -> None:
    """The end of a process that joined a process group (:func:`init_rank`, a torchrun job, a WorkerGroup
    rank), once its last collective has returned: every mesh and group cptune built is released and the
    process group destroyed, while the interpreter is alive. Without it a gloo worker thread can outlive
    the interpreter's finalization and abort the process (exit by SIGABRT) after all its work was done.
    A process that leaves on an error or a signal should not call it: its group may hold work whose
    peers are gone (see the CLI's ``_leave``).

    Call it after the work's own function has returned, so that its model and meshes are gone. A group
    something still holds after that (torch itself keeps the default group of an FSDP2 model's training
    referenced from C++) is kept to the very end of the process instead: never freed during the
    interpreter's teardown, its threads stay idle until the process exits."""
    import torch.distributed as dist

    from . import _torch_cp
    from .mesh import release_groups

    groups = _torch_cp.registered_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release_groups()  # cptune's references dropped, then collected: the groups are freed now
    for group in (ref() for ref in groups):
        if group is not None:
            _torch_cp.keep_to_the_end(group)


__all__ = ["close_rank", "init_rank"]
