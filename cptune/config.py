"""Typed configuration users touch: :class:`CPConfig`, and the one rule for causal load balancing.

Every model validates at construction and reports *all* bad fields at once as a
:class:`cptune.ValidationError` whose lines name the field and how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .attention import SDPA_BACKENDS
from .errors import Problem, ProblemError, ValidationError
from .mesh import ParallelDims, full_shape, shape_label

ROTATE_METHODS = ("allgather", "alltoall")
"""How the ring passes key/value blocks (``config.rotate_method``): the one list."""
RotateMethod = Literal[ROTATE_METHODS]  # type: ignore[valid-type]
Strategy = Literal["ring", "ulysses", "hybrid"]
SDPABackendName = Literal[SDPA_BACKENDS]  # type: ignore[valid-type]


class StrictModel(BaseModel):
    """A frozen pydantic model whose validation errors are cptune ValidationErrors."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())  # fields named model_*

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            raise ValidationError(_problems(type(self), exc)) from None


def _problems(model: type[BaseModel], exc: pydantic.ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        error = (err.get("ctx") or {}).get("error")
        carried = getattr(error, "problem", None)
        if carried is not None:  # a validator that knows the argument and the fix (ProblemError)
            problems.append(carried)
            continue
        if isinstance(error, ValidationError):  # a nested StrictModel's own problems, named under this field
            where = ".".join(str(part) for part in err["loc"])
            problems += [p if not where or p.argument.startswith(f"{where}.") else
                         Problem(f"{where}.{p.argument}", p.message, p.fix) for p in error.problems]
            continue
        loc = [str(part) for part in err["loc"]]
        owner, field = model, None  # walk nested models down to the field the error is about
        for part in loc:
            field = owner.model_fields.get(part)
            annotation = getattr(field, "annotation", None)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                owner = annotation
            elif field is None or part != loc[-1]:
                break
        if err["type"] == "extra_forbidden":
            fix = f"remove it; {owner.__name__} accepts {', '.join(owner.model_fields)}"
        elif err["type"] == "missing":
            fix = f"add {loc[-1]} (see a recipe written by cptune search)"
        else:
            fix = (field.json_schema_extra or {}).get("fix", "see the field's documentation") if field else "check it"
        where = ".".join(loc) or model.__name__
        given = err.get("input")
        problems.append(Problem(where, f"{err['msg']} (got {given!r})", str(fix)))
    return problems


class CPConfig(StrictModel):
    """One context-parallel configuration: what ``cptune search`` chooses and recipes carry."""

    rotate_method: RotateMethod = Field(
        "allgather", json_schema_extra={"fix": "use rotate_method='allgather' or 'alltoall'"}
    )
    """How key/value shards travel between CP ranks. PyTorch's default is 'allgather'."""

    mesh_shape: tuple[int, ...] | None = Field(
        None,
        json_schema_extra={
            "fix": "give mesh_shape=(dp, cp) or (dp_replicate, dp_shard, cp, tp) with positive integers whose "
            "product is the world size, or -1 for one of them to infer it"
        },
    )
    """(dp, cp), or the whole named mesh (dp_replicate, dp_shard, cp, tp) (:class:`cptune.ParallelDims`; (dp, cp) is
    (1, dp, cp, 1)). None means every rank does context parallelism."""

    sdpa_backend: tuple[SDPABackendName, ...] | None = Field(
        None,
        json_schema_extra={
            "fix": "use one of 'flash', 'efficient', 'cudnn', 'math' or an ordered list of them"
        },
    )
    """SDPA kernels in priority order. None means PyTorch's own priority order."""

    load_balance: Literal["auto"] | bool = Field(
        "auto", json_schema_extra={"fix": "use load_balance='auto', True or False"}
    )
    """Head-tail load balancing of causal attention. 'auto': on for causal, off otherwise."""

    strategy: Strategy = Field(
        "ring", json_schema_extra={"fix": "use strategy='ring', 'ulysses' or 'hybrid'"}
    )
    """How attention crosses the CP ranks.

    'ring': key/value blocks travel round the ranks (``rotate_method`` says how); any number of
    heads. 'ulysses': two all-to-alls turn sequence shards into head shards, so each rank
    attends over the whole sequence for cp-th of the heads (query heads must divide by cp);
    attention masks, dropout and the math kernel work there. 'hybrid': cp = ulysses_degree x
    ring degree, Ulysses inside groups of ``ulysses_degree`` neighbouring ranks and a ring
    across the groups (USP).
    """

    ulysses_degree: int | None = Field(
        None,
        json_schema_extra={"fix": "give ulysses_degree >= 2 with strategy='hybrid', and leave it unset otherwise"},
    )
    """Ranks per Ulysses group under 'hybrid' (the ring degree is cp / ulysses_degree)."""

    mixers: Literal["split", "whole"] = Field(
        "split", json_schema_extra={"fix": "use mixers='split' or 'whole'"}
    )
    """How a hybrid model's layers that mix tokens outside attention cross the CP ranks. 'split': memory split over
    cp where cptune has a path for the layer (Gated DeltaNet by an all-to-all over its heads when its key heads divide
    by cp, short convolutions by a halo exchange); 'whole': every such layer runs over the gathered sequence (the
    generic path: exact for any such layer, its memory the whole sequence's), as do layers without a split path."""

    ep_degree: int = Field(1, ge=1, json_schema_extra={
        "fix": "give ep_degree >= 1 that divides dp_shard x cp and every MoE layer's experts (1: no expert "
               "parallelism)"})
    """Expert parallelism (a mixture of experts): each MoE layer's experts split over groups of ``ep_degree``
    consecutive ranks, tokens traded for them by all-to-all (:mod:`cptune.experts`); folded over dp_shard x cp (it
    multiplies nothing in ``mesh_shape``), every other parameter sharded as without it. 1: FSDP2 shards the experts
    with the rest."""

    @pydantic.model_validator(mode="after")
    def _strategy_fields(self) -> CPConfig:
        problems = []
        if self.strategy == "hybrid" and (self.ulysses_degree is None or self.ulysses_degree < 2):
            problems.append(Problem("config.ulysses_degree", f"is {self.ulysses_degree!r} with strategy='hybrid'",
                                    "give ulysses_degree >= 2 (cp = ulysses_degree x ring degree), or use "
                                    "strategy='ulysses' or 'ring'"))
        if self.strategy != "hybrid" and self.ulysses_degree is not None:
            problems.append(Problem("config.ulysses_degree", f"is set but strategy is {self.strategy!r}",
                                    "drop ulysses_degree, or use strategy='hybrid'"))
        if self.strategy == "ulysses" and self.load_balance is True:
            problems.append(Problem("config.load_balance", "is True with strategy='ulysses'; every rank attends "
                                    "over the whole sequence, so causal work is balanced without it",
                                    "set load_balance='auto' or False (Ulysses shards the sequence in order)"))
        if problems:
            raise ProblemError(problems[0])
        return self

    @field_validator("sdpa_backend", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):
            return (value,)
        return value

    @field_validator("sdpa_backend")
    @classmethod
    def _distinct(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None:
            if not value:
                raise ValueError("the list of backends is empty")
            if len(set(value)) != len(value):
                raise ValueError("a backend is listed twice")
        return value

    @field_validator("mesh_shape")
    @classmethod
    def _positive(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None:
            if len(value) not in (2, 4):
                raise ValueError(f"has {len(value)} degrees: give 2, (dp, cp), or 4, (dp_replicate, dp_shard, cp, tp)")
            if any(v == 0 or v < -1 for v in value) or value.count(-1) > 1:
                raise ValueError("degrees must be positive, with at most one -1 (inferred)")
        return value

    def parallel_dims(self, world_size: int | None = None) -> ParallelDims:
        """The named mesh for ``world_size`` ranks (None: the mesh_shape's own product, which must be given in full);
        raises ValidationError if the degrees don't multiply up."""
        if world_size is None:
            if self.mesh_shape is None or -1 in self.mesh_shape:
                raise ValidationError([Problem("config.mesh_shape", f"is {self.mesh_shape!r}: the world size is "
                                               "needed to resolve it", "give every degree of mesh_shape")])
            world_size = math.prod(self.mesh_shape)
        return ParallelDims.from_shape(self.mesh_shape, world_size, ep=self.ep_degree)

    def dp_cp(self, world_size: int | None = None, *,
              where: str = "the attention proxy's memory model prices") -> tuple[int, int]:
        """(dp, cp) of this configuration on ``world_size`` ranks (None: its mesh given in full) for code that runs or
        prices data and context parallelism only: a mesh with tp or dp_replicate is refused by name, never run or
        priced as if it were dp x cp."""
        dims = self.parallel_dims(world_size)
        if not dims.is_dp_cp:
            raise ValidationError([Problem("config.mesh_shape", f"is {dims.label()}: {where} (dp, cp) meshes only",
                                           "give a (dp, cp) mesh (dp_replicate and tp 1)")])
        return dims.dp_shard, dims.cp

    def resolve_mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp replicas, cp) for ``world_size`` ranks; raises ValidationError if the degrees don't multiply up."""
        dims = self.parallel_dims(world_size)
        return (dims.dp, dims.cp)

    def degrees(self, cp: int) -> tuple[int, int]:
        """(ulysses degree, ring degree) for a CP degree; their product is ``cp``.

        A hybrid split that does not fit ``cp`` (see :meth:`degree_problems`) gives the ring's
        (1, cp), so callers collecting every problem can go on checking.
        """
        if cp == 1 or self.strategy == "ring" or self.degree_problems(cp):
            return (1, cp)
        if self.strategy == "ulysses":
            return (cp, 1)
        return (self.ulysses_degree, cp // self.ulysses_degree)

    def degree_problems(self, cp: int) -> list[Problem]:
        """Why this strategy's split cannot run on ``cp`` CP ranks (empty when it can)."""
        if self.strategy != "hybrid" or cp == 1:
            return []
        u = self.ulysses_degree
        if cp % u or cp // u < 2:
            return [Problem("config.ulysses_degree", f"{u} does not split cp={cp} into Ulysses groups and a "
                            "ring of at least 2", f"use a ulysses_degree that divides {cp} and is below it, or "
                            f"strategy='ulysses' for all {cp} ranks")]
        return []

    def load_balance_for(self, causal: bool, cp: int | None = None) -> bool:
        """Whether causal work is load-balanced on ``cp`` CP ranks (:func:`decide_load_balance`, no length known)."""
        ring = self.degrees(cp)[1] if cp is not None else 2
        return decide_load_balance(self.load_balance, causal=causal, cp=cp or 2, ring=ring).on

    def label(self) -> str:
        """A short human-readable name, e.g. 'dp1·cp2 alltoall lb flash', or 'dp2·cp1 flash' without CP."""
        shape = full_shape(self.mesh_shape or (1, -1))
        cp, head = shape[2], shape_label(shape)
        backend = "+".join(self.sdpa_backend) if self.sdpa_backend else "default"
        ep = f" ep{self.ep_degree}" if self.ep_degree > 1 else ""
        if cp == 1:  # no ring: rotate method and load balancing do not apply
            return f"{head} {backend}{ep}"
        lb = {True: "lb", False: "no-lb", "auto": "lb-auto"}[self.load_balance]
        if self.strategy == "ulysses":
            label = f"{head} ulysses {backend}"
        elif self.strategy == "hybrid":
            ring = f"r{cp // self.ulysses_degree}" if cp > 0 else "ring"
            label = f"{head} hybrid u{self.ulysses_degree}×{ring} {self.rotate_method} {lb} {backend}"
        else:
            label = f"{head} {self.rotate_method} {lb} {backend}"
        return label + (" mixers-whole" if self.mixers == "whole" else "") + ep


@dataclass(frozen=True)
class LoadBalance:
    """What :func:`decide_load_balance` decided: on or off, the problems with the setting, a note if turned off."""

    on: bool
    problems: tuple[Problem, ...] = ()
    note: str | None = None


def balanced_multiple(cp: int, ring: int) -> int:
    """What a load-balanced length must divide by: head and tail halves of each ring shard, cut into cp / ring pieces."""
    return math.lcm(2 * ring, cp)


def decide_load_balance(setting: Literal["auto"] | bool, *, causal: bool, cp: int, ring: int,
                        seq_len: int | None = None) -> LoadBalance:
    """The one rule for head-tail load balancing of causal attention, for ``cp`` CP ranks of which ``ring`` form a ring.

    Wanted: ``setting`` (``'auto'``: for causal attention). Never under Ulysses (cp > 1 and no
    ring), where every rank attends over the whole sequence. With ``seq_len``, a length that does
    not divide by :func:`balanced_multiple` turns ``'auto'`` off (with a note) and is a problem
    for ``True``; so is ``True`` for non-causal attention. A length that does not divide by cp is
    the caller's problem, not this rule's.
    """
    on = (ring > 1 or cp == 1) and (causal if setting == "auto" else bool(setting))
    problems, note = [], None
    if on and cp > 1 and seq_len is not None and seq_len % cp == 0 and seq_len % balanced_multiple(cp, ring):
        balanced = balanced_multiple(cp, ring)
        what = "2 * cp" if ring == cp else "2 * ring degree and cp"
        if setting is True:
            problems.append(Problem("config.load_balance", f"load balancing needs the sequence length ({seq_len}) "
                                    f"divisible by {what} = {balanced}",
                                    f"pad the sequence to a multiple of {balanced} or set load_balance=False"))
        else:
            on, note = False, (f"load balancing is off: sequence length {seq_len} is not divisible by {what} = "
                               f"{balanced} (pad to a multiple of {balanced} to turn it on)")
    if on and not causal and setting is True:
        problems.append(Problem("config.load_balance", "load balancing only applies to causal attention",
                                "set load_balance='auto' or False for non-causal attention"))
    return LoadBalance(on, tuple(problems), note)


ConfigLike = Union[CPConfig, dict, None]


def as_config(config: ConfigLike) -> CPConfig:
    if config is None:
        return CPConfig()
    if isinstance(config, CPConfig):
        return config
    if isinstance(config, dict):
        return CPConfig(**config)
    raise ValidationError([
        Problem("config", f"expected a CPConfig or a dict, got {type(config).__name__}",
                "pass cptune.CPConfig(...) or a dict of its fields")
    ])
