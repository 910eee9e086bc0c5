"""The ``cptune`` command group and its small subcommands, each a thin call into the library, in this file's order
(what they print: ``_console``): ``report``, ``launch``, ``show``, ``check``, ``index``, ``ls``, ``cp``; ``search``
lives in ``_search``, ``plan`` and ``probe`` in ``_plan``.

Heavy modules (torch, optuna) are imported inside the commands that use them, so `cptune --help` starts fast.
Click checks every option's value (``_types``): a bad one is a usage error naming it, exit code 2. Any
:class:`~cptune.CPTuneError` becomes a message on stderr (its Python names said as flags) and exit code 1;
Ctrl-C, exit code 130
(``cptune search`` stops cleanly on SIGINT or SIGTERM and says how to resume).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

from ._types import COUNT, ENDPOINT, FOLDER, NAME, RECIPE, STORAGE, Whole, refuse
from ..errors import CPTuneError, Problem, ValidationError
from ._console import print_result
from ..sizes import format_rate, format_size


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CPTuneError as exc:  # the library names Python arguments; here they become this command's flags
            refuse(ctx, exc, self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None)
        except KeyboardInterrupt:  # Ctrl-C where no command holds it: the shell's code, not click's "Aborted!"
            click.echo("\ncptune: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="cptune")
def main() -> None:
    """Context parallelism for PyTorch: search the fastest configuration, write recipes, launch them."""


def _mixers_line(workload, config, cp: int) -> str | None:
    """How a hybrid model's layers that mix tokens outside attention cross the cp ranks ('18 x Qwen3_5GatedDeltaNet
    split over heads'), or None (no --model, cp 1, no such layers, or the model is not at hand here)."""
    if not workload.model or cp == 1:
        return None
    from collections import Counter

    from .. import models

    try:
        config_ = models.load_config(workload.model, workload.model_overrides)
        found = Counter(models.mixer_paths(config_, cp=cp, mixers=config.mixers).values())
    except (CPTuneError, OSError, ImportError):  # the model's folder is on another machine, or no transformers here
        return None
    ways = {"heads": "split over heads (all-to-all)", "halo": "split by a halo exchange",
            "generic": "whole on every rank (generic path)"}
    return "; ".join(f"{n} x {kind} {ways[taken]}" for (kind, taken), n in found.items()) or None


@main.command()
@click.argument("study_name", metavar="STUDY", type=NAME)
@click.option("--storage", type=STORAGE, default=None, help="Optuna storage URL [default: sqlite:///cptune.db].")
@click.option("--out", type=FOLDER, default=None, help="Write report.png here.")
@click.option("--json", "as_json", is_flag=True)
def report(study_name, storage, out, as_json) -> None:
    """Print STUDY's ranked table; with --out, a PNG of tokens/s (with spread) and peak memory vs the budget."""
    from ..search.report import load_result, plot

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
@click.argument("recipe_path", metavar="RECIPE", type=RECIPE)
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, metavar="[OVERRIDES] [TORCHRUN OPTIONS]")
@click.option("--dry-run", is_flag=True, help="Print the torchrun command instead of running it.")
@click.option("--nnodes", type=COUNT, default=None, help="Override the recipe's node count.")
@click.option("--node-rank", type=Whole(0), default=None, envvar=["PET_NODE_RANK", "NODE_RANK"],
              help="This node's rank (multi-node) [env: PET_NODE_RANK, NODE_RANK].")
@click.option("--rdzv-endpoint", type=ENDPOINT, default=None, envvar="PET_RDZV_ENDPOINT",
              help="HOST:PORT of node 0 (multi-node) [env: PET_RDZV_ENDPOINT].")
