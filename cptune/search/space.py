"""The search space: every configuration that can be valid for a workload on a world of ranks."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..config import CPConfig, decide_load_balance
from ..validate import backend_problem
from ..workload import Workload

ROTATE_METHODS = ("allgather", "alltoall")


def strategies(world_size: int) -> tuple[str, ...]:
    """'ring', 'ulysses', and 'hybrid-u<k>' for each Ulysses group size k that leaves a ring of 2 or more."""
    hybrids = [f"hybrid-u{u}" for u in range(2, world_size // 2 + 1) if world_size % u == 0 and world_size // u >= 2]
    return ("ring", "ulysses", *hybrids)


def mesh_shapes(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, cp) with dp * cp == world_size, most context-parallel first."""
    return [(world_size // cp, cp) for cp in range(world_size, 0, -1) if world_size % cp == 0]


def usable_backends(device_type: str, dtype: torch.dtype) -> list[str]:
    """Backends that can ring-attend on this device and dtype, in PyTorch's priority order."""
    return [b for b in ("flash", "efficient", "cudnn") if backend_problem(device_type, b, dtype, ring=True) is None]


def canonical(config: CPConfig) -> CPConfig:
    """The same configuration written one way: with cp == 1 the strategy, rotate method and load
    balancing don't apply; under Ulysses the rotate method and load balancing don't."""
    if config.mesh_shape and config.mesh_shape[1] == 1:
        return config.model_copy(update={"rotate_method": "allgather", "load_balance": False, "strategy": "ring",
                                         "ulysses_degree": None})
    if config.strategy == "ulysses":
        return config.model_copy(update={"rotate_method": "allgather", "load_balance": False})
    return config


def config_key(config: CPConfig) -> str:
    c = canonical(config)
    dp, cp = c.mesh_shape
    backend = "+".join(c.sdpa_backend)
    if c.strategy == "ulysses":
        return f"dp{dp}-cp{cp}-ulysses-{backend}"
    strategy = f"hybrid{c.ulysses_degree}-" if c.strategy == "hybrid" else ""  # ring keys as before strategies
    return f"dp{dp}-cp{cp}-{strategy}{c.rotate_method}-{'lb' if c.load_balance else 'nolb'}-{backend}"


@dataclass(frozen=True)
class Axis:
    """The five search dimensions, as Optuna categorical choices."""

    mesh: tuple[str, ...]
    strategy: tuple[str, ...]
    rotate_method: tuple[str, ...]
    sdpa_backend: tuple[str, ...]
    load_balance: tuple[bool, ...]

    def as_dict(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.__dict__.items()}

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.__dict__.values())


def axes(workload: Workload, world_size: int, device_type: str) -> Axis:
    backends = usable_backends(device_type, workload.torch_dtype) or ["flash"]
    return Axis(
        mesh=tuple(f"{dp}x{cp}" for dp, cp in mesh_shapes(world_size)),
        strategy=strategies(world_size),
        rotate_method=ROTATE_METHODS,
        sdpa_backend=tuple(backends),
        load_balance=(True, False) if workload.causal else (False,),
    )


def config_from(params: dict) -> CPConfig:
    dp, cp = (int(x) for x in params["mesh"].split("x"))
    strategy, _, u = params.get("strategy", "ring").partition("-u")
    lb = bool(params["load_balance"]) and strategy != "ulysses"
    return canonical(CPConfig(mesh_shape=(dp, cp), strategy=strategy, ulysses_degree=int(u) if u else None,
                              rotate_method=params["rotate_method"], sdpa_backend=(params["sdpa_backend"],),
                              load_balance=lb))


def invalid_reason(workload: Workload, config: CPConfig, device_type: str) -> str | None:
    """Why ``config`` can never run this workload, or None when it can."""
    dp, cp = config.mesh_shape
    s = workload.seq_len
    split = config.degree_problems(cp)
    if split:
        return f"{config.strategy} with ulysses_degree={config.ulysses_degree} does not split cp={cp}"
    ulysses, ring = config.degrees(cp)
    if s % cp:
        return f"sequence length {s} is not divisible by cp={cp}"
    balance = decide_load_balance(config.load_balance, causal=workload.causal, cp=cp, ring=ring, seq_len=s)
    if balance.problems:
        return balance.problems[0].message
    if ulysses > 1 and workload.heads % ulysses:
        return f"{workload.heads} heads do not divide among {ulysses} Ulysses ranks"
    why = backend_problem(device_type, config.sdpa_backend[0], workload.torch_dtype, ring=ring > 1)
    return f"sdpa_backend {config.sdpa_backend[0]}: {why}" if why else None


def all_configs(workload: Workload, world_size: int, device_type: str) -> list[CPConfig]:
    """Every distinct valid configuration (the exhaustive oracle's list)."""
    seen, out = set(), []
    ax = axes(workload, world_size, device_type)
    names = list(ax.as_dict())
    for point in itertools.product(*ax.as_dict().values()):
        c = config_from(dict(zip(names, point)))
        key = config_key(c)
        if key not in seen and invalid_reason(workload, c, device_type) is None:
            seen.add(key)
            out.append(c)
    return out


def pytorch_default(workload: Workload, world_size: int, device_type: str) -> CPConfig:
    """What PyTorch does untuned: allgather, load balancing on (when possible), its backend order, cp = world."""
    backend = usable_backends(device_type, workload.torch_dtype)[:1] or ["flash"]
    lb = decide_load_balance("auto", causal=workload.causal, cp=world_size, ring=world_size,
                             seq_len=workload.seq_len).on
    return CPConfig(mesh_shape=(1, world_size), rotate_method="allgather", sdpa_backend=tuple(backend),
                    load_balance=lb)
