"""The search: space, memory model, and the driver on real ranks with an injected deterministic timer."""

import os
import re
import signal
import time

import optuna
import pytest
import torch.distributed as dist

import cptune
from cptune.search import MeasureSettings, Workload, all_configs, config_key, pytorch_default
from cptune.search.memory import predict_peak
from cptune.sizes import format_size, parse_size
from cptune.plan import invalid_reason, mesh_shapes

GiB = 2**30


def test_mesh_shapes_and_space():
    assert mesh_shapes(4) == [(1, 4), (2, 2), (4, 1)]
    causal = all_configs(Workload(seq_len=4096), 2, "cpu")
    assert sorted(config_key(c) for c in causal) == [
        "dp1-cp2-allgather-lb-flash", "dp1-cp2-allgather-nolb-flash", "dp1-cp2-alltoall-lb-flash",
        "dp1-cp2-alltoall-nolb-flash", "dp1-cp2-ulysses-flash", "dp2-cp1-allgather-nolb-flash"]
    full = all_configs(Workload(seq_len=4096, causal=False), 2, "cpu")
    assert len(full) == 4 and not any(c.load_balance for c in full)
    four = all_configs(Workload(seq_len=4096), 4, "cpu")
    assert len(four) == 15  # cp4: 4 ring, 1 Ulysses, 4 hybrid 2x2; cp2: 4 ring, 1 Ulysses; cp1: 1
    assert "dp1-cp4-hybrid2-alltoall-lb-flash" in {config_key(c) for c in four}
    assert len(all_configs(Workload(seq_len=4096, heads=6), 4, "cpu")) == 14  # 6 heads: no Ulysses over 4 ranks


def test_invalid_configs_say_why():
    w = Workload(seq_len=6)
    lb4 = cptune.CPConfig(mesh_shape=(1, 4), load_balance=True, sdpa_backend="flash")
    assert "not divisible by cp=4" in invalid_reason(w, lb4, "cpu")
    lb2 = cptune.CPConfig(mesh_shape=(1, 2), load_balance=True, sdpa_backend="flash")
    assert "divisible by 2 * cp = 4" in invalid_reason(w, lb2, "cpu")
    uly = cptune.CPConfig(mesh_shape=(1, 4), strategy="ulysses", sdpa_backend="flash")
    assert "6 heads do not divide among 4 Ulysses ranks" in invalid_reason(Workload(seq_len=8, heads=6), uly, "cpu")
    hyb = cptune.CPConfig(mesh_shape=(2, 2), strategy="hybrid", ulysses_degree=2, sdpa_backend="flash")
    assert "does not split cp=2" in invalid_reason(Workload(seq_len=8), hyb, "cpu")
    eff = cptune.CPConfig(mesh_shape=(1, 2), load_balance=False, sdpa_backend="efficient")
    assert "no 'efficient' kernel on cpu" in invalid_reason(Workload(seq_len=8), eff, "cpu")
    default = pytorch_default(Workload(seq_len=4096), 2, "cpu")
    assert default.rotate_method == "allgather" and default.load_balance is True and default.mesh_shape == (1, 2)


def test_sizes_and_memory_model_shape():
    assert parse_size("2GiB") == 2 * GiB and parse_size("1.5 MB") == 1_500_000 and parse_size(1024) == 1024
    with pytest.raises(cptune.ValidationError, match="write it like 70GiB"):
        parse_size("lots")
    assert format_size(3 * GiB) == "3.00GiB"
    w = Workload(seq_len=2**16, layers=16)
    dp = predict_peak(w, cptune.CPConfig(mesh_shape=(2, 1)))
    cp = predict_peak(w, cptune.CPConfig(mesh_shape=(1, 2)))
    assert cp < dp  # with depth, holding half the sequence beats the ring's buffers
    one = predict_peak(Workload(seq_len=2**16), cptune.CPConfig(mesh_shape=(1, 2), rotate_method="allgather"))
    a2a = predict_peak(Workload(seq_len=2**16), cptune.CPConfig(mesh_shape=(1, 4), rotate_method="alltoall"))
    ag4 = predict_peak(Workload(seq_len=2**16), cptune.CPConfig(mesh_shape=(1, 4), rotate_method="allgather"))
    assert a2a < ag4 < one  # allgather holds every rank's k/v


