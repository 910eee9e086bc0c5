"""``cptune report``: a stored study read back as a search reports it, and a picture of it."""

from __future__ import annotations

import os
from pathlib import Path

import optuna

from ..errors import Problem, ValidationError
from .study import get_storage, result_from_study
from ..sizes import format_size
from .result import SearchResult


def load_result(study_name: str, storage: None | str | optuna.storages.BaseStorage = None) -> SearchResult:
    backend = get_storage(storage, must_exist=True)
    names = [s.study_name for s in optuna.get_all_study_summaries(backend)]
    if study_name not in names:
        raise ValidationError([Problem("STUDY", f"there is no study {study_name!r} in {storage or 'cptune.db'}",
                                       f"use one of: {', '.join(names) or '(none)'}")])
    study = optuna.load_study(study_name=study_name, storage=backend)
    if "workload" not in study.user_attrs:
        raise ValidationError([Problem("STUDY", f"{study_name!r} was not made by cptune search",
                                       "name a study that cptune search wrote")])
    return result_from_study(study, storage=storage)


def plot(result: SearchResult, out: str | os.PathLike) -> Path:
    """report.png: tokens/s per configuration with its interquartile range, and peak memory against the budget."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValidationError([Problem("out", "needs matplotlib to draw", "pip install matplotlib "
                                       "(or cptune[bench])")]) from None
    rows = [r for r in result.ranked if r.tokens_per_s or r.peak_bytes]
    labels = [r.label + (" *" if r.number in result.equivalent else "") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2), sharey=True)
    y = range(len(rows))
    tps = [r.tokens_per_s or 0 for r in rows]
    err = [[max(0.0, (r.tokens_per_s or 0) - (r.tps_low or r.tokens_per_s or 0)) for r in rows],
           [max(0.0, (r.tps_high or r.tokens_per_s or 0) - (r.tokens_per_s or 0)) for r in rows]]
    colours = ["tab:green" if r.state == "ok" else "tab:grey" for r in rows]
    left.barh(y, tps, xerr=err, color=colours, capsize=3)
    left.set_yticks(list(y), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("tokens/s (median, interquartile range)")
    right.barh(y, [(r.peak_bytes or 0) / 2**20 for r in rows], color=colours)
    right.axvline(result.memory_budget / 2**20, color="tab:red", linestyle="--",
                  label=f"budget {format_size(result.memory_budget)}")
    right.set_xlabel("peak memory per rank (MiB)")
    right.legend(fontsize=8)
    fig.suptitle(f"{result.study_name}\n{result.workload.describe()}, {result.world_size} ranks on {result.device}",
                 fontsize=9)
    fig.tight_layout()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    target = path / "report.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
