"""Where figures come from: one fingerprint of this process's software and hardware.

A study is keyed by it (measurements from two environments are never ranked together) and a
recipe's provenance is written from it; both read the same facts through :func:`environment`.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

from ._version import __version__


def total_device_memory(device_type: str) -> int:
    """One GPU's memory, or this machine's RAM."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MMAP_THRESHOLD = 2**20
"""Allocations from this size on are mapped on their own and unmapped when freed (glibc's mallopt)."""


def return_freed_memory() -> None:
    """On a CPU rank (glibc): allocations of a MiB and more get pages of their own, given back when freed.

    glibc otherwise raises its mmap threshold as big blocks are freed (up to 32 MiB), after which a layer's
    gathered parameters and gradients come from the heap, and what is freed there stays in the process
    (fragmented, not trimmed): the resident size, which is how a CPU rank's peak is measured, grows to
    hundreds of MiB above what the rank holds. Set once per process, by every search rank and training
    process cptune starts (:func:`cptune.init_rank`), so the search measures the memory the
    training job will take."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)
    except (OSError, AttributeError):
        pass  # not glibc


def device_name(device_type: str) -> str:
    """The GPU's name, or the CPU model: what figures were measured on."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Environment:
    torch: str
    cptune: str
    device_type: str
    device_name: str
    nproc_per_node: int
    nnodes: int

    def study(self) -> dict[str, Any]:
        """What a study's figures depend on (part of its name's hash, checked on resume)."""
        return {"torch": self.torch, "cptune": self.cptune, "device_type": self.device_type,
                "device_name": self.device_name, "nproc_per_node": self.nproc_per_node, "nnodes": self.nnodes}

    def provenance(self) -> dict[str, Any]:
        """A recipe's provenance fields: the GPU's name, or 'cpu' (CPU models differ between equal machines)."""
        cuda = self.device_type == "cuda"
        return {"cptune_version": self.cptune, "torch_version": self.torch,
                "device": self.device_name if cuda else "cpu", "device_type": self.device_type,
                "device_count": self.nproc_per_node * self.nnodes, "backend": process_backend(self.device_type),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def process_backend(device_type: str) -> str:
    """The process group backend for ``device_type``: nccl on GPUs, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def environment(device_type: str | None = None, world_size: int | None = None,
                nproc_per_node: int | None = None) -> Environment:
    """This process's environment for ``world_size`` ranks (``nproc_per_node`` per node) on ``device_type``.

    Defaults: CUDA when a GPU is visible, else CPU; every visible GPU (or CPU core) on one node.
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if world_size is None:
        world_size = torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)
    nproc = max(1, nproc_per_node or world_size)
    return Environment(torch=torch.__version__, cptune=__version__, device_type=device_type,
                       device_name=device_name(device_type), nproc_per_node=nproc,
                       nnodes=max(1, world_size // nproc))