# -- the driver on 2 real ranks, with a deterministic fake measurement ---------------------

STEP_TIMES = {  # config key -> (seconds per step, peak bytes); behaviour below
    "dp2-cp1-allgather-nolb-flash": (1.0, 3 * GiB),   # fastest, but over the 2GiB budget
    "dp1-cp2-alltoall-lb-flash": (1.5, 1 * GiB),      # the best feasible
    "dp1-cp2-allgather-lb-flash": (2.1, 1 * GiB),     # rank 1 is killed during this trial
    "dp1-cp2-alltoall-nolb-flash": (2.9, 1 * GiB),    # raises on rank 1
    "dp1-cp2-allgather-nolb-flash": (5.5, 1 * GiB),   # hangs on rank 0
    "dp1-cp2-ulysses-flash": (4.0, 1 * GiB),  # all more than 2 x 15% (the few-steps noise floor) apart
}


def fake_measure(workload, config, settings):
    key = config_key(config)
    log = os.environ.get("CPTUNE_TEST_LOG")
    if log and dist.get_rank() == 0:
        with open(log, "a") as f:
            f.write(key + "\n")
    dist.barrier()
    if os.environ.get("CPTUNE_TEST_FAULTS"):
        if key == "dp1-cp2-allgather-lb-flash" and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if key == "dp1-cp2-alltoall-nolb-flash" and dist.get_rank() == 1:
            raise ValueError("injected failure")
        if key == "dp1-cp2-allgather-nolb-flash" and dist.get_rank() == 0:
            time.sleep(3600)
    seconds, peak = STEP_TIMES[key]
    return {"rank": dist.get_rank(), "times": [seconds] * 3, "peak": peak, "baseline": 0, "pid": os.getpid()}


@pytest.fixture
def study_env(tmp_path, monkeypatch):
    log = tmp_path / "measured.log"
    monkeypatch.setenv("CPTUNE_TEST_LOG", str(log))
    return f"sqlite:///{tmp_path / 'study.db'}", log


def _search(storage, **kw):
    kw.setdefault("memory_budget", "2GiB")
    return cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, measure=fake_measure,
                         settings=MeasureSettings(min_seconds=0), exhaustive=True, **kw)  # every config: no plan skips


def test_finds_known_best_respects_budget_and_resumes(study_env):
    storage, log = study_env
    first = _search(storage, n_trials=2)
    assert first.evaluated_now == 2 and not first.complete
    second = _search(storage)
    assert second.evaluated_now == 4 and second.complete
    measured = log.read_text().split()
    assert sorted(measured) == sorted(STEP_TIMES)  # every config once: none repeated on resume
    assert second.best.config.label() == "dp1·cp2 alltoall lb flash"
    assert second.best.tokens_per_s == pytest.approx(1024 / 1.5)
    dp = next(r for r in second.trials if r.config.mesh_shape == (2, 1))
    # A fresh rank's memory (measured) plus the trial's 3 GiB rise over its starting point.
    assert dp.state == "infeasible" and re.search(r"measured peak 3\.\d\dGiB \+ 5% margin > budget 2\.00GiB", dp.reason)
    third = _search(storage)
    assert third.evaluated_now == 0 and len(log.read_text().split()) == 6
    study = optuna.load_study(study_name=second.study_name, storage=storage)
    attrs = study.trials[0].user_attrs
    assert {"config", "tokens_per_s", "peak_bytes", "predicted_bytes", "feasible"} <= set(attrs)


def test_survives_a_failing_a_killed_and_a_hanging_trial(study_env, monkeypatch):
    storage, log = study_env
    monkeypatch.setenv("CPTUNE_TEST_FAULTS", "1")
    result = _search(storage, trial_timeout=8)
    by_key = {config_key(r.config): r for r in result.trials}
    assert result.complete and len(by_key) == 6
    assert by_key["dp1-cp2-alltoall-nolb-flash"].state == "failed"
    assert "rank 1: ValueError: injected failure" in by_key["dp1-cp2-alltoall-nolb-flash"].reason
    assert "died" in by_key["dp1-cp2-allgather-lb-flash"].reason
    assert "no result from rank(s) [0] after 8s" in by_key["dp1-cp2-allgather-nolb-flash"].reason
    assert result.best.config.label() == "dp1·cp2 alltoall lb flash"
    assert _search(storage).evaluated_now == 0  # failed trials are finished: not retried


