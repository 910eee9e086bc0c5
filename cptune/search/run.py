"""``cptune.search``: check every option, start the ranks once, and run one study per sequence length."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import optuna
import torch
import torch.distributed as dist

from ..workload import MEMORY_MARGIN, TRIAL_TIMEOUT_S
from .._env import environment
from ..errors import Problem, ValidationError, raise_if
from ..sizes import parse_size
from ..workload import Workload
from .driver import Progress, run_study
from .evaluate import LocalEvaluator, MeasureFn, SPMDEvaluator
from .guide import unfit_problem
from .interrupts import Interrupts, SearchInterrupted
from .measure import measure_on_rank
from .memory import default_budget
from .result import SearchResult
from .settings import MeasureSettings, SearchSettings
from ..models import attention_shape, cp_problems, load_config, training_problems
from .steps import load_user_step



def _option_problems(n_trials, timeout, trial_timeout, margin, nproc) -> list[Problem]:
    problems = []
    if n_trials is not None and n_trials < 1:
        problems.append(Problem("n_trials", f"is {n_trials}", "give 1 or more, or leave it out to run every config"))
    if timeout is not None and not timeout > 0:
        problems.append(Problem("timeout", f"is {timeout}", "give a positive number of seconds, or leave it out"))
    if not trial_timeout > 0:
        problems.append(Problem("trial_timeout", f"is {trial_timeout}", "give a positive number of seconds "
                                f"(default {TRIAL_TIMEOUT_S:.0f})"))
    if not 0 <= margin < 1:
        problems.append(Problem("memory_margin", f"is {margin}", "give a share in [0, 1), e.g. 0.05 for 5 %"))
    if nproc is not None and nproc < 1:
        problems.append(Problem("nproc", f"is {nproc}", "use 1 or more"))
    return problems


def _check_user_step(workload: Workload) -> None:
    """Import --workload once, here, before any rank starts, and check it takes (workload, device)."""
    fn = load_user_step(workload.step)
    try:
        inspect.signature(fn).bind(workload, "cpu")
    except TypeError:
        raise ValidationError([Problem("step", f"{workload.step} cannot be called as fn(workload, device)",
                                       "define it as def fn(workload, device) -> (step, buffers, seq_dims)")]) from None
    except ValueError:  # no signature to read (a builtin): let the ranks find out
        pass


def _check_model(workload: Workload) -> None:
    """The model's config loads, and the workload's attention shape (what the search space is built from) is
    the model's."""
    config = load_config(workload.model, workload.model_overrides)
    shape = attention_shape(config)
    differ = [f"{k}={getattr(workload, k)} (the model's: {v})" for k, v in shape.items()
              if getattr(workload, k) != v and not (k == "kv_heads" and workload.kv_heads is None and v == shape["heads"])]
    raise_if([Problem("workload", f"differs from --model {workload.model}: {', '.join(differ)}",
                      "build it with cptune.models.model_workload(path, overrides, seq_len=...)")] if differ else []
             + training_problems(workload.ac, workload.compile, config))


