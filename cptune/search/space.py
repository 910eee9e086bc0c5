"""The search space: every configuration that can be valid for a workload on a world of ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import CPConfig, decide_load_balance
from ..plan import AC_MODES, ROTATE_METHODS, configurations, expert_degrees, mesh_shapes, meshes, \
    mixer_choices, model_limits, strategies, tp_degrees as degrees, usable_backends  # noqa: F401 (benchmarks.run's)
from ..workload import Workload


@dataclass(frozen=True)
class Axis:
    """The search dimensions, as Optuna categorical choices; ``ac`` only with ``--ac auto``; ``mixers`` only for a
    ``--model`` with layers that mix tokens outside attention a split path runs (split against whole); ``ep`` only for
    a ``--model`` whose grouped experts split (:func:`cptune.plan.expert_degrees`)."""

    mesh: tuple[str, ...]
    strategy: tuple[str, ...]
    rotate_method: tuple[str, ...]
    sdpa_backend: tuple[str, ...]
    load_balance: tuple[bool, ...]
    ac: tuple[str, ...] = ()
    mixers: tuple[str, ...] = ()
    ep: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.__dict__.items() if v}

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.as_dict().values())


def tp_degrees(workload: Workload, nproc_per_node: int, world_size: int, max_tp: int) -> tuple[int, ...]:
    """The tensor-parallel degrees a search tries: 1, and for a ``--model`` workload each degree the world takes
    inside a node up to ``max_tp`` (:func:`cptune.plan._space.tp_degrees`, as the plan's) that the model's own TP plan can
    split (:func:`cptune.models.tp_problems`: its styles, heads, key/value heads and intermediate size)."""
    if max_tp == 1 or workload.model is None:
        return (1,)
    return model_limits(workload, degrees(world_size, nproc_per_node, max_tp))[0]


def axes(workload: Workload, world_size: int, device_type: str, tp: tuple[int, ...] = (1,)) -> Axis:
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return Axis(
        mesh=tuple("x".join(map(str, shape)) for shape in meshes(world_size, tp)),
        strategy=strategies(world_size),
        rotate_method=ROTATE_METHODS,
        sdpa_backend=tuple(backends),
        load_balance=(True, False) if workload.causal else (False,),
        ac=AC_MODES if workload.ac == "auto" else (),
        mixers=mixer_choices(workload),
        ep=expert_degrees(workload, world_size),
    )


def all_configs(workload: Workload, world_size: int, device_type: str, tp: tuple[int, ...] = (1,)) -> list[CPConfig]:
    """Every distinct valid configuration (the exhaustive oracle's list)."""
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return configurations(workload, world_size, tuple(backends), device_type, tp,
                          mixers=mixer_choices(workload), ep=expert_degrees(workload, world_size))[0]


def pytorch_default(workload: Workload, world_size: int, device_type: str) -> CPConfig:
    """What PyTorch does untuned: allgather, load balancing on (when possible), its backend order, cp = world."""
    backend = usable_backends(device_type, workload.torch_dtype)[:1] or ["flash"]
    lb = decide_load_balance("auto", causal=workload.causal, cp=world_size, ring=world_size,
                             seq_len=workload.seq_len).on
    return CPConfig(mesh_shape=(1, world_size), rotate_method="allgather", sdpa_backend=tuple(backend),
                    load_balance=lb)