def launch(recipe_path, extra, dry_run, nnodes, node_rank, rdzv_endpoint) -> None:
    """Run the recipe's training script with torchrun, as RECIPE says.

    \b
    cptune launch RECIPE [section.field=value ...] [torchrun options] [-- [script.py] script args]
    cptune launch recipes/x.yaml --max-restarts 3 -- --steps 20
    cptune launch recipes/x.yaml config.rotate_method=alltoall -- examples/train_llama_cp.py --compile

    Overrides change the recipe for this run only (it is then marked unmeasured); other options
    go to torchrun; after --, a first argument ending in .py is the script, the rest its arguments.
    """
    from ..recipe import ENV_VAR, load_recipe, save_recipe, script_problem

    after = click.get_current_context().meta.get("after_dashes", [])
    overrides = [x for x in extra if "=" in x and not x.startswith("-")]
    options = [x for x in extra if x not in overrides]
    stray = [x for i, x in enumerate(options) if not x.startswith("-") and (i == 0 or not options[i - 1].startswith("-"))]
    if stray:
        raise ValidationError([Problem("extra", f"{stray[0]!r} is neither an override nor a torchrun option",
                                       "put the script and its arguments after --: cptune launch RECIPE -- "
                                       "train.py ARGS")])
    recipe = load_recipe(recipe_path)
    script, args = (after[0], after[1:]) if after and after[0].endswith(".py") else (None, after or None)
    patched = recipe.with_overrides(overrides)
    argv = patched.torchrun_args(script, args, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                                 torchrun_options=options)
    script = script or patched.launch.script
    problem = script_problem(script)
    if problem is not None:
        raise ValidationError([problem])
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
    from ._preflight import preflight

    # the script's own checks, once, before torchrun starts a rank: a bad override is one message, not one a rank
    preflight(script, args if args is not None else list(patched.launch.args), recipe_abs,
              (nnodes or patched.launch.nnodes) * patched.launch.nproc_per_node, patched.launch.nproc_per_node)
    os.environ[ENV_VAR] = recipe_abs  # the ranks read the recipe from it
    sys.exit(_torchrun(argv[1:]))