def search(
    workload: Workload | dict | None = None,
    *,
    seq_lens: Sequence[int] | None = None,
    nproc: int | None = None,
    memory_budget: str | int | None = None,
    memory_margin: float = MEMORY_MARGIN,
    storage: None | str | optuna.storages.BaseStorage = None,
    study_name: str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float = TRIAL_TIMEOUT_S,
    sampler: str = "auto",
    seed: int | None = 0,
    settings: MeasureSettings | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    measure: MeasureFn = measure_on_rank,
    confirm: bool = True,
    exhaustive: bool = False,
    max_tp: int = 1,
) -> SearchResult | list[SearchResult] | None:
    """Find the fastest configuration that fits in ``memory_budget`` for ``workload``, measured on real ranks.

    Outside torch.distributed, launches ``nproc`` local ranks (gloo on CPU, nccl with
    ``device='cuda'``) and drives the study from this process. With ``confirm``, every config is
    screened briefly and the leaders within noise of each other race in paired rounds (:mod:`.racing`); without
    it, each config is measured once with ``settings``. Inside a torchrun job (the
    process group already initialized), every rank must call it: rank 0 drives and gets the
    result, the other ranks serve trials and get None. Every option is checked, and a
    ``--workload`` step imported, before any rank starts. A config is feasible when its worst
    peak (over ranks and repeats) plus ``memory_margin`` fits ``memory_budget``; a resumed study
    is judged against the budget of this call.

    Trials run in the order the step model (:mod:`cptune.plan`) predicts best first, recalibrated after
    each; a config it rules out beyond its measured error is recorded as skipped by plan
    (:mod:`.guide`), unless ``exhaustive``. ``workload.ac='auto'`` searches activation checkpointing
    (none, selective, full) as a dimension; a mode is not run once a mode of the same configuration that
    recomputes less is measured to fit (it cannot be faster), unless ``exhaustive``.

    ``seq_lens``: search each of these sequence lengths (one study each, on the same ranks) and
    return the list of results, in order; a training schedule's lengths in one run.

    ``max_tp``: with a ``workload.model``, also try tensor parallelism up to this degree inside a node, the model
    split by its own TP plan (:func:`.space.tp_degrees`); its study is its own (named ``-tpN``).

    SIGINT or SIGTERM (on the driving process) stops the search at any moment: the ranks are
    killed and waited for, the study is left consistent (a trial cut short is measured again, a race cut short
    is run again, when the same call is repeated) and :class:`SearchInterrupted` is raised, with
    the study's name, the trials stored and ``exit_code`` (130 or 143). The fork server the ranks came from
    stays, this process's for its next group; ``cptune search`` stops it before it exits
    (:func:`cptune.launch.stop_helpers`).
    """
    workload = workload if isinstance(workload, Workload) else Workload(**(workload or {}))
    lengths = list(seq_lens) if seq_lens else [workload.seq_len]
    if any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValidationError([Problem("seq_lens", f"{lengths} holds a length that is not a positive integer",
                                       "give lengths like 8192 or 8192,16384,32768")])
    workloads = [Workload(**{**workload.model_dump(), "seq_len": n}) for n in lengths]  # each length checked
    settings = settings or MeasureSettings()
    problems = _option_problems(n_trials, timeout, trial_timeout, memory_margin, nproc)
    if not isinstance(max_tp, int) or max_tp < 1:
        problems.append(Problem("max_tp", f"is {max_tp!r}", "give a positive tensor-parallel degree (1: dp x cp only)"))
    elif max_tp > 1 and not workload.model:
        problems.append(Problem("max_tp", f"is {max_tp} but there is no model to split: tensor parallelism splits a "
                                "model's layers, which the attention proxy and a --workload step do not have",
                                "give --model, or leave --max-tp at 1"))
    if sampler not in ("auto", "grid", "tpe"):
        problems.append(Problem("sampler", f"unknown sampler {sampler!r}", "use 'auto', 'grid' or 'tpe'"))
    if memory_budget is not None:
        try:
            parse_size(memory_budget, "memory_budget")
        except ValidationError as exc:
            problems += exc.problems
    if not dist.is_initialized():
        device = device or "cpu"
        if device not in ("cpu", "cuda"):
            problems.append(Problem("device", f"unknown device {device!r}", "use cpu or cuda"))
        elif device == "cuda":
            if not torch.cuda.is_available():
                problems.append(Problem("device", "is cuda but this machine has no usable CUDA GPU",
                                        "use --device cpu, or run on a GPU machine with a CUDA build of torch"))
    if dist.is_initialized() and nproc is not None:
        problems.append(Problem("nproc", f"is {nproc} inside a torchrun job, whose own {dist.get_world_size()} "
                                "ranks are measured", "leave it out (torchrun's --nnodes and --nproc-per-node set "
                                "the ranks)"))
    raise_if(problems)
    if workload.step:
        _check_user_step(workload)
    if workload.model:  # the config reads and the overrides apply here, before any rank starts
        _check_model(workload)
    if nproc is None and not dist.is_initialized():
        nproc = torch.cuda.device_count() if device == "cuda" else 2
    if workload.model:  # a model no configuration fits even sharded: said before any rank builds it
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else device or "cpu"
        world = dist.get_world_size() if dist.is_initialized() else nproc
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if dist.is_initialized() else world
        budget = parse_size(memory_budget) if memory_budget is not None else default_budget(device_type, per_node)
        name = environment(device_type, world, per_node).device_name
        raise_if([p for w in workloads if (p := unfit_problem(w, device_type, name, world, per_node, budget))][:1])
        # a model with layers that mix tokens outside attention: every cp > 1 the search would measure trains wrong
        raise_if(cp_problems(load_config(workload.model, workload.model_overrides), world, "--model")
                 if world > 1 else [])
    if dist.is_initialized() and dist.get_rank() != 0:
        SPMDEvaluator(trial_timeout, measure).follow()  # serve rank 0's trials; torchrun stops this rank
        return None
    results: list[SearchResult] = []
    interrupts = Interrupts()  # the driver's window: starting the ranks, every length, closing them
    try:
        with interrupts:
            evaluator = SPMDEvaluator(trial_timeout, measure) if dist.is_initialized() else \
                LocalEvaluator(nproc, device, trial_timeout, measure)
            stopped = False
            try:
                budget = parse_size(memory_budget) if memory_budget is not None else \
                    default_budget(evaluator.device_type, evaluator.nproc_per_node)
                # a --model: the family's first-step check, once on these ranks, before anything is measured
                checked = evaluator.check(workload) if workload.model and evaluator.world_size > 1 else None
                plan = SearchSettings(budget=budget, margin=memory_margin, measure=settings, n_trials=n_trials,
                                      timeout=timeout, trial_timeout=trial_timeout, sampler=sampler, seed=seed,
                                      confirm=confirm, exhaustive=exhaustive, max_tp=max_tp)
                for w in workloads:
                    name = study_name if study_name is None or len(workloads) == 1 else f"{study_name}-S{w.seq_len}"
                    results.append(run_study(evaluator, w, plan, storage=storage, study_name=name, progress=progress,
                                             interrupts=interrupts))
                    results[-1].check = checked
            except SearchInterrupted:
                stopped = True
                evaluator.abort()  # the ranks may be mid-trial: stop them now, leave no process behind
                raise
            finally:
                if not stopped:
                    evaluator.close()
    except SearchInterrupted as exc:
        raise exc.after(results) from None  # held while the ranks closed: named after the last study
    return results if seq_lens else results[0]


__all__ = ["search"]