def test_invalid_configs_are_never_run(study_env):
    storage, log = study_env
    result = cptune.tune(Workload(seq_len=6, heads=3), nproc=2, storage=storage, measure=fake_measure,
                           memory_budget="2GiB", settings=MeasureSettings(min_seconds=0), exhaustive=True)
    # Each valid config once: their steps do not vary, so no range overlaps the leader's (no race).
    assert sorted(log.read_text().split()) == ["dp1-cp2-allgather-nolb-flash", "dp1-cp2-alltoall-nolb-flash",
                                               "dp2-cp1-allgather-nolb-flash"]
    assert {r.measurements for r in result.trials if r.state == "ok"} == {3} and not result.tie
    reasons = sorted(r.reason for r in result.trials if r.state == "invalid")
    assert len(reasons) == 3 and "3 heads do not divide among 2 Ulysses ranks" in reasons[0]
    assert all("2 * cp = 4" in r for r in reasons[1:])


def test_predicted_far_over_budget_is_not_run(study_env):
    storage, log = study_env
    result = cptune.tune(Workload(seq_len=2**22), nproc=2, storage=storage, measure=fake_measure,
                           memory_budget="64MiB", settings=MeasureSettings(min_seconds=0))
    assert not log.exists()
    assert result.best is None and all(r.state == "infeasible" and "not run" in r.reason for r in result.trials)
    assert "no configuration fits the memory budget 64.00MiB" in result.why_nothing()


def test_study_for_another_workload_is_refused(study_env):
    storage, _ = study_env
    _search(storage, n_trials=1, study_name="shared")
    with pytest.raises(cptune.ValidationError, match=r"another question \(seq_len 1024 -> 2048; .*give a new name"):
        cptune.tune(Workload(seq_len=2048), nproc=2, storage=storage, study_name="shared", measure=fake_measure)


def _spmd_search(storage):
    return cptune.tune(Workload(seq_len=1024), storage=storage, memory_budget="2GiB", measure=fake_measure,
                         settings=MeasureSettings(min_seconds=0))


def test_inside_torchrun_rank0_drives(ranks, tmp_path):
    results = ranks(2).run(_spmd_search, f"sqlite:///{tmp_path / 'spmd.db'}")
    assert results[1] is None
    assert results[0].complete and results[0].best.config.label() == "dp1·cp2 alltoall lb flash"


def test_real_search_on_a_user_step(tmp_path):
    """--workload: the search measures the user's own model step (the Llama example's), for real."""
    workload = Workload(seq_len=128, heads=4, kv_heads=2, head_dim=16, step="examples.train_llama_cp:search_step")
    result = cptune.tune(workload, nproc=2, storage=f"sqlite:///{tmp_path / 'user.db'}", memory_budget="8GiB",
                           settings=MeasureSettings(warmup=0, min_repeats=1, min_seconds=0), exhaustive=True)
    assert result.complete and len(result.trials) == 6
    assert all(r.state == "ok" and r.tokens_per_s > 0 and r.predicted_bytes is None for r in result.trials), \
        [(r.label, r.state, r.reason) for r in result.trials]
    assert {r.config.strategy for r in result.trials} == {"ring", "ulysses"}


def test_real_search_measures_compiled_checkpointed_steps(tmp_path):
    """--compile --ac selective: the proxy runs as training will; compile time is kept apart."""
    workload = Workload(seq_len=256, heads=2, head_dim=16, layers=2, compile=True, ac="selective")
    result = cptune.tune(workload, nproc=2, storage=f"sqlite:///{tmp_path / 'c.db'}", memory_budget="8GiB",
                           settings=MeasureSettings(warmup=1, min_repeats=2, min_seconds=0), confirm=False,
                           exhaustive=True)  # every config measured: none skipped by plan
    assert result.complete and "compiled-acselective" in result.study_name
    for r in result.trials:
        assert r.state == "ok" and r.tokens_per_s > 0 and r.predicted_bytes is None  # no model: measured only
        assert r.compile_s is not None and r.compile_s >= 0
        # the warm-up's figure is kept (it includes compiling here, so it is far below the step's)
        assert r.warmup_tps is not None and 0 < r.warmup_tps < r.tokens_per_s
    assert "compile" in result.table().splitlines()[0]
    recipe = cptune.recipe.recipe_from_search(result)
    assert recipe.workload.compile and recipe.workload.ac == "selective" and recipe.metrics.compile_s is not None


