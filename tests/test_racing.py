"""The racing rules on their own (no ranks): paired rounds cancel a drifting machine; the tie rule."""

import dataclasses

import cptune
from cptune.search import config_key
from cptune.search import racing
from cptune.search.records import TrialRecord

A = cptune.CPConfig(mesh_shape=(1, 2), rotate_method="alltoall", load_balance=True, sdpa_backend="flash")
B = cptune.CPConfig(mesh_shape=(1, 2), rotate_method="allgather", load_balance=True, sdpa_backend="flash")
DP = cptune.CPConfig(mesh_shape=(2, 1), sdpa_backend="flash")


def _record(number, config, peak=2**30):
    return TrialRecord(number=number, config=config, state="ok", tokens_per_s=1.0, peak_bytes=peak)


def _drifting(true_tps, drift):
    """A machine that speeds up by ``drift`` per run: the n-th run measures true_tps / drift**n."""
    calls = []

    def measure(record):
        calls.append(config_key(record.config))
        return true_tps[config_key(record.config)] / drift ** (len(calls) - 1)
    return measure, calls


def test_paired_rounds_in_alternating_order_cancel_a_drifting_machine():
    # B is truly 2.5 % slower; every run is 5 % faster than the one before it.
    measure, calls = _drifting({config_key(A): 1.0, config_key(B): 0.975}, 0.95)
    out = racing.race(_record(0, A), [_record(1, B)], lambda r: r.key, measure)
    assert calls == [config_key(A), config_key(B), config_key(B), config_key(A),
                                                          config_key(A), config_key(B), config_key(B), config_key(A)]
    assert len(out["rounds"]) == racing.RACE_ROUNDS == 4
    assert out["survivors"] == [config_key(A), config_key(B)]  # within 3 % after four rounds: a tie
    assert abs(out["standing"][config_key(B)] - 0.975) < 1e-9  # after an even number of rounds, exactly
    # The same race in a fixed order would have put B 8 % behind each round (out after two).


def test_a_clear_loser_leaves_after_one_round_and_a_failed_run_leaves_the_race():
    measure, calls = _drifting({config_key(A): 1.0, config_key(B): 0.85, config_key(DP): 0.99}, 1.0)
    out = racing.race(_record(0, A), [_record(1, B), _record(2, DP)], lambda r: r.key, measure)
    assert calls[:3] == [config_key(A), config_key(B), config_key(DP)] and config_key(B) not in calls[3:]
    assert out["survivors"] == [config_key(A), config_key(DP)]
    assert out["out"][config_key(B)]["round"] == 1 and abs(out["out"][config_key(B)]["relative"] - 0.85) < 1e-9
    line = racing.summary(out, lambda k: k.split("-")[2])
    assert line.startswith("4 paired round(s)") and "out: allgather after round 1 (0.85)" in line
    failing = racing.race(_record(0, A), [_record(1, B)], lambda r: r.key,
                          lambda r: None if r.config == B else 1.0)
    assert failing["survivors"] == [config_key(A)] and len(failing["rounds"]) == 1
    assert failing["out"] == {config_key(B): {"round": 1, "relative": None}}
    assert "(failed)" in racing.summary(failing, str)


def test_tie_rule_memory_within_5_percent_is_equal_then_default_then_more_dp():
    default = B
    # memory 3 % apart counts as equal: PyTorch's default wins
    assert racing.choose([_record(0, A, 100), _record(1, B, 103)], default).config == B
    # memory 20 % apart decides first
    assert racing.choose([_record(0, A, 100), _record(1, B, 120)], default).config == A
    # neither is the default: more data parallelism (less communication)
    assert racing.choose([_record(0, A, 100), _record(2, DP, 102)], default).config == DP


def test_screening_runs_two_steps_at_least_so_the_peak_is_a_steady_one():
    from cptune.search import MeasureSettings
    from cptune.workload import Workload

    def steps(settings):
        return settings.warmup + settings.min_repeats
    assert steps(racing.screening(MeasureSettings(warmup=0, min_repeats=3))) == 2
    assert steps(racing.screening(MeasureSettings(warmup=1, min_repeats=3))) == 2
    assert racing.screening(MeasureSettings(warmup=0, min_repeats=1)).min_repeats == 1  # asked for one: one
    assert racing.screening(MeasureSettings(min_seconds=2.0)).min_seconds == 0.5
    # short steps stop at the step cap before the time: screening takes a share of the cap too
    assert racing.screening(MeasureSettings(max_repeats=20)).max_repeats == 5
    assert racing.screening(MeasureSettings(warmup=0, min_repeats=3, max_repeats=3)).max_repeats == 2
    # a race round skips the warm-up, unless the step compiles
    assert racing.race_round(MeasureSettings(warmup=1), Workload(seq_len=64)).warmup == 0
    assert racing.race_round(MeasureSettings(warmup=0, min_repeats=3), Workload(seq_len=64)).min_repeats == 1
    assert racing.race_round(MeasureSettings(warmup=1), Workload(seq_len=64, compile=True)).warmup == 1


