"""A resumed study answers today's question: budget, workload, environment, options, headroom."""

import optuna
import pytest
from click.testing import CliRunner

import cptune
from cptune.cli import main
from cptune.search import MeasureSettings, Workload, config_key
from cptune._env import environment
from cptune.search.study import default_study_name
from tests.test_search import STEP_TIMES, fake_measure, study_env  # noqa: F401 - fixture

FAST = MeasureSettings(warmup=0, min_repeats=1, min_seconds=0)


def test_tight_budget_then_relaxed_runs_what_now_fits(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    tight = cptune.tune(Workload(seq_len=512, heads=2, head_dim=16), nproc=2, storage=storage,
                          memory_budget="1KiB", settings=FAST)
    assert tight.best is None and all(r.peak_bytes is None for r in tight.trials)  # none ran
    assert all("> 1.5 x budget 1.00KiB; not run" in r.reason for r in tight.trials)
    relaxed = cptune.tune(Workload(seq_len=512, heads=2, head_dim=16), nproc=2, storage=storage,
                            memory_budget="8GiB", settings=FAST, confirm=False, exhaustive=True)
    assert relaxed.study_name == tight.study_name  # the same question: the study is resumed
    assert relaxed.evaluated_now == 6 and relaxed.best is not None  # the pruned configs now run
    assert all(r.state == "ok" and "1.00KiB" not in r.reason for r in relaxed.trials)


def test_measured_trials_are_rejudged_against_todays_budget(study_env):  # noqa: F811
    storage, log = study_env
    kw = dict(nproc=2, storage=storage, measure=fake_measure, settings=MeasureSettings(min_seconds=0), exhaustive=True)
    first = cptune.tune(Workload(seq_len=1024), memory_budget="2GiB", **kw)
    assert first.best.config.label() == "dp1·cp2 alltoall lb flash"  # dp2 (3 GiB) is over 2 GiB
    measured = log.read_text().split()
    second = cptune.tune(Workload(seq_len=1024), memory_budget="8GiB", **kw)
    assert second.evaluated_now == 0 and log.read_text().split() == measured  # nothing measured again
    assert second.best.config.label() == "dp2·cp1 flash"  # the fastest, now within budget
    assert "2.00GiB" not in second.table()  # no reason left over from the old budget


def test_margin_and_headroom(study_env):  # noqa: F811
    storage, _ = study_env
    kw = dict(nproc=2, storage=storage, measure=fake_measure, settings=MeasureSettings(min_seconds=0), exhaustive=True)
    # dp1-cp2-alltoall-lb peaks at 1 GiB plus a fresh rank's memory (P): a budget of 1.03 P fits it
    # exactly, but not with a 5 % margin on top
    one = cptune.tune(Workload(seq_len=1024), memory_budget="8GiB", memory_margin=0.0, **kw)
    peak = next(r for r in one.trials if config_key(r.config) == "dp1-cp2-alltoall-lb-flash").peak_bytes
    tight = cptune.tune(Workload(seq_len=1024), memory_budget=int(peak * 1.03), memory_margin=0.05, **kw)
    rec = next(r for r in tight.trials if config_key(r.config) == "dp1-cp2-alltoall-lb-flash")
    assert rec.state == "infeasible" and "+ 5% margin" in rec.reason
    loose = cptune.tune(Workload(seq_len=1024), memory_budget=int(peak * 1.03), memory_margin=0.0, **kw)
    rec = next(r for r in loose.trials if config_key(r.config) == "dp1-cp2-alltoall-lb-flash")
    assert rec.state == "ok" and 0.02 < rec.headroom < 0.04
    assert "headroom" in loose.table().splitlines()[0]
    recipe = cptune.recipe.recipe_from_search(loose)
    assert recipe.metrics.headroom == pytest.approx(rec.headroom) and recipe.metrics.memory_margin == 0.0


def test_another_layer_count_is_another_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    runs = [cptune.tune(Workload(seq_len=256, heads=2, head_dim=16, layers=n), nproc=2, storage=storage,
                          n_trials=1, settings=FAST, confirm=False) for n in (2, 3)]
    assert runs[0].study_name != runs[1].study_name and "-L2-" in runs[0].study_name
    assert [r.evaluated_now for r in runs] == [1, 1]


def test_study_names_cover_settings_and_environment():
    w = Workload(seq_len=1024)
    env = environment("cpu", 2, 2).study()
    base = default_study_name(w, 2, "cpu", MeasureSettings(), env)
    assert default_study_name(w, 2, "cpu", MeasureSettings(), env) == base
    assert default_study_name(w, 2, "cpu", MeasureSettings(min_seconds=3), env) != base
    assert default_study_name(w, 2, "cpu", MeasureSettings(), {**env, "torch": "2.99.0"}) != base
    assert default_study_name(w, 2, "cpu", MeasureSettings(), {**env, "nnodes": 2}) != base
    assert default_study_name(Workload(seq_len=1024, step="m:f"), 2, "cpu", MeasureSettings(), env) != base


def test_explicit_study_from_another_environment_is_refused(study_env):  # noqa: F811
    storage, _ = study_env
    cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, study_name="mine", n_trials=1,
                  memory_budget="2GiB", measure=fake_measure, settings=MeasureSettings(min_seconds=0))
    study = optuna.load_study(study_name="mine", storage=storage)
    study.set_user_attr("environment", {**study.user_attrs["environment"], "torch": "2.99.0"})
    with pytest.raises(cptune.ValidationError, match=r"another question \(torch '2.99.0' -> "):
        cptune.tune(Workload(seq_len=1024), nproc=2, storage=storage, study_name="mine", measure=fake_measure,
                      memory_budget="2GiB", settings=MeasureSettings(min_seconds=0))


@pytest.mark.parametrize("args,named", [
    (["--trial-timeout", "-5"], "--trial-timeout"),
    (["--timeout", "0"], "--timeout"),
    (["--n-trials", "0"], "--n-trials"),
    (["--memory-margin", "1.5"], "--memory-margin"),
    (["--memory-budget", "2048"], "write 2048MiB or 2048GiB"),
    (["--workload", "nosuch.module:fn"], "cannot import 'nosuch.module'"),
    (["--workload", "tests.test_resume:_two_args"], "cannot be called as fn(workload, device)"),
])
def test_bad_options_fail_before_any_rank_starts(tmp_path, args, named):
    result = CliRunner().invoke(main, ["search", "--seq-len", "512", "--storage", f"sqlite:///{tmp_path / 'x.db'}",
                                       *args])
    assert result.exit_code in (1, 2), result.output  # 2: click's usage error (the option's type refused it)
    assert named in result.output and "Fix:" in result.output
    assert "trial(s) run now" not in result.output and not (tmp_path / "x.db").exists()


def _two_args(a, b, c):
    """Not a step builder: takes three arguments."""