def _compiles_per_trial(workload: Workload, rounds: int) -> list[int]:
    """On each rank: every config measured ``rounds`` times in this one process, as a search and
    its race rounds do; how many graphs torch.compile built during each trial."""
    import torch

    from cptune.search.measure import measure_on_rank
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    built = []
    for _ in range(rounds):
        for config in all_configs(workload, 2, "cpu"):
            before = counters["stats"]["unique_graphs"]
            measure_on_rank(workload, config, MeasureSettings(warmup=1, min_repeats=1, min_seconds=0))
            built.append(counters["stats"]["unique_graphs"] - before)
    return built


def test_every_compiled_trial_compiles_past_the_recompile_limit(ranks):
    """12 compiled trials in one process: past torch.compile's recompile limit (8) the step would
    silently run eagerly and its figure would not be the compiled one the search claims."""
    workload = Workload(seq_len=128, heads=2, head_dim=16, compile=True)
    for built in ranks(2).run(_compiles_per_trial, workload, 2):
        assert len(built) == 12 and all(n >= 1 for n in built), built


NOISY = {  # config key -> per-step seconds: two leaders within 3 % of each other, the rest clearly slower
    "dp1-cp2-alltoall-lb-flash": [1.0, 1.3, 0.9],
    "dp1-cp2-allgather-lb-flash": [1.03, 0.95, 1.25],
    "dp1-cp2-alltoall-nolb-flash": [2.0, 2.1, 2.05],
    "dp1-cp2-allgather-nolb-flash": [2.2, 2.3, 2.25],
    "dp2-cp1-allgather-nolb-flash": [3.0, 3.1, 3.05],
    "dp1-cp2-ulysses-flash": [2.5, 2.6, 2.55],
}
NOISY_PEAK = {"dp1-cp2-allgather-lb-flash": GiB // 2}


def noisy_measure(workload, config, settings):
    key = config_key(config)
    log = os.environ.get("CPTUNE_TEST_LOG")
    if log and dist.get_rank() == 0:
        with open(log, "a") as f:
            f.write(f"{key} {settings.min_seconds} {settings.warmup}\n")
    return {"rank": dist.get_rank(), "times": NOISY[key], "peak": NOISY_PEAK.get(key, GiB), "baseline": 0,
            "pid": os.getpid()}


def test_racing_measures_only_contenders_and_declares_a_tie(study_env):
    storage, log = study_env
    result = cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, measure=noisy_measure, exhaustive=True,
                           memory_budget="4GiB", settings=MeasureSettings(min_seconds=2.0))
    runs = [line.split() for line in log.read_text().splitlines()]
    assert all(float(sec) == 0.5 for _, sec, _ in runs)  # screening and race rounds: a quarter of min_seconds
    screened = [k for k, _, warmup in runs if warmup == "1"]
    raced = [k for k, _, warmup in runs if warmup == "0"]  # race rounds skip the warm-up: the step ran already
    assert sorted(screened) == sorted(NOISY)  # every config screened once
    a2a, ag = "dp1-cp2-alltoall-lb-flash", "dp1-cp2-allgather-lb-flash"
    # only the two within noise race: four paired rounds, leader first, then in the reverse order
    assert raced == [a2a, ag, ag, a2a, a2a, ag, ag, a2a]
    assert {config_key(r.config) for r in result.tie} == {a2a, ag}  # 3 % apart: within 5 % after 4 rounds
    # the tie rule: lower peak memory first, so allgather-lb (half the memory) is chosen
    assert config_key(result.best.config) == ag
    assert "within measurement noise" in result.tie_note() and "lower peak memory" in result.tie_note()
    best = result.best
    assert best.measurements == 15 and best.tps_low < best.tokens_per_s < best.tps_high
    recipe = cptune.recipe.recipe_from_search(result)
    assert sorted(recipe.metrics.equivalent) == sorted(r.config.label() for r in result.tie)
    assert result.to_dict()["equivalent"] and "*" in result.table()
    study = optuna.load_study(study_name=result.study_name, storage=storage)
    assert study.user_attrs["race"]["survivors"] == [a2a, ag] and len(study.user_attrs["race"]["rounds"]) == 4
    assert result.race_note().startswith("4 paired round(s)") and result.to_dict()["race"]["survivors"] == [a2a, ag]


