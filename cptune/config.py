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
        carried = getattr((err.get("ctx") or {}).get("error"), "problem", None)
        if carried is not None:  # a validator that knows the argument and the fix (ProblemError)
            problems.append(carried)
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

    mesh_shape: tuple[int, int] | None = Field(
        None,
        json_schema_extra={
            "fix": "give mesh_shape=(dp, cp) with positive integers whose product is the world size, "
            "or -1 for one of them to infer it"
        },
    )
    """(dp, cp). None means (1, world size): every rank does context parallelism."""

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
    def _positive(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None:
            if any(v == 0 or v < -1 for v in value) or value == (-1, -1):
                raise ValueError("degrees must be positive, with at most one -1 (inferred)")
        return value

    def resolve_mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp, cp) for ``world_size`` ranks; raises ValidationError if they don't multiply up."""
        if self.mesh_shape is None:
            return (1, world_size)
        dp, cp = self.mesh_shape
        if dp == -1 and world_size % cp == 0:
            dp = world_size // cp
        elif cp == -1 and world_size % dp == 0:
            cp = world_size // dp
        if dp * cp != world_size or dp < 1 or cp < 1:
            raise ValidationError([
                Problem(
                    "config.mesh_shape",
                    f"{self.mesh_shape} does not multiply to the world size {world_size}",
                    f"use a (dp, cp) with dp * cp == {world_size}, e.g. (1, {world_size})",
                )
            ])
        return (dp, cp)

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
        dp, cp = self.mesh_shape or (1, -1)
        backend = "+".join(self.sdpa_backend) if self.sdpa_backend else "default"
        if cp == 1:  # no ring: rotate method and load balancing do not apply
            return f"dp{dp}·cp1 {backend}"
        lb = {True: "lb", False: "no-lb", "auto": "lb-auto"}[self.load_balance]
        head = f"dp{dp}·cp{cp if cp > 0 else 'N'}"
        if self.strategy == "ulysses":
            return f"{head} ulysses {backend}"
        if self.strategy == "hybrid":
            ring = f"r{cp // self.ulysses_degree}" if cp > 0 else "ring"
            return f"{head} hybrid u{self.ulysses_degree}×{ring} {self.rotate_method} {lb} {backend}"
        return f"{head} {self.rotate_method} {lb} {backend}"


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
