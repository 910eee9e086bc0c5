"""The ``cptune`` command: each subcommand is a thin call into the library.

In this file's order (what they print: ``_console``): ``search``, ``report``, ``launch``, ``show``,
``check``, ``index``, ``ls``, ``cp``; ``plan`` and ``probe`` live in ``_cli_plan``.

Heavy modules (torch, optuna) are imported inside the commands that use them, so `cptune --help` starts fast.
Any :class:`~cptune.CPTuneError` becomes a message on stderr and exit code 1; Ctrl-C, exit code 130
(``cptune search`` stops cleanly on SIGINT or SIGTERM and says how to resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import click

from .errors import CPTuneError, Problem, ValidationError
from ._console import print_result, progress, report_search
from .sizes import format_size


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CPTuneError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:  # Ctrl-C where no command holds it: the shell's code, not click's "Aborted!"
            click.echo("\ncptune: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="cptune")
def main() -> None:
    """Context parallelism for PyTorch: search the fastest configuration, write recipes, launch them."""


def _init_torchrun() -> bool:
    """Inside torchrun (RANK set): join its process group. Returns whether this is rank 0."""
    if "RANK" not in os.environ:
        return True
    from .launch import init_rank

    return init_rank()[2] == 0


@main.command()
@click.option("--seq-len", default="4096", show_default=True,
              help="Tokens per sequence; several, comma-separated (8192,16384,32768), search each on the same ranks.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per data-parallel replica.")
@click.option("--heads", type=int, default=8, show_default=True)
@click.option("--kv-heads", type=int, default=None, help="Key/value heads (GQA); default = --heads.")
@click.option("--head-dim", type=int, default=64, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--layers", type=int, default=1, show_default=True, help="Attention layers in the proxy step.")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile each proxy layer (compile time reported apart).")
@click.option("--ac", type=click.Choice(["none", "full", "selective", "auto"]), default="none", show_default=True,
              help="Activation checkpointing per layer, as the training run will use; auto: search all three.")
@click.option("--workload", "step", default=None, metavar="MODULE:FUNCTION",
              help="Tune your own step: a function (workload, device) -> (step, buffers, seq_dims).")
@click.option("--model", default=None, metavar="PATH",
              help="Tune a transformers model's training step: a local model directory or its config.json.")
@click.option("--model-override", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change the model's config before building it (repeatable), e.g. num_hidden_layers=4.")
@click.option("--documents", default=None, metavar="SPEC",
              help="Packed documents per sequence: a count of equal ones (16), 'longtail', or lengths (1024,512,...).")
@click.option("--window", type=int, default=None, metavar="N",
              help="Causal sliding window: each token attends to N earlier tokens (4095 for sliding_window=4096).")
@click.option("--nproc", type=int, default=None, help="Local ranks to launch (default: 2 on CPU, all GPUs).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--memory-budget", default=None, help="Per-rank budget with its unit, e.g. 70GiB or 512MiB "
              "(default: 90% of a GPU, or of RAM/nproc).")
@click.option("--memory-margin", type=float, default=0.05, show_default=True,
              help="Safety share on top of each config's worst measured peak (allocator reserve, fragmentation).")
@click.option("--storage", default=None, help="Optuna storage URL [default: sqlite:///cptune.db].")
@click.option("--study-name", default=None, help="Default: derived from the workload and world size.")
@click.option("--n-trials", type=int, default=None, help="Trials to run now (default: until every config is done).")
@click.option("--timeout", type=float, default=None, help="Stop starting trials after this many seconds.")
@click.option("--trial-timeout", type=float, default=300.0, show_default=True, help="Seconds before a trial is a hang.")
@click.option("--sampler", type=click.Choice(["auto", "grid", "tpe"]), default="auto", show_default=True)
@click.option("--exhaustive", is_flag=True, help="Measure every config: the plan orders trials but skips none.")
@click.option("--min-seconds", type=float, default=1.0, show_default=True,
              help="Timing scale: screening and each race round time a config for a quarter of this "
                   "(and of the 20-step cap; 1 step at least).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the best config's recipe here.")
@click.option("--script", default=None, help="Training script the recipe launches.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def search(seq_len, batch, heads, kv_heads, head_dim, dtype, causal, layers, compile_, ac, step, model, overrides,
           documents, window,
           nproc, device,
           memory_budget, memory_margin, storage,
           study_name, n_trials, timeout, trial_timeout, sampler, exhaustive, min_seconds, out, script,
           as_json) -> None:
    """Measure context-parallel configurations on real ranks and pick the fastest that fits in memory.

    \b
    One machine:  cptune search --seq-len 8192 --nproc 2 --memory-budget 2GiB --out recipes/x.yaml
    A cluster:    torchrun --nnodes 2 --nproc-per-node 8 ... -m cptune search --seq-len 131072 ...
    """
    import optuna
    import torch

    from .search import MeasureSettings, Workload
    from .search import search as run_search

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        lengths = [int(x) for x in str(seq_len).split(",") if x.strip()]
    except ValueError:
        raise CPTuneError(f"--seq-len: cannot read {seq_len!r}. Fix: give a length like 8192, or several like "
                          "8192,16384,32768") from None
    fields = dict(seq_len=lengths[0] if lengths else 0, batch=batch, dtype=dtype, causal=causal, compile=compile_,
                  ac=ac, step=step, documents=documents, window=window)
    if model and (heads, kv_heads, head_dim, layers) != (8, None, 64, 1):
        raise CPTuneError("--heads/--kv-heads/--head-dim/--layers: a --model's come from its config. Fix: leave "
                          "them out, or change the model with --model-override (num_hidden_layers=4)")
    if model:  # the attention shape is the model's
        from .models import model_workload, parse_overrides

        workload = model_workload(model, parse_overrides(overrides), **fields)
    else:
        workload = Workload(heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=layers, **fields)
    if step and "" not in sys.path:
        sys.path.insert(0, "")  # --workload modules are found from the current folder, like python -m
    is_rank0 = _init_torchrun()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if is_rank0:
        click.echo(f"cptune search: {workload.describe()}", err=True)
    from .recipe import command_line
    from .search.interrupts import Interrupts, SearchInterrupted

    results = []
    try:  # a signal while the result is printed or the recipe written is held to the end, then stops too
        with Interrupts() if is_rank0 else contextlib.nullcontext():
            found = run_search(workload, seq_lens=lengths if len(lengths) > 1 else None, nproc=nproc,
                               device=device, memory_budget=memory_budget, memory_margin=memory_margin,
                               storage=storage, study_name=study_name, n_trials=n_trials, timeout=timeout,
                               trial_timeout=trial_timeout, sampler=sampler, exhaustive=exhaustive,
                               settings=MeasureSettings(min_seconds=min_seconds), progress=progress())
            if found is not None:  # None: a torchrun rank other than 0
                results = found if isinstance(found, list) else [found]
                report_search(results, as_json, out, script)
    except SearchInterrupted as exc:
        click.echo("\n" + exc.after(results).message(command_line()), err=True)
        sys.exit(exc.exit_code)


@main.command()
@click.argument("study_name", metavar="STUDY")
@click.option("--storage", default=None, help="Optuna storage URL [default: sqlite:///cptune.db].")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Write report.png here.")
@click.option("--json", "as_json", is_flag=True)
def report(study_name, storage, out, as_json) -> None:
    """Print STUDY's ranked table; with --out, a PNG of tokens/s (with spread) and peak memory vs the budget."""
    from .search.report import load_result, plot

    result = load_result(study_name, storage)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        print_result(result)
    if out:
        click.echo(f"written: {plot(result, out)}", err=True)