def close_measure(workload, config, settings):
    """Steady steps (zero IQR), two configs 8 % apart: within the few-steps noise floor."""
    seconds = {"dp1-cp2-alltoall-lb-flash": 1.0, "dp1-cp2-allgather-lb-flash": 1.08}.get(config_key(config), 3.0)
    log = os.environ.get("CPTUNE_TEST_LOG")
    if log and dist.get_rank() == 0:
        with open(log, "a") as f:
            f.write(f"{config_key(config)}\n")
    return {"rank": dist.get_rank(), "times": [seconds] * 2, "peak": GiB, "baseline": 0, "pid": os.getpid()}


def test_few_steps_are_not_trusted_closer_than_the_noise_floor(study_env):
    storage, log = study_env
    result = cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, measure=close_measure, exhaustive=True,
                           memory_budget="4GiB", settings=MeasureSettings(min_seconds=0))
    runs = log.read_text().split()
    # 2 steps each with no spread, yet 8 % apart is inside the few-steps floor: both race. Paired,
    # 8 % is within the first round's 10 % margin, not within the second's 7 %: out after 2 rounds.
    assert {k: runs.count(k) for k in set(runs) if runs.count(k) > 1} == {"dp1-cp2-allgather-lb-flash": 3,
                                                                          "dp1-cp2-alltoall-lb-flash": 3}
    assert config_key(result.best.config) == "dp1-cp2-alltoall-lb-flash" and not result.tie


def settle_measure(workload, config, settings):
    """Steady steps, alltoall-lb 5 % faster than allgather-lb and leaner: the tie rule's pick is the faster one."""
    key = config_key(config)
    seconds = {"dp1-cp2-alltoall-lb-flash": 1.0, "dp1-cp2-allgather-lb-flash": 1.05}.get(key, 3.0)
    log = os.environ.get("CPTUNE_TEST_LOG")
    if log and dist.get_rank() == 0 and settings.warmup == 0:  # race rounds only
        with open(log, "a") as f:
            f.write(f"{key}\n")
    peak = GiB // 2 if key == "dp1-cp2-alltoall-lb-flash" else GiB
    return {"rank": dist.get_rank(), "times": [seconds] * 2, "peak": peak, "baseline": 0, "pid": os.getpid()}


def test_the_race_stops_when_more_rounds_cannot_change_the_choice_by_more_than_3_percent(study_env):
    storage, log = study_env
    result = cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, measure=settle_measure, exhaustive=True,
                           memory_budget="4GiB", settings=MeasureSettings(min_seconds=0))
    a2a, ag = "dp1-cp2-alltoall-lb-flash", "dp1-cp2-allgather-lb-flash"
    # allgather-lb at 0.952: inside round 2's 7.1 % margin (so not out), yet it cannot beat the pick
    # (alltoall-lb: leaner) by more than 3 % + 0.952 - 1 + 7.1 %: the race stops after 2 rounds, not 4,
    # and allgather-lb, more than 3 % below the pick, is out (slower), not declared equivalent
    assert log.read_text().split() == [a2a, ag, ag, a2a]
    race = optuna.load_study(study_name=result.study_name, storage=storage).user_attrs["race"]
    assert race["settled"] == 2 and race["survivors"] == [a2a] and race["out"][ag]["round"] == 2
    assert config_key(result.best.config) == a2a and not result.tie
    assert "stopped: none of them can be more than 3% faster" in result.race_note()