def test_the_race_stops_once_no_survivor_can_beat_the_tie_rules_pick_by_more_than_the_indifference():
    # DP is the tie rule's pick (more data parallelism; same memory) and the fastest; B is 4.5 % slower.
    truth = {config_key(DP): 1.0, config_key(B): 0.955}
    pick = lambda alive: racing.choose(alive, None)  # noqa: E731
    measure, calls = _drifting(truth, 1.0)
    out = racing.race(_record(0, DP), [_record(1, B)], lambda r: r.key, measure, pick=pick)
    # after 1 round B could still be up to 10 % better than measured (0.955 > 1 + 3 % - 10 %);
    # after 2, the margin is 7.1 %: 0.955 <= 0.959, so more rounds cannot change the pick by more than 3 %
    assert len(out["rounds"]) == 2 and out["settled"] == 2 and len(calls) == 4
    # B stood within the race's margin, but more than 3 % below the pick: out, slower, not a tie
    assert out["survivors"] == [config_key(DP)] and out["out"][config_key(B)]["round"] == 2
    assert abs(out["out"][config_key(B)]["relative"] - 0.955) < 1e-9
    assert "stopped: none of them can be more than 3% faster" in racing.summary(out, str)
    # 2.5 % below the pick after 3 rounds (bound 1 + 3 % - 5.8 %): stops there, and the two are a tie
    measure, calls = _drifting({config_key(DP): 1.0, config_key(B): 0.971}, 1.0)
    tie = racing.race(_record(0, DP), [_record(1, B)], lambda r: r.key, measure, pick=pick)
    assert tie["settled"] == 3 and tie["survivors"] == [config_key(DP), config_key(B)] and not tie["out"]
    # without the tie rule it runs all four rounds: B stays within the margin (5 %) to the end, and
    # is then out as more than 3 % slower than the best, not a tie the tie rule could pick it from
    measure, calls = _drifting(truth, 1.0)
    full = racing.race(_record(0, DP), [_record(1, B)], lambda r: r.key, measure)
    assert len(full["rounds"]) == 4 and full["settled"] is None and full["survivors"] == [config_key(DP)]
    assert full["out"][config_key(B)]["round"] == 4
    # when the pick is the slower one (B has less memory), the race goes on: B may be the worse choice
    measure, calls = _drifting(truth, 1.0)
    lean = racing.race(_record(0, DP, 2**30), [_record(1, B, 2**29)], lambda r: r.key, measure, pick=pick)
    assert len(lean["rounds"]) == 4 and lean["settled"] is None
    assert lean["survivors"] == [config_key(DP)]  # 4.5 % slower after four rounds: leaner, but not a tie


def test_a_warm_up_faster_than_the_timed_step_widens_the_range_up_to_it():
    # one timed step at 8 400 tokens/s, its warm-up at 12 000: the step was slowed by something
    # else, so the config may be as fast as its warm-up and must race a leader at 11 500
    slowed = TrialRecord(number=0, config=DP, state="ok", tokens_per_s=8400.0, tps_low=8400.0, tps_high=8400.0,
                         measurements=1, warmup_tps=12000.0, peak_bytes=1)
    assert racing.noise_range(slowed) == (8400.0 * 0.85, 12000.0)
    leader = TrialRecord(number=1, config=A, state="ok", tokens_per_s=11500.0, tps_low=11500.0, tps_high=11500.0,
                         measurements=1, peak_bytes=1)
    assert racing.contenders([leader, slowed]) == (leader, [slowed])
    assert racing.contenders([leader, dataclasses.replace(slowed, warmup_tps=None)]) == (leader, [])
    # from 5 steps on, the median is not one disturbed step: the warm-up does not widen it
    steady = dataclasses.replace(slowed, measurements=5)
    assert racing.noise_range(steady) == (8400.0, 8400.0)
