"""Noise-aware choice: screen every configuration briefly, then race, in paired rounds, only those that could be the best.

Each trial keeps its per-step times (the slowest rank's, per step). A configuration's figure is
the median tokens/s over its steps, with the interquartile range as its spread; a figure from
fewer than ``FEW_STEPS`` steps counts as uncertain by at least ±``NOISE_FLOOR`` (the drift of a
shared machine between trials, which a few consecutive steps do not show).

After the screening pass, the leader and every configuration whose range overlaps the leader's
race in *paired rounds*: each round times every survivor once more, briefly and back to back
(in alternating order), so they share the machine's state of that moment. Survivors are compared
by their mean log figure over the same rounds, so a slowdown of the machine between rounds cancels
out; a survivor more than ``RACE_FLOOR / sqrt(rounds)`` below the best is out. After
``RACE_ROUNDS`` rounds (or earlier, once more rounds could not change the choice by more than
``INDIFFERENCE``), the survivors within ``INDIFFERENCE`` of the best are *equivalent*: this
machine cannot tell them apart, and the search says so. Among them the choice follows a stated rule,
``TIE_RULE``. Every raced step also pools into the configuration's figure and spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from ..config import CPConfig
from ..workload import Workload
from .records import TrialRecord
from .settings import MeasureSettings

SCREEN_SHARE = 0.25
"""Screening and each race round time a configuration for this share of ``min_seconds`` and of ``max_repeats``."""
NOISE_FLOOR = 0.15
FEW_STEPS = 5
"""A figure from fewer than FEW_STEPS timed steps is taken as uncertain by at least ±NOISE_FLOOR."""
RACE_ROUNDS = 4
RACE_FLOOR = 0.10
"""After k paired rounds, a survivor whose mean figure is below the best's by more than
RACE_FLOOR / sqrt(k) is out: 10 % after one round, 5 % after four."""
INDIFFERENCE = 0.03
"""The race stops early when no survivor can be more than this share faster than the config the
tie rule would pick: after k rounds, each survivor's figure / the pick's <= 1 + INDIFFERENCE -
RACE_FLOOR / sqrt(k). More rounds could then change the choice by less than this. When the race
ends (so, or after RACE_ROUNDS), survivors more than this share below the best are out, slower;
those within it are equivalent, and the tie rule chooses among them."""
MEMORY_TIE = 0.05
"""Peaks within this share of the lowest count as equal for the tie rule (a peak varies a little run to run)."""
TIE_RULE = (f"lower peak memory (within {MEMORY_TIE:.0%} counts as equal), then PyTorch's default, then more "
            "data parallelism (less communication), then the label")
EXTRA_ATTR = "extra_step_times"  # study attribute: config key -> step times measured while racing
RACE_ATTR = "race"  # study attribute: the last race, as :func:`race` returns it (None: none holds)
RACING = {"running": True}
"""RACE_ATTR while a race runs: left so by a stopped search, it tells the resumed search to race again."""


def screening(settings: MeasureSettings) -> MeasureSettings:
    """Brief: a share of the time and of the step cap (short steps stop at the cap before the time),
    but two steps run at least (warm-up included): a rank's peak memory can rise on its second
    step (the allocator's state after the first), and screening is where the peak is read."""
    least = max(1, min(settings.min_repeats, 2 - settings.warmup))
    return settings.model_copy(update={"min_seconds": settings.min_seconds * SCREEN_SHARE, "min_repeats": least,
                                       "max_repeats": max(least, math.ceil(settings.max_repeats * SCREEN_SHARE))})


def race_round(settings: MeasureSettings, workload: Workload) -> MeasureSettings:
    """A race round: as brief as screening but from one step (no peak is read here), without
    warm-up (the ranks ran this step already) unless the step compiles (a rebuilt model may recompile)."""
    return screening(settings).model_copy(update={"warmup": settings.warmup if workload.compile else 0,
                                                  "min_repeats": 1})


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
    """The range a figure could be in: its IQR, widened to at least ±NOISE_FLOOR from few steps,
    and up to the warm-up step's figure when that was faster.

    A few consecutive steps vary less than the same configuration measured again a minute
    later on a shared machine, so their IQR alone would claim a confidence it does not have.
    A warm-up step pays one-time costs, so timed steps slower than it were slowed by something
    else (another process on a shared machine): the config may be as fast as its warm-up.
    """
    low, high = r.tps_low, r.tps_high
    if (r.measurements or 0) < FEW_STEPS:
        low, high = min(low, r.tokens_per_s * (1 - NOISE_FLOOR)), max(high, r.tokens_per_s * (1 + NOISE_FLOOR))
        high = max(high, r.warmup_tps or 0.0)
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
    """The tie rule (``TIE_RULE``): a stated order that does not hang on a difference within noise."""
    lowest = min(r.peak_bytes or 0 for r in tied)
    return min(tied, key=lambda r: ((r.peak_bytes or 0) > lowest * (1 + MEMORY_TIE), r.config != default,
                                    -r.config.parallel_dims().dp, r.config.label()))


def standing(rounds: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """Each key's mean figure over ``rounds`` (tokens/s per round), relative to the best: 1.0 is the best.

    Every key was measured in every round, so the machine's state of each round is common to all
    and cancels in the comparison (a paired comparison)."""
    mean_log = {k: sum(math.log(r[k]) for r in rounds) / len(rounds) for k in keys}
    top = max(mean_log.values())
    return {k: math.exp(v - top) for k, v in mean_log.items()}


def race(leader: TrialRecord, rivals: Sequence[TrialRecord], key: Callable[[TrialRecord], str],
         measure: Callable[[TrialRecord], float | None],
         pick: Callable[[list[TrialRecord]], TrialRecord] | None = None) -> dict:
    """Paired rounds among ``leader`` and ``rivals`` until one is left, RACE_ROUNDS have run, or
    (given ``pick``, the tie rule) no survivor can beat the pick by more than INDIFFERENCE.

    ``measure(record)`` times its config once more (a race round's length) and returns its
    tokens/s for that round, or None when the run failed (the config leaves the race).
    Returns {"rounds": [{key: tokens/s}], "survivors": [keys], "standing": {key: relative},
    "out": {key: {"round": n, "relative": r (None: its run failed)}}, "settled": the round after
    which it stopped early, or None}.
    """
    alive = [leader, *rivals]
    settled = None
    rounds: list[dict[str, float]] = []
    rel: dict[str, float] = {}
    out: dict[str, dict] = {}  # key -> {"round": n, "relative": mean figure / the best's} (None: its run failed)
    for i in range(RACE_ROUNDS):
        figures: dict[str, float] = {}
        for r in alive if i % 2 == 0 else alive[::-1]:
            tps = measure(r)
            if tps:
                figures[key(r)] = tps
            else:
                out[key(r)] = {"round": i + 1, "relative": None}
        alive = [r for r in alive if key(r) in figures]  # a failed run leaves the race
        rounds.append(figures)
        if not alive:
            break
        rel = standing(rounds, list(figures))
        floor = 1 - RACE_FLOOR / math.sqrt(len(rounds))
        out.update({k: {"round": i + 1, "relative": v} for k, v in rel.items() if v < floor})
        alive = [r for r in alive if rel[key(r)] >= floor]
        if len(alive) == 1:
            break
        if pick is not None and i + 1 < RACE_ROUNDS and _settled(alive, pick, rel, key, floor):
            settled = i + 1
            break
    if len(alive) > 1:  # the tie: those within INDIFFERENCE of the best; the rest are out, slower
        slower = {key(r): {"round": len(rounds), "relative": rel[key(r)]} for r in alive
                  if rel[key(r)] < 1 - INDIFFERENCE}
        out.update(slower)
        alive = [r for r in alive if key(r) not in slower]
    return {"rounds": rounds, "survivors": [key(r) for r in alive],
            "standing": {key(r): rel.get(key(r)) for r in alive}, "out": out, "settled": settled}


def _settled(alive: list[TrialRecord], pick: Callable[[list[TrialRecord]], TrialRecord], rel: dict[str, float],
             key: Callable[[TrialRecord], str], floor: float) -> bool:
    """Whether every survivor's figure / the pick's is within what noise and INDIFFERENCE allow:
    ``floor`` is 1 - RACE_FLOOR / sqrt(rounds), so the bound is 1 + INDIFFERENCE - that margin."""
    chosen = pick(alive)
    return all(rel[key(r)] / rel[key(chosen)] <= floor + INDIFFERENCE for r in alive if r is not chosen)


def summary(race: dict, label: Callable[[str], str]) -> str:
    """One line: how the race went, e.g. ``2 paired round(s), …: kept A (1.00); out: B after round 1 (0.88)``."""
    kept = ", ".join(f"{label(k)} ({v:.2f})" for k, v in race["standing"].items())
    gone = ", ".join(f"{label(k)} after round {o['round']} ("
                     f"{'failed' if o['relative'] is None else format(o['relative'], '.2f')})"
                     for k, o in race.get("out", {}).items())
    early = (f"; stopped: none of them can be more than {INDIFFERENCE:.0%} faster than the tie rule's pick"
             if race.get("settled") else "")
    return (f"{len(race['rounds'])} paired round(s), figures relative to the best over the same rounds: "
            f"kept {kept}" + (f"; out: {gone}" if gone else "") + early)