def schedule_measure(workload, config, settings):
    dp, cp = config.mesh_shape
    return {"rank": dist.get_rank(), "times": [1.0 if cp == 1 else 1.5] * 3, "baseline": 0, "pid": os.getpid(),
            "peak": workload.seq_len * 2**18 // cp}  # dp-only holds the whole sequence: its memory grows fastest


def test_several_lengths_on_the_same_ranks(study_env, ranks):
    from cptune.search.measure import baseline_on_rank

    storage, _ = study_env
    # The budget sits between CP's and dp-only's peak at S=4096, above what a fresh rank of this torch build
    # holds (the search adds that baseline to every trial's rise): a CUDA build's ranks hold more than a CPU one's.
    base = max(ranks(2).run(baseline_on_rank, [(1, 2)]))
    budget = f"{(base + 0.75 * GiB) / 2**20:.0f}MiB"
    results = cptune.tune(Workload(seq_len=1024), seq_lens=[1024, 4096], nproc=2, storage=storage,
                            measure=schedule_measure, memory_budget=budget, settings=MeasureSettings(min_seconds=0))
    assert [r.workload.seq_len for r in results] == [1024, 4096]
    assert len({r.study_name for r in results}) == 2  # one study per length
    assert results[0].best.config.mesh_shape == (2, 1)  # short: dp-only fits and is fastest
    assert results[1].best.config.mesh_shape == (1, 2)  # long: only CP fits


def test_cli_schedule_writes_one_recipe_per_length_and_shows_the_change(tmp_path):
    from click.testing import CliRunner

    from cptune.cli import main

    out = tmp_path / "runs" / "sched.yaml"
    result = CliRunner().invoke(main, ["search", "--seq-len", "256,512", "--heads", "2", "--head-dim", "16",
                                       "--min-seconds", "0", "--storage", f"sqlite:///{tmp_path / 'c.db'}",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "best per sequence length:" in result.output and "S=256" in result.output and "S=512" in result.output
    written = sorted(p.name for p in out.parent.glob("*.yaml"))
    assert written == ["sched-s256.yaml", "sched-s512.yaml"]
    assert cptune.load_recipe(out.parent / "sched-s512.yaml").workload.seq_len == 512
    report = CliRunner().invoke(main, ["report", cptune.load_recipe(out.parent / "sched-s256.yaml").provenance.study_name,
                                       "--storage", f"sqlite:///{tmp_path / 'c.db'}", "--out", str(tmp_path / "rep")])
    assert report.exit_code == 0 and "IQR" in report.output, report.output
    assert (tmp_path / "rep" / "report.png").stat().st_size > 1000


def test_a_search_on_packed_documents_measures_packed_work_and_the_recipe_says_so(tmp_path):
    from click.testing import CliRunner

    from cptune.cli import main

    out = tmp_path / "packed.yaml"
    result = CliRunner().invoke(main, ["search", "--seq-len", "512", "--heads", "2", "--head-dim", "16",
                                       "--documents", "longtail", "--window", "63", "--min-seconds", "0",
                                       "--storage", f"sqlite:///{tmp_path / 'p.db'}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    recipe = cptune.load_recipe(out)
    assert recipe.workload.documents == "longtail" and recipe.workload.window == 63 and recipe.figures_apply
    assert "docs=longtail window=63" in CliRunner().invoke(main, ["show", str(out)]).output
    assert "-docslongtail-w63-" in recipe.provenance.study_name
    # the plain workload's study name (and hash) are what they were before documents existed
    assert set(Workload(seq_len=512).question()) == {"seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype",
                                                     "causal", "layers", "compile", "ac", "step"}  # 0.1.0's fields
    with pytest.raises(cptune.ValidationError, match="documents: 16 equal documents do not divide 500"):
        Workload(seq_len=500, documents="16")


def test_cptune_search_is_the_subpackage_and_calling_it_still_searches_with_a_deprecation():
    import cptune.search as s

    assert s.MeasureSettings is MeasureSettings and cptune.search.search is cptune.tune
    with pytest.warns(DeprecationWarning, match=r"cptune\.tune"), pytest.raises(cptune.ValidationError, match="n_trials"):
        cptune.search(Workload(seq_len=256), n_trials=0)  # the old spelling: the same checks, then the same search
