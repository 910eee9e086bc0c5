"""The search guided by the plan: predicted order, recalibration, skips recorded, --exhaustive runs them; --ac auto."""

from __future__ import annotations

import json

import cptune
from cptune.recipe import recipe_from_search
from cptune.search import MeasureSettings
from cptune.search.guide import MIN_TRIALS, SKIPPED, Guide
from cptune._space import config_from
from cptune.search.space import axes
from cptune._space import config_key

QUICK = MeasureSettings(warmup=1, min_repeats=2, max_repeats=3, min_seconds=0.3)
AC_AUTO = dict(seq_len=2048, layers=2, heads=8, head_dim=64, ac="auto")


def test_ac_auto_is_a_dimension_of_the_space():
    w = cptune.Workload(**AC_AUTO)
    ax = axes(w, 2, "cpu")
    assert ax.ac == ("none", "selective", "full") and "ac" in ax.as_dict()
    assert axes(w.model_copy(update={"ac": "full"}), 2, "cpu").as_dict().keys() == \
        {"mesh", "strategy", "rotate_method", "sdpa_backend", "load_balance"}
    c = config_from({"mesh": "1x2", "rotate_method": "alltoall", "sdpa_backend": "flash", "load_balance": True})
    assert config_key(c, "full").endswith("-ac-full") and config_key(c) == "dp1-cp2-alltoall-lb-flash"


def test_the_skip_rule_needs_measurements_and_stays_beyond_the_error():
    w = cptune.Workload(**{**AC_AUTO, "ac": "none"})
    guide = Guide(w, "cpu", "cpu", 2, budget=2**34, baseline=300 * 2**20)
    configs = {f"k{i}": (config_from({"mesh": m, "rotate_method": "alltoall", "sdpa_backend": "flash",
                                      "load_balance": lb}), ac)
               for i, (m, lb, ac) in enumerate([("1x2", True, "none"), ("2x1", False, "none"), ("1x2", False, "none"),
                                                ("1x2", True, "full"), ("1x2", False, "full")])}
    slow = "k4"  # no load balancing and full recompute: the slowest by the model
    assert guide.order(configs)[-1] == slow
    best = None
    for n, key in enumerate(["k0", "k1", "k2"]):
        assert guide.skip(slow, *configs[slow], best_tps=best) is None  # fewer than MIN_TRIALS: never
        p = guide.raw(key, *configs[key])
        guide.observe(key, *configs[key], step_s=p.step_s * 2, peak=p.peak_bytes)  # this machine: half as fast
        best = max(best or 0, p.tokens_per_s / 2)
    assert len(guide._seen) == MIN_TRIALS and guide.calibration.error < 0.01
    assert guide.calibration.compute == 2.0 or abs(guide.calibration.compute - 2.0) < 0.01
    reason = guide.skip(slow, *configs[slow], best_tps=best)
    assert reason.startswith(f"{SKIPPED}: predicted ") and "calibrated error 0%" in reason
    assert guide.skip("k0", *configs["k0"], best_tps=best) is None  # the best itself is never ruled out


def test_a_plan_skipped_config_is_recorded_and_run_under_exhaustive(tmp_path):
    storage = f"sqlite:///{tmp_path}/plan.db"
    w = cptune.Workload(**AC_AUTO)
    first = cptune.tune(w, nproc=2, storage=storage, confirm=False, settings=QUICK)
    assert first.complete and len(first.trials) == 18  # 6 configurations x 3 AC modes, every one answered
    skipped = [r for r in first.trials if r.state == "skipped"]
    measured = [r for r in first.trials if r.state == "ok"]
    assert skipped, first.table()
    assert len(measured) >= MIN_TRIALS
    for r in skipped:
        assert r.reason.startswith(f"{SKIPPED}: predicted ") and "calibrated error" in r.reason, r.reason
        assert r.tokens_per_s is None and r.plan_tps
    assert all(r.plan_tps for r in measured)  # predicted beside measured, for every trial
    assert SKIPPED in first.table() and " plan " in first.table().splitlines()[0]
    rows = json.loads(json.dumps(first.to_dict()))["trials"]
    assert all("plan_tps" in t and t["label"].split()[-1].startswith("ac-") for t in rows)
    assert first.best.ac in ("none", "selective", "full")
    recipe = recipe_from_search(first)
    assert recipe.workload.ac == first.best.ac  # the recipe trains with the checkpointing that won

    rerun = min(3, len(skipped))  # enough to show it; the rest would run the same way
    second = cptune.tune(w, nproc=2, storage=storage, confirm=False, settings=QUICK, exhaustive=True, n_trials=rerun)
    assert second.study_name == first.study_name
    assert second.evaluated_now == rerun  # only what the plan skipped is measured now
    states = {r.key: r for r in second.trials}
    now_measured = [r for r in skipped if states[r.key].state == "ok" and states[r.key].tokens_per_s]
    assert len(now_measured) == rerun
    assert len([r for r in second.trials if r.state == "skipped"]) == len(skipped) - rerun