def _torchrun(args: list[str]) -> int:
    """torchrun's agent in this process (``python -m torch.distributed.run ARGS`` without a second interpreter):
    its exit code; a rank's failure is torchrun's summary of it, not a traceback of cptune."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(args)
    except ChildFailedError as exc:
        click.echo(exc.format_msg(), err=True)
        return 1
    except SignalException as exc:  # the job was signalled: torchrun stopped its ranks
        click.echo(f"cptune launch: stopped by {exc.sigval.name}", err=True)
        return 128 + int(exc.sigval)
    return 0


def _launch_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="cptune-launch-")


@main.command()
@click.argument("recipe_path", metavar="RECIPE", type=RECIPE)
@click.option("--json", "as_json", is_flag=True)
def show(recipe_path, as_json) -> None:
    """Print RECIPE readably."""
    from ..recipe import load_recipe

    recipe = load_recipe(recipe_path)
    if as_json:
        click.echo(json.dumps(recipe.model_dump(mode="json"), indent=2))
        return
    m, p = recipe.metrics, recipe.provenance
    click.echo(recipe.header(recipe_path).rstrip())
    click.echo(f"workload : {recipe.workload.describe()}")
    w, c = recipe.workload, recipe.config
    mesh = c.parallel_dims(recipe.launch.world_size)
    if w.model:
        click.echo(f"model run: {w.model}" + (f" with {w.model_overrides}" if w.model_overrides else "")
                   + f", {w.seq_len} tokens x {w.batch} per replica, {w.documents or 'unpacked'}, ac {w.ac}, "
                   f"compile {'on' if w.compile else 'off'}, FSDP2 over dp x cp"
                   + (", tp by the model's own plan" if mesh.tp > 1 else "")
                   + (f", each MoE layer's experts split over groups of {mesh.ep} ranks (ep{mesh.ep}, tokens traded "
                      "by all-to-all)" if mesh.ep > 1 else "") + ", AdamW")
    click.echo(f"config   : {c.label()}" + ("" if mesh.cp == 1 else f"  (strategy {c.strategy}"
               + (f", ulysses_degree {c.ulysses_degree}" if c.ulysses_degree else "") + ")"))
    mixers = _mixers_line(w, c, mesh.cp)
    if mixers:
        click.echo(f"mixers   : {mixers}")
    click.echo(f"launch   : {recipe.launch.nnodes} node(s) x {recipe.launch.nproc_per_node} ranks, "
               f"script {recipe.launch.script or '(give one after --)'}")
    if m.predicted_by:  # cptune plan's figures, for hardware not at hand
        click.echo(f"predicted: {format_rate(m.tokens_per_s / p.device_count)} tokens/s per GPU, step {m.step_time_s:.3f}s, "
                   f"peak/GPU {format_size(max(m.peak_bytes_per_rank or [0]))} (budget {format_size(m.memory_budget)}) "
                   f"by {m.predicted_by}")
    status, why = "not measured" if m.predicted_by else recipe.figures_status(), {
        "edited after measuring": "no: edited after measuring, the figures are for another configuration "
                                  "(re-run cptune search)",
        "not verifiable (no digest)": "not verifiable: the recipe has no digest, so its figures cannot be "
                                      "checked against what was measured (re-run cptune search)",
        "not measured": f"no (not measured{': ' + m.note if m.note else ''})"}
    figures = (f"{format_rate(m.tokens_per_s)} tokens/s, step {m.step_time_s:.3f}s, peak/rank "
               f"{', '.join(format_size(b) for b in m.peak_bytes_per_rank or [])} (budget "
               f"{format_size(m.memory_budget)}" + (f", headroom {m.headroom:.0%}" if m.headroom is not None else "")
               + ")" if status is None else why[status])
    click.echo("measured : " + figures + (f", compile {m.compile_s:.1f}s (not in tokens/s)"
                                          if m.compile_s is not None and status is None else ""))
    click.echo(f"from     : {p.device_count} x {p.device} ({p.backend}), torch {p.torch_version}, cptune "
               f"{p.cptune_version}, {p.date}" + (f", study {p.study_name} ({p.n_trials} trials)" if p.study_name else ""))


@main.command()
@click.argument("recipe_path", metavar="RECIPE", type=RECIPE)
@click.option("--world-size", type=COUNT, default=None, help="The job's world size, to compare with the recipe.")
@click.option("--json", "as_json", is_flag=True, help="Print the mismatches as JSON (exit 1 if any).")
def check(recipe_path, world_size, as_json) -> None:
    """Compare RECIPE with this environment; list every mismatch with its fix (exit 1 if any)."""
    from ._recipe_check import check_recipe, recipe_notes
    from ..recipe import load_recipe

    recipe = load_recipe(recipe_path)
    problems = check_recipe(recipe, world_size)
    for note in recipe_notes(recipe):
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"recipe": recipe_path, "ok": not problems, "problems": [
            {"argument": p.argument, "message": p.message, "fix": p.fix} for p in problems]}, indent=2))
        sys.exit(1 if problems else 0)
    if problems:
        raise ValidationError(problems)
    click.echo(f"{recipe_path}: matches this environment")


@main.command()
@click.argument("folder", type=FOLDER, default="recipes")
@click.option("--check", "check_only", is_flag=True, help="Exit 1 if FOLDER/README.md is not up to date.")
@click.option("--force", is_flag=True, help="Replace a README.md that cptune index did not write.")
def index(folder, check_only, force) -> None:
    """Write FOLDER/README.md, the index of the recipes found in FOLDER."""
    from ._catalog import index_text, write_index

    if check_only:
        target = Path(folder) / "README.md"
        if not target.is_file() or target.read_text() != index_text(folder):
            raise CPTuneError(f"{target} is out of date: run cptune index {folder}")
        click.echo(f"{target} is up to date")
        return
    click.echo(f"written: {write_index(folder, force)}")


@main.command(name="ls")
@click.argument("folders", nargs=-1, type=FOLDER)
@click.option("--json", "as_json", is_flag=True)
def list_recipes(folders, as_json) -> None:
    """List the shipped recipes and those in FOLDERS (default: ./recipes and ./runs), with their figures."""
    from ._catalog import listing

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
@click.argument("name", type=NAME)
@click.argument("dest", type=click.Path())
def copy_recipe(name, dest) -> None:
    """Copy the shipped recipe NAME to DEST (a file or a folder), to edit and launch."""
    from ._catalog import copy_shipped

    click.echo(f"copied: {copy_shipped(name, dest)}")


from ._plan import plan_command, probe_command  # noqa: E402  (their own modules: this one stays short)
from ._search import search_command  # noqa: E402

main.add_command(search_command)
main.add_command(plan_command)
main.add_command(probe_command)
