"""How a search measures and judges: one typed object each, so a new setting touches one type."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from ..workload import MEMORY_MARGIN, TRIAL_TIMEOUT_S
from ..config import StrictModel


class MeasureSettings(StrictModel):
    """How long each trial is timed. Every rank takes the same decisions (max elapsed time)."""

    warmup: int = Field(1, ge=0, json_schema_extra={"fix": "use a warm-up count >= 0"})
    min_repeats: int = Field(3, ge=1, json_schema_extra={"fix": "use at least 1 repeat"})
    max_repeats: int = Field(20, ge=1, json_schema_extra={"fix": "use max_repeats >= min_repeats"})
    min_seconds: float = Field(1.0, ge=0, json_schema_extra={"fix": "use a non-negative time"})


@dataclass(frozen=True)
class SearchSettings:
    """Everything that decides how a search runs and judges, besides the workload and where the study lives.

    ``budget``/``margin``: a config is feasible when its worst peak x (1 + margin) <= budget.
    ``measure``: how each trial is timed. ``n_trials``/``timeout``: when to stop starting trials.
    ``trial_timeout``: seconds before a trial is a hang. ``sampler``/``seed``: how configs are
    proposed. ``confirm``: screen briefly and race the leaders (else measure each once). ``exhaustive``:
    measure every configuration, dominated checkpointing modes too (the plan still orders them; see :mod:`.guide`).
    """

    budget: int
    margin: float = MEMORY_MARGIN
    measure: MeasureSettings = field(default_factory=MeasureSettings)
    n_trials: int | None = None
    timeout: float | None = None
    trial_timeout: float = TRIAL_TIMEOUT_S
    sampler: str = "auto"
    seed: int | None = 0
    confirm: bool = True
    exhaustive: bool = False
    """Run every configuration: the plan orders them but skips none."""
    max_tp: int = 1
    """The largest tensor-parallel degree a ``--model`` search tries (1: dp x cp only); see :func:`.space.tp_degrees`."""
