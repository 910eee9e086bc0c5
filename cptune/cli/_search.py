"""``cptune search``: a thin call into :func:`cptune.search` (registered on the ``cptune`` group), and the way
each rank of a torchrun job leaves it."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

import click

from ._console import progress, report_search
from ._types import (COUNT, DOCUMENTS, KEY_VALUE, LENGTHS, NAME, VIDEO, REFERENCE, SECONDS, SIZE, STORAGE, CheckedPath,
                         InputFile, Number, OneOf, OutputFile, Whole, in_flags)
from ..workload import BUDGET_FRACTION, MEMORY_MARGIN, TRIAL_TIMEOUT_S
from ..errors import CPTuneError
from ..workload import AC_MODES, LOSS_MODES


def _init_torchrun() -> tuple[bool, bool]:
    """Inside torchrun (RANK set): join its process group. Returns (whether this is rank 0, whether it joined)."""
    if "RANK" not in os.environ:
        return True, False
    from .._rank import init_rank

    return init_rank()[2] == 0, True


def _leave(code: int) -> None:
    """The end of a torchrun rank of ``cptune search``. Done: the process group closes in order
    (:func:`~cptune.close_rank`), then a normal exit. Stopped by a signal or an error: what the
    study needs is stored, and the group may hold work whose peers are gone, which a destroy would wait on
    for the group's timeout: the streams are flushed and the process leaves at once, without the
    interpreter's teardown (whose race with gloo's threads aborts a process)."""
    if code == 0:
        from .._rank import close_rank

        close_rank()
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@click.command("search")
@click.option("--seq-len", "seq_lens", type=LENGTHS, default="4096", show_default=True,
              help="Tokens per sequence; several, comma-separated (8192,16384,32768), search each on the same ranks.")
@click.option("--batch", type=COUNT, default=1, show_default=True, help="Sequences per data-parallel replica.")
@click.option("--heads", type=COUNT, default=8, show_default=True,
              help="Query heads (a --model's come from its config).")
@click.option("--kv-heads", type=COUNT, default=None, help="Key/value heads (GQA); default = --heads.")
@click.option("--head-dim", type=COUNT, default=64, show_default=True)
@click.option("--dtype", type=OneOf(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--layers", type=COUNT, default=1, show_default=True, help="Attention layers in the proxy step.")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile each proxy layer (compile time reported apart).")
@click.option("--ac", type=OneOf([*AC_MODES, "auto"]), default="none", show_default=True,
              help="Activation checkpointing per layer, as the training run will use; auto: search all three.")
@click.option("--workload", "step", type=REFERENCE, default=None, metavar="MODULE:FUNCTION",
              help="Tune your own step: a function (workload, device) -> (step, buffers, seq_dims).")
@click.option("--model", type=InputFile(dir_okay=True), default=None, metavar="PATH",
              help="Tune a transformers model's training step: a local model directory or its config.json.")
@click.option("--model-override", "model_overrides", type=KEY_VALUE, multiple=True, metavar="KEY=VALUE",
              help="Change the model's config before building it (repeatable), e.g. num_hidden_layers=4.")
@click.option("--documents", type=DOCUMENTS, default=None, metavar="SPEC",
              help="Packed documents per sequence: a count of equal ones (16), 'longtail', or lengths (1024,512,...).")
@click.option("--window", type=Whole(0), default=None, metavar="N",
              help="Causal sliding window: each token attends to N earlier tokens (4095 for sliding_window=4096).")
@click.option("--video", type=VIDEO, default=None, metavar="T,H,W",
              help="With a vision-language --model: one video a sequence, its grid in patches (temporal patches, "
                   "height, width: a video_grid_thw row), synthetic frames among text.")
@click.option("--loss", type=OneOf(list(LOSS_MODES)), default=LOSS_MODES[0], show_default=True,
              help="With --model: the loss in chunks, never the whole logits (vocabulary-parallel under tp), or the "
                   "model's own loss from the whole logits.")
@click.option("--nproc", type=COUNT, default=None, help="Local ranks to launch (default: 2 on CPU, all GPUs).")
@click.option("--device", type=OneOf(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--memory-budget", type=SIZE, default=None, help="Per-rank budget with its unit, e.g. 70GiB or 512MiB "
              f"(default: {BUDGET_FRACTION:.0%} of a GPU, or of RAM/nproc).")
@click.option("--memory-margin", type=Number(0, 1, below=True, fix="give a share in [0, 1), e.g. 0.05 for 5 %"),
              default=MEMORY_MARGIN, show_default=True,
              help="Safety share on top of each config's worst measured peak (allocator reserve, fragmentation).")
@click.option("--storage", type=STORAGE, default=None, help="Optuna storage URL [default: sqlite:///cptune.db].")
@click.option("--study-name", type=NAME, default=None, help="Default: derived from the workload and world size.")
@click.option("--n-trials", type=COUNT, default=None, help="Trials to run now (default: until every config is done).")
@click.option("--timeout", type=SECONDS, default=None, help="Stop starting trials after this many seconds.")
@click.option("--trial-timeout", type=SECONDS, default=TRIAL_TIMEOUT_S, show_default=True,
              help="Seconds before a trial is a hang.")
@click.option("--sampler", type=OneOf(["auto", "grid", "tpe"]), default="auto", show_default=True)
@click.option("--exhaustive", is_flag=True,
              help="Measure every config: the plan orders trials but skips none, and no checkpointing mode is "
                   "skipped as dominated by a fitting run with less recompute.")
@click.option("--max-tp", type=COUNT, default=1, show_default=True,
              help="With --model: also try tensor parallelism up to this degree inside a node, the model split by its "
                   "own TP plan (its own study).")
@click.option("--min-seconds", type=Number(0, fix="give 0 or more seconds"), default=1.0, show_default=True,
              help="Timing scale: screening and each race round time a config for a quarter of this "
                   "(and of the 20-step cap; 1 step at least).")
@click.option("--out", type=OutputFile(), default=None, help="Write the best config's recipe here.")
@click.option("--script", type=CheckedPath("give the training script's path", exists=True, dir_okay=False),
              default=None,
              help="Training script the recipe launches.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def search_command(seq_lens, batch, heads, kv_heads, head_dim, dtype, causal, layers, compile_, ac, step, model,
                   model_overrides, documents, window, video, loss, nproc, device, memory_budget, memory_margin, storage,
                   study_name, n_trials, timeout, trial_timeout, sampler, exhaustive, max_tp, min_seconds, out,
                   script, as_json) -> None:
    """Measure context-parallel configurations on real ranks and pick the fastest that fits in memory.

    \b
    One machine:  cptune search --seq-len 8192 --nproc 2 --memory-budget 2GiB --out recipes/x.yaml
    A cluster:    torchrun --nnodes 2 --nproc-per-node 8 ... -m cptune search --seq-len 131072 ...
    """
    import optuna

    from ..search import Workload

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lengths = seq_lens  # a list: click reads the default through LENGTHS too
    fields = dict(seq_len=lengths[0], batch=batch, dtype=dtype, causal=causal, compile=compile_, ac=ac, step=step,
                  documents=documents, window=window, loss=loss, video=video)
    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("heads", "kv_heads", "head_dim", "layers")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if model_overrides and not model:
        raise CPTuneError("--model-override: changes a --model's config, and no --model is given. Fix: add --model "
                          "PATH, or leave --model-override out")
    if loss == "whole" and not model:
        raise CPTuneError("--loss: is how a --model's step takes its loss, and no --model is given. Fix: add --model "
                          "PATH, or leave --loss out")
    if model and given:
        raise CPTuneError(f"{'/'.join(given)}: a --model's come from its config. Fix: leave them out, or change the "
                          "model with --model-override (num_hidden_layers=4)")
    if model:  # the attention shape is the model's
        from ..models import model_workload, parse_overrides

        workload = model_workload(model, parse_overrides(model_overrides), **fields)
    else:
        workload = Workload(heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=layers, **fields)
    if step and "" not in sys.path:
        sys.path.insert(0, "")  # --workload modules are found from the current folder, like python -m
    is_rank0, joined = _init_torchrun()
    try:
        _search(workload, lengths, is_rank0, nproc=nproc, device=device, memory_budget=memory_budget,
                memory_margin=memory_margin, storage=storage, study_name=study_name, n_trials=n_trials,
                timeout=timeout, trial_timeout=trial_timeout, sampler=sampler, exhaustive=exhaustive,
                max_tp=max_tp, min_seconds=min_seconds, as_json=as_json, out=out, script=script)
    except BaseException as exc:  # noqa: BLE001 - under torchrun every way out goes through _leave
        if not joined:
            raise
        _leave(_said(exc))
    if joined:
        _leave(0)


def _said(exc: BaseException) -> int:
    """Say what ended a torchrun rank's search as the CLI would outside torchrun; its exit code."""
    if isinstance(exc, SystemExit):  # stopped by a signal: its line is printed
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, CPTuneError):
        click.secho(f"error: {in_flags(exc, search_command)}", fg="red", err=True)
    elif isinstance(exc, KeyboardInterrupt):
        click.echo("\ncptune: interrupted", err=True)
        return 130
    else:  # a defect: its traceback is what to report
        import traceback

        traceback.print_exception(exc)
    return 1


