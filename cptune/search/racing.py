"""Noise-aware choice: screen every configuration briefly, then race only those that could be the best.

Each trial keeps its per-step times (the slowest rank's, per step). A configuration's figure is
the median tokens/s over its steps, with the interquartile range as its spread; a figure from
fewer than ``FEW_STEPS`` steps counts as uncertain by at least ±``NOISE_FLOOR`` (the drift of a
shared machine between trials, which a few consecutive steps do not show). After the
screening pass, the leader and every configuration whose range overlaps the leader's are
measured again at full length (racing), up to ``RACE_ROUNDS`` times; the extra step times
pool with the first ones. Configurations still overlapping the leader after that are
*equivalent*: this machine cannot tell them apart, and the search says so. Among them the
choice follows a stated rule: lower peak memory, then PyTorch's default, then the label.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from ..config import CPConfig
from .measure import MeasureSettings
from .result import TrialRecord

RACE_ROUNDS = 2
SCREEN_SHARE = 0.25
"""The screening pass times each configuration for this share of ``min_seconds`` (at least 2 steps)."""
NOISE_FLOOR = 0.10
FEW_STEPS = 5
"""A figure from fewer than FEW_STEPS timed steps is taken as uncertain by at least ±NOISE_FLOOR."""
TIE_RULE = "lower peak memory, then PyTorch's default, then the label"
EXTRA_ATTR = "extra_step_times"  # study attribute: config key -> step times measured while racing


def screening(settings: MeasureSettings) -> MeasureSettings:
    return settings.model_copy(update={"min_seconds": settings.min_seconds * SCREEN_SHARE,
                                       "min_repeats": min(settings.min_repeats, 2)})


def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th) percentiles; a single value gives a zero-width range."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def apply_spread(record: TrialRecord, tokens_per_step: float, extra_times: Sequence[float] = ()) -> None:
    """Set the record's figure and range from its step times pooled with ``extra_times``."""
    times = [*(record.step_times or []), *extra_times]
    if record.state not in ("ok", "infeasible") or not times:
        return
    low, mid, high = quantiles([tokens_per_step / t for t in times])
    record.tokens_per_s, record.tps_low, record.tps_high = mid, low, high
    record.measurements = len(times)


def noise_range(r: TrialRecord) -> tuple[float, float]:
    """The range a figure could be in: its IQR, widened to at least ±NOISE_FLOOR from few steps.

    A few consecutive steps vary less than the same configuration measured again a minute
    later on a shared machine, so their IQR alone would claim a confidence it does not have.
    """
    low, high = r.tps_low, r.tps_high
    if (r.measurements or 0) < FEW_STEPS:
        low, high = min(low, r.tokens_per_s * (1 - NOISE_FLOOR)), max(high, r.tokens_per_s * (1 + NOISE_FLOOR))
    return low, high


def overlaps(a: TrialRecord, b: TrialRecord) -> bool:
    if a.tps_low is None or b.tps_low is None:
        return False
    (a_low, a_high), (b_low, b_high) = noise_range(a), noise_range(b)
    return a_high >= b_low and b_high >= a_low


def contenders(records: Sequence[TrialRecord]) -> tuple[TrialRecord | None, list[TrialRecord]]:
    """The leader (highest median among feasible) and the feasible configs whose range overlaps it."""
    ok = [r for r in records if r.state == "ok" and r.tokens_per_s]
    if not ok:
        return None, []
    leader = max(ok, key=lambda r: r.tokens_per_s)
    return leader, [r for r in ok if r is not leader and overlaps(r, leader)]


def choose(tied: Sequence[TrialRecord], default: CPConfig | None) -> TrialRecord:
    """The tie rule: lower peak memory, then PyTorch's default, then the label."""
    return min(tied, key=lambda r: (r.peak_bytes or 0, r.config != default, r.config.label()))


def race(records: Callable[[], list[TrialRecord]], measure: Callable[[TrialRecord], None]) -> None:
    """Re-measure the leader and its overlapping contenders until they separate, RACE_ROUNDS at most.

    ``records()`` gives the current records with pooled spreads; ``measure(record)`` runs its
    config once more at full length and stores the step times (a failed run stores none).
    """
    for _ in range(RACE_ROUNDS):
        leader, rivals = contenders(records())
        if leader is None or not rivals:
            return
        for r in [leader, *rivals]:
            measure(r)