class _SplitAtDashes(click.Command):
    """Keeps what follows the first ``--`` apart: the script's own arguments, never parsed here."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["after_dashes"] = args[:cut], args[cut + 1:]
        return super().parse_args(ctx, args)


@main.command(cls=_SplitAtDashes, context_settings={"ignore_unknown_options": True})
@click.argument("recipe_path", metavar="RECIPE", type=click.Path())
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.option("--dry-run", is_flag=True, help="Print the torchrun command instead of running it.")
@click.option("--nnodes", type=int, default=None, help="Override the recipe's node count.")
@click.option("--node-rank", type=int, default=None, help="This node's rank (multi-node).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (multi-node).")
def launch(recipe_path, extra, dry_run, nnodes, node_rank, rdzv_endpoint) -> None:
    """Run the recipe's training script with torchrun, as RECIPE says.

    \b
    cptune launch RECIPE [section.field=value ...] [torchrun options] [-- [script.py] script args]
    cptune launch recipes/x.yaml --max-restarts 3 -- --steps 20
    cptune launch recipes/x.yaml config.rotate_method=alltoall -- examples/train_llama_cp.py --compile

    Overrides change the recipe for this run only (it is then marked unmeasured); other options
    go to torchrun; after --, a first argument ending in .py is the script, the rest its arguments.
    """
    from .recipe import ENV_VAR, load_recipe, save_recipe

    after = click.get_current_context().meta.get("after_dashes", [])
    overrides = [x for x in extra if "=" in x and not x.startswith("-")]
    options = [x for x in extra if x not in overrides]
    stray = [x for i, x in enumerate(options) if not x.startswith("-") and (i == 0 or not options[i - 1].startswith("-"))]
    if stray:
        raise ValidationError([Problem("launch", f"{stray[0]!r} is neither an override nor a torchrun option",
                                       "put the script and its arguments after --: cptune launch RECIPE -- "
                                       "train.py ARGS")])
    recipe = load_recipe(recipe_path)
    script, args = (after[0], after[1:]) if after and after[0].endswith(".py") else (None, after or None)
    patched = recipe.with_overrides(overrides)
    argv = patched.torchrun_args(script, args, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                                 torchrun_options=options)
    script = script or patched.launch.script
    if not Path(script).is_file():
        raise ValidationError([Problem("script", f"{script!r} does not exist",
                                       "give the path of the training script after --")])
    recipe_abs = str(Path(recipe_path).resolve())
    if overrides:
        click.echo(f"cptune launch: {patched.metrics.note}", err=True)
        recipe_abs = str(save_recipe(patched, Path(_launch_dir()) / Path(recipe_path).name))
    if recipe.metrics.predicted_by:
        click.echo(f"cptune launch: {recipe_path} is predicted by cptune plan, not measured: its figures are "
                   "estimates (measure with cptune search on these GPUs)", err=True)
    if dry_run:
        click.echo(shlex.join([f"{ENV_VAR}={recipe_abs}", *argv]))
        return
    env = {**os.environ, ENV_VAR: recipe_abs}
    code = subprocess.call([sys.executable, "-m", "torch.distributed.run", *argv[1:]], env=env)
    sys.exit(code)


def _launch_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="cptune-launch-")


@main.command()
@click.argument("recipe_path", metavar="RECIPE", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def show(recipe_path, as_json) -> None:
    """Print RECIPE readably."""
    from .recipe import load_recipe

    recipe = load_recipe(recipe_path)
    if as_json:
        click.echo(json.dumps(recipe.model_dump(mode="json"), indent=2))
        return
    m, p = recipe.metrics, recipe.provenance
    click.echo(recipe.header(recipe_path).rstrip())
    click.echo(f"workload : {recipe.workload.describe()}")
    w = recipe.workload
    if w.model:
        click.echo(f"model run: {w.model}" + (f" with {w.model_overrides}" if w.model_overrides else "")
                   + f", {w.seq_len} tokens x {w.batch} per replica, {w.documents or 'unpacked'}, ac {w.ac}, "
                   f"compile {'on' if w.compile else 'off'}, FSDP2 over dp x cp, AdamW")
    c = recipe.config
    cp_ranks = c.mesh_shape[1] if c.mesh_shape else recipe.launch.world_size
    click.echo(f"config   : {c.label()}" + ("" if cp_ranks == 1 else f"  (strategy {c.strategy}"
               + (f", ulysses_degree {c.ulysses_degree}" if c.ulysses_degree else "") + ")"))
    click.echo(f"launch   : {recipe.launch.nnodes} node(s) x {recipe.launch.nproc_per_node} ranks, "
               f"script {recipe.launch.script or '(give one after --)'}")
    if m.predicted_by:  # cptune plan's figures, for hardware not at hand
        click.echo(f"predicted: {m.tokens_per_s / p.device_count:,.0f} tokens/s per GPU, step {m.step_time_s:.3f}s, "
                   f"peak/GPU {format_size(max(m.peak_bytes_per_rank or [0]))} (budget {format_size(m.memory_budget)}) "
                   f"by {m.predicted_by}")
    status, why = "not measured" if m.predicted_by else recipe.figures_status(), {
        "edited after measuring": "no: edited after measuring, the figures are for another configuration "
                                  "(re-run cptune search)",
        "not verifiable (no digest)": "not verifiable: the recipe has no digest, so its figures cannot be "
                                      "checked against what was measured (re-run cptune search)",
        "not measured": f"no (not measured{': ' + m.note if m.note else ''})"}
    figures = (f"{m.tokens_per_s:,.0f} tokens/s, step {m.step_time_s:.3f}s, peak/rank "
               f"{', '.join(format_size(b) for b in m.peak_bytes_per_rank or [])} (budget "
               f"{format_size(m.memory_budget)}" + (f", headroom {m.headroom:.0%}" if m.headroom is not None else "")
               + ")" if status is None else why[status])
    click.echo("measured : " + figures + (f", compile {m.compile_s:.1f}s (not in tokens/s)"
                                          if m.compile_s is not None and status is None else ""))
    click.echo(f"from     : {p.device_count} x {p.device} ({p.backend}), torch {p.torch_version}, cptune "
               f"{p.cptune_version}, {p.date}" + (f", study {p.study_name} ({p.n_trials} trials)" if p.study_name else ""))


@main.command()
@click.argument("recipe_path", metavar="RECIPE", type=click.Path())
@click.option("--world-size", type=int, default=None, help="The job's world size, to compare with the recipe.")
@click.option("--json", "as_json", is_flag=True, help="Print the mismatches as JSON (exit 1 if any).")
def check(recipe_path, world_size, as_json) -> None:
    """Compare RECIPE with this environment; list every mismatch with its fix (exit 1 if any)."""
    from ._recipe_check import check_recipe
    from .recipe import load_recipe

    problems = check_recipe(load_recipe(recipe_path), world_size)
    if as_json:
        click.echo(json.dumps({"recipe": recipe_path, "ok": not problems, "problems": [
            {"argument": p.argument, "message": p.message, "fix": p.fix} for p in problems]}, indent=2))
        sys.exit(1 if problems else 0)
    if problems:
        raise ValidationError(problems)
    click.echo(f"{recipe_path}: matches this environment")


@main.command()
@click.argument("folder", type=click.Path(file_okay=False), default="recipes")
@click.option("--check", "check_only", is_flag=True, help="Exit 1 if FOLDER/README.md is not up to date.")
@click.option("--force", is_flag=True, help="Replace a README.md that cptune index did not write.")
def index(folder, check_only, force) -> None:
    """Write FOLDER/README.md, the index of the recipes found in FOLDER."""
    from .catalog import index_text, write_index

    if check_only:
        target = Path(folder) / "README.md"
        if not target.is_file() or target.read_text() != index_text(folder):
            raise CPTuneError(f"{target} is out of date: run cptune index {folder}")
        click.echo(f"{target} is up to date")
        return
    click.echo(f"written: {write_index(folder, force)}")


@main.command(name="ls")
@click.argument("folders", nargs=-1, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def list_recipes(folders, as_json) -> None:
    """List the shipped recipes and those in FOLDERS (default: ./recipes and ./runs), with their figures."""
    from .catalog import listing

    rows = listing(list(folders) or ["recipes", "runs"])
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no recipes found (cptune search --out FILE writes one)")
    for r in rows:
        detail = f"error: {r['error']}" if "error" in r else \
            f"{r['config']:<30} {r['ranks']} ranks  {r['figures']:<22} {r['workload']}"
        click.echo(f"{r['where']:<8} {r['name']:<32} {detail}")
    click.echo("\n(copy one to edit: cptune cp NAME DEST; run one: cptune launch PATH)")


@main.command(name="cp")
@click.argument("name")
@click.argument("dest", type=click.Path())
def copy_recipe(name, dest) -> None:
    """Copy the shipped recipe NAME to DEST (a file or a folder), to edit and launch."""
    from .catalog import copy_shipped

    click.echo(f"copied: {copy_shipped(name, dest)}")


from ._cli_plan import plan_command, probe_command  # noqa: E402  (their own module: cli.py stays short)

main.add_command(plan_command)
main.add_command(probe_command)