def _search(workload, lengths, is_rank0, *, nproc, device, memory_budget, memory_margin, storage, study_name,
            n_trials, timeout, trial_timeout, sampler, exhaustive, max_tp, min_seconds, as_json, out, script) -> None:
    """The search command once its workload is built: run it, report on rank 0, exit 130/143 on a signal."""
    import torch

    from ..search import MeasureSettings
    from ..search import search as run_search

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if is_rank0:
        click.echo(f"cptune search: {workload.describe()}", err=True)
    from ..recipe import command_line
    from ..search.interrupts import Interrupts, SearchInterrupted

    atexit.unregister(_end_helpers)  # once, however many searches this process runs
    atexit.register(_end_helpers)
    results = []
    try:  # a signal while the result is printed or the recipe written is held to the end, then stops too
        with Interrupts() if is_rank0 else contextlib.nullcontext():
            found = run_search(workload, seq_lens=lengths if len(lengths) > 1 else None, nproc=nproc,
                               device=device, memory_budget=memory_budget, memory_margin=memory_margin,
                               storage=storage, study_name=study_name, n_trials=n_trials, timeout=timeout,
                               trial_timeout=trial_timeout, sampler=sampler, exhaustive=exhaustive, max_tp=max_tp,
                               settings=MeasureSettings(min_seconds=min_seconds), progress=progress())
            if found is not None:  # None: a torchrun rank other than 0
                results = found if isinstance(found, list) else [found]
                report_search(results, as_json, out, script)
    except SearchInterrupted as exc:
        click.echo("\n" + exc.after(results).message(command_line()), err=True)
        sys.exit(exc.exit_code)


def _end_helpers() -> None:
    """The command's last act, at exit: the fork server its ranks came from and multiprocessing's resource tracker
    end before this process does, not after it, when the shell's next command could find them. At exit rather than
    as the search returns: by then the semaphores of the ranks' queues are freed (else the tracker would call them
    leaked), and a caller that runs the command in its own process (a test) keeps both for its other groups until
    it ends. A second Ctrl-C meanwhile is ignored: the exit code is decided."""
    import signal

    from ..launch import stop_helpers

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_helpers()
