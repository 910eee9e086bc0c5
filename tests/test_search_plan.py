"""The search guided by the plan: predicted order, recalibration, skips recorded, --exhaustive runs them; --ac auto."""

from __future__ import annotations

import json

import optuna

import cptune
from cptune.recipe import recipe_from_search
from cptune.search import MeasureSettings
from cptune.search.guide import MIN_TRIALS, SKIPPED, Guide
from cptune.plan import config_from
from cptune.search.space import axes
from cptune.plan import config_key

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


def test_a_plan_skipped_config_is_recorded_and_run_under_exhaustive(tmp_path, monkeypatch):
    from cptune.search import driver

    monkeypatch.setattr(driver, "dominating", lambda *a, **k: None)  # the plan's skips alone (dominance: below)
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
    # the column is the model as calibrated on every measured trial, not the guess made before the first was run:
    # measured rows' plan figures are typically within the calibration's worst leave-one-out error, none 2x off
    import optuna

    from cptune.search.records import PLAN_ATTR

    plan = optuna.load_study(study_name=first.study_name, storage=storage).user_attrs[PLAN_ATTR]
    assert plan["trials"] == len(measured) and first.plan_calibration == plan["calibration"]
    errors = sorted(abs(r.plan_tps / r.tokens_per_s - 1) for r in measured)
    assert errors[len(errors) // 2] <= plan["error"] and all(0.5 < r.plan_tps / r.tokens_per_s < 2 for r in measured), \
        [(r.label, r.plan_tps, r.tokens_per_s) for r in measured]
    assert "calibrated on this study's measured trials" in first.plan_note() and "leave-one-out" in first.plan_note()
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


GiB = 2**30
AC_PEAK = {"none": 3.0 * GiB, "selective": 1.0 * GiB, "full": 0.5 * GiB}
AC_SLOWER = {"none": 1.0, "selective": 1.2, "full": 1.5}


def ac_measure(workload, config, settings):
    """A deterministic step per (configuration, AC mode): more recompute, slower and smaller."""
    import os

    import torch.distributed as dist

    key = config_key(config, workload.ac)
    log = os.environ.get("CPTUNE_TEST_LOG")
    if log and dist.get_rank() == 0:
        with open(log, "a") as f:
            f.write(key + "\n")
    seconds = AC_SLOWER[workload.ac] * (1 + sum(map(ord, config_key(config))) % 5 / 10)
    return {"rank": dist.get_rank(), "times": [seconds] * 3, "peak": int(AC_PEAK[workload.ac]), "baseline": 0,
            "pid": os.getpid()}


def test_a_checkpointing_mode_is_not_run_once_one_that_recomputes_less_fits(tmp_path, monkeypatch):
    """Dominance: once ac-none of a configuration is measured within the budget, its selective and full runs
    cannot be faster (the same step plus recompute) and are skipped, each saying why; a tighter budget that
    the less checkpointed run no longer fits reopens them; --exhaustive runs them all."""
    from cptune.search import guide

    monkeypatch.setattr(guide.Guide, "skip", lambda *a, **k: None)  # the plan skips nothing: the rule alone
    log = tmp_path / "measured.log"
    monkeypatch.setenv("CPTUNE_TEST_LOG", str(log))
    w = cptune.Workload(seq_len=1024, heads=4, head_dim=16, ac="auto")
    quick = MeasureSettings(min_seconds=0)

    def search(budget, study="ac", **kw):
        return cptune.tune(w, nproc=2, storage=f"sqlite:///{tmp_path}/{study}.db", measure=ac_measure, confirm=False,
                           settings=quick, memory_budget=budget, sampler="grid", **kw)  # order: none, selective, full

    def measured_since(n):
        return log.read_text().split()[n:]

    # a rank's own memory (measured, under 1 GiB) + the step's: ac-none 3 GiB, selective 1, full 0.5; 5 % margin
    first = search("8GiB")  # ac-none fits everywhere
    measured = measured_since(0)
    assert first.complete and len(first.trials) == 18 and len(measured) == 6
    assert all(k.endswith("-ac-none") for k in measured)
    skipped = [r for r in first.trials if r.state == "skipped"]
    assert len(skipped) == 12 and all(r.ac in ("selective", "full") for r in skipped)
    for r in skipped:
        assert r.reason.startswith("skipped: ac-none of the same configuration measured "), r.reason
        assert "fits" in r.reason and f"ac-{r.ac} recomputes more" in r.reason
    assert first.best.ac == "none"

    n = len(log.read_text().split())
    tight = search("2.5GiB", study="tight")  # a fresh study: ac-none does not fit, selective does, full is dominated
    assert sorted(measured_since(n)) == sorted([*measured, *(k.replace("-ac-none", "-ac-selective") for k in measured)])
    assert all(r.state == "skipped" and r.reason.startswith("skipped: ac-selective ") for r in tight.trials
               if r.ac == "full")
    assert tight.best.ac == "selective" and all(r.state == "infeasible" for r in tight.trials if r.ac == "none")

    n = len(log.read_text().split())
    resumed = search("2.5GiB")  # the first study under the tighter budget: what ac-none dominated is open again
    again = measured_since(n)
    assert sorted(k for k in again if k.endswith("-ac-selective")) == \
        sorted(k.replace("-ac-none", "-ac-selective") for k in measured)
    assert not any(r.reason.startswith("skipped: ac-none") for r in resumed.trials)
    assert resumed.complete and all(r.state == "ok" for r in resumed.trials if r.ac == "selective")

    n = len(log.read_text().split())
    every = search("2.5GiB", study="tight", exhaustive=True)  # every dominated one measured now
    assert sorted(measured_since(n)) == sorted(k.replace("-ac-none", "-ac-full") for k in measured)
    assert every.evaluated_now == 6 and all(r.state == "ok" for r in every.trials if r.ac == "full")
    # a configuration open again is asked for by name: the sampler proposed none already answered (stored as
    # duplicates, hundreds of them, when the open one's earlier trial made optuna skip enqueuing it)
    for study, result in (("ac", resumed), ("tight", every)):
        stored = optuna.load_study(study_name=result.study_name, storage=f"sqlite:///{tmp_path}/{study}.db")
        assert not [t.number for t in stored.trials if "duplicate_of" in t.user_attrs], study


def test_the_search_prices_an_moe_model_by_every_expert_and_its_flops_by_the_active_ones(tmp_path):
    """A --model search's memory model is the plan's (the driver prunes on the guide's predicted peak): an MoE's
    parameters, gradients and optimizer state hold every expert, its FLOPs count the top-k a token goes through."""
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "tie_word_embeddings": False}))
    w = cptune.Workload(seq_len=256, model=str(folder), heads=4, kv_heads=2, head_dim=16, layers=2)
    guide = Guide(w, "cpu", "cpu", 2, budget=2**34, baseline=0)
    dims = guide.dims
    assert dims.experts is not None and dims.params - dims.active_params == 2 * (8 - 2) * 3 * 64 * 32
    config = config_from({"mesh": "1x2", "rotate_method": "alltoall", "sdpa_backend": "flash", "load_balance": True})
    moe = guide.raw("moe", config, "none")
    assert moe.memory["parameters"] == 4 * dims.params // 2 and moe.memory["optimizer"] == 8 * dims.params // 2
    dense = Guide(w, "cpu", "cpu", 2, budget=2**34, baseline=0)
    dense.dims = dims.model_copy(update={"experts": None, "ffn": 8 * 32})  # every expert's width as one MLP
    assert dense.dims.params == dims.params - 2 * 8 * 64  # the same parameters, less the routers
    as_dense = dense.raw("dense", config, "none")
    assert moe.time["dense"] < as_dense.time["dense"] and moe.peak_bytes < 1.1 * as_dense.peak_bytes
