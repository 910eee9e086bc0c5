"""The search space: every configuration that can be valid for a workload on a world of ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import CPConfig, decide_load_balance
from .._space import AC_MODES, ROTATE_METHODS, configurations, mesh_shapes, strategies, usable_backends
from ..workload import Workload


@dataclass(frozen=True)
class Axis:
    """The search dimensions, as Optuna categorical choices; ``ac`` only with ``--ac auto``."""

    mesh: tuple[str, ...]
    strategy: tuple[str, ...]
    rotate_method: tuple[str, ...]
    sdpa_backend: tuple[str, ...]
    load_balance: tuple[bool, ...]
    ac: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.__dict__.items() if v}

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.as_dict().values())


def axes(workload: Workload, world_size: int, device_type: str) -> Axis:
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return Axis(
        mesh=tuple(f"{dp}x{cp}" for dp, cp in mesh_shapes(world_size)),
        strategy=strategies(world_size),
        rotate_method=ROTATE_METHODS,
        sdpa_backend=tuple(backends),
        load_balance=(True, False) if workload.causal else (False,),
        ac=AC_MODES if workload.ac == "auto" else (),
    )


def all_configs(workload: Workload, world_size: int, device_type: str) -> list[CPConfig]:
    """Every distinct valid configuration (the exhaustive oracle's list)."""
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return configurations(workload, world_size, tuple(backends), device_type)[0]


def pytorch_default(workload: Workload, world_size: int, device_type: str) -> CPConfig:
    """What PyTorch does untuned: allgather, load balancing on (when possible), its backend order, cp = world."""
    backend = usable_backends(device_type, workload.torch_dtype)[:1] or ["flash"]
    lb = decide_load_balance("auto", causal=workload.causal, cp=world_size, ring=world_size,
                             seq_len=workload.seq_len).on
    return CPConfig(mesh_shape=(1, world_size), rotate_method="allgather", sdpa_backend=tuple(backend),
                    load_balance=lb)
