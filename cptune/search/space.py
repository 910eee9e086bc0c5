"""The search space: every configuration that can be valid for a workload on a world of ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CPConfig
from ..validate import backend_problem
from .workload import Workload

ROTATE_METHODS = ("allgather", "alltoall")


def mesh_shapes(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, cp) with dp * cp == world_size, most context-parallel first."""
    return [(world_size // cp, cp) for cp in range(world_size, 0, -1) if world_size % cp == 0]


def usable_backends(device_type: str, dtype: torch.dtype) -> list[str]:
    """Backends that can ring-attend on this device and dtype, in PyTorch's priority order."""
    return [b for b in ("flash", "efficient", "cudnn") if backend_problem(device_type, b, dtype, ring=True) is None]


def canonical(config: CPConfig) -> CPConfig:
    """The same configuration written one way: with cp == 1, rotate method and load balancing don't apply."""
    if config.mesh_shape and config.mesh_shape[1] == 1:
        return config.model_copy(update={"rotate_method": "allgather", "load_balance": False})
    return config


def config_key(config: CPConfig) -> str:
    c = canonical(config)
    dp, cp = c.mesh_shape
    return f"dp{dp}-cp{cp}-{c.rotate_method}-{'lb' if c.load_balance else 'nolb'}-{'+'.join(c.sdpa_backend)}"


@dataclass(frozen=True)
class Axis:
    """The four search dimensions, as Optuna categorical choices."""

    mesh: tuple[str, ...]
    rotate_method: tuple[str, ...]
    sdpa_backend: tuple[str, ...]
    load_balance: tuple[bool, ...]

    def as_dict(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.__dict__.items()}

    @property
    def size(self) -> int:
        return len(self.mesh) * len(self.rotate_method) * len(self.sdpa_backend) * len(self.load_balance)


def axes(workload: Workload, world_size: int, device_type: str) -> Axis:
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return Axis(
        mesh=tuple(f"{dp}x{cp}" for dp, cp in mesh_shapes(world_size)),
        rotate_method=ROTATE_METHODS,
        sdpa_backend=tuple(backends),
        load_balance=(True, False) if workload.causal else (False,),
    )


def config_from(params: dict) -> CPConfig:
    dp, cp = (int(x) for x in params["mesh"].split("x"))
    return canonical(CPConfig(mesh_shape=(dp, cp), rotate_method=params["rotate_method"],
                              sdpa_backend=(params["sdpa_backend"],), load_balance=bool(params["load_balance"])))


def invalid_reason(workload: Workload, config: CPConfig, device_type: str) -> str | None:
    """Why ``config`` can never run this workload, or None when it can."""
    dp, cp = config.mesh_shape
    s = workload.seq_len
    if s % cp:
        return f"sequence length {s} is not divisible by cp={cp}"
    if cp > 1 and config.load_balance is True and s % (2 * cp):
        return f"load balancing needs the sequence length {s} divisible by 2*cp={2 * cp}"
    if config.load_balance is True and not workload.causal:
        return "load balancing applies only to causal attention"
    ring = cp > 1
    why = backend_problem(device_type, config.sdpa_backend[0], workload.torch_dtype, ring=ring)
    return f"sdpa_backend {config.sdpa_backend[0]}: {why}" if why else None


def all_configs(workload: Workload, world_size: int, device_type: str) -> list[CPConfig]:
    """Every distinct valid configuration (the exhaustive oracle's list)."""
    seen, out = set(), []
    ax = axes(workload, world_size, device_type)
    for mesh in ax.mesh:
        for rotate in ax.rotate_method:
            for backend in ax.sdpa_backend:
                for lb in ax.load_balance:
                    c = config_from({"mesh": mesh, "rotate_method": rotate, "sdpa_backend": backend,
                                     "load_balance": lb})
                    key = config_key(c)
                    if key not in seen and invalid_reason(workload, c, device_type) is None:
                        seen.add(key)
                        out.append(c)
    return out


def pytorch_default(workload: Workload, world_size: int, device_type: str) -> CPConfig:
    """What PyTorch does untuned: allgather, load balancing on (when possible), its backend order, cp = world."""
    backend = usable_backends(device_type, workload.torch_dtype)[:1] or ["flash"]
    lb = workload.causal and workload.seq_len % (2 * world_size) == 0
    return CPConfig(mesh_shape=(1, world_size), rotate_method="allgather", sdpa_backend=tuple(backend),
                    load_balance=lb)
