"""What the training scripts take, as click options of cptune's checked types (``cptune.cli._types``), and the checks
that read them together: every value is refused by name, with its fix, before a rank starts or a model is built.

Each script is a :class:`~cptune.cli._types.Script` command: a bad value is click's usage error naming the flag
(exit 2), a :class:`~cptune.CPTuneError` the script's one error line naming the flag (exit 1), as ``cptune``'s own
commands say them. ``tests/test_cli_walk.py`` walks every option of every script as it walks ``cptune``'s.
"""

from __future__ import annotations

import os
from typing import Any

import click

from cptune.cli import (COUNT, DOCUMENTS, FINITE_RATE, FOLDER, KEY_VALUE, RECIPE, VIDEO, InputFile, OneOf,
                        OutputFile, Script, Whole)
from cptune.errors import Problem, ValidationError, raise_if
from cptune.mesh import ParallelDims
from cptune.workload import AC_MODES

recipe = click.option("--recipe", "recipe_path", type=RECIPE, default=None, envvar="CPTUNE_RECIPE",
                      show_envvar=True, help="Recipe file (default: $CPTUNE_RECIPE, else no CP).")
seq_len = click.option("--seq-len", type=COUNT, default=None, help="Tokens per sequence (default: the recipe's).")
batch = click.option("--batch", type=COUNT, default=None,
                     help="Global batch, split over dp replicas (default: as the recipe was measured, else 2).")
losses_out = click.option("--losses-out", type=OutputFile(), default=None,
                          help="Write the per-step losses here (JSON).")
compile_ = click.option("--compile/--no-compile", "compile_", default=None,
                        help="torch.compile each block (default: as the recipe was measured, else off).")
ac = click.option("--ac", type=OneOf(list(AC_MODES)), default=None,
                  help="Activation checkpointing (default: as the recipe was measured, else none).")
documents = click.option("--documents", type=DOCUMENTS, default=None, metavar="SPEC",
                         help="Documents per sequence: 8 (equal), longtail, or lengths (default: the recipe's).")
video = click.option("--video", type=VIDEO, default=None, metavar="T,H,W",
                     help="A vision-language model: one synthetic video a row, its grid in patches (temporal patches, "
                          "height, width) [default: the recipe's].")
model = click.option("--model", type=InputFile(dir_okay=True, fix="give a local model directory (with config.json) "
                                               "or its config.json"), default=None,
                     help="Model directory or config.json (default: the recipe's).")
model_override = click.option("--model-override", "model_overrides", type=KEY_VALUE, multiple=True,
                              metavar="KEY=VALUE",
                              help="Change the model's config (repeatable; default: the recipe's).")


def steps(default: int):
    return click.option("--steps", type=COUNT, default=default, show_default=True, help="Training steps.")


def lr(default: float):
    return click.option("--lr", type=FINITE_RATE, default=default, show_default=True, help="Learning rate.")


def read_recipe(path: str | None) -> Any:
    """The recipe (checked whole by :func:`cptune.load_recipe`), or None."""
    if path is None:
        return None
    from cptune.recipe import load_recipe

    return load_recipe(path)


def world_size() -> int:
    """The job's world size before any rank has joined (torchrun's WORLD_SIZE; 1 under python)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def no_experts(config: Any) -> None:
    """Refuse, by name, a configuration with expert parallelism for a script whose model has no mixture of experts."""
    if config is not None and config.ep_degree > 1:
        raise ValidationError([Problem("config.ep_degree", f"is {config.ep_degree}, and this script's model has no "
                                       "mixture of experts to split", "use config.ep_degree=1, or train a "
                                       "transformers mixture of experts with cptune.examples.train_hf")])


def mesh_and_batch(config: Any, recipe: Any, batch: int | None, *, tp: bool = False,
                   ep: bool = False) -> tuple[ParallelDims, int]:
    """(the named mesh, global batch) of ``config`` on this job's ranks: ``batch``, else as the recipe was measured
    (its batch per replica on every replica), else 2; refused, naming --batch, when its rows do not split over dp.
    ``tp``: whether the script splits its model by tensor parallelism (else a mesh with tp is refused by name);
    ``ep``: whether it splits a mixture of experts (else an ep_degree above 1 is refused by name)."""
    world = world_size()
    if not ep:
        no_experts(config)
    if not tp:
        config.dp_cp(world, where="this script splits no model by tensor parallelism: it runs")
    dims = config.parallel_dims(world)
    dp = dims.dp
    batch = batch or (dp * recipe.workload.batch if recipe else 2)
    if batch % dp:
        raise ValidationError([Problem("batch", f"{batch} rows do not split over the {dp} dp replicas of "
                                       f"{config.label()} on {world} ranks", f"give a global batch divisible by {dp}")])
    return dims, batch


def check_checkpointing(checkpoint_dir: str | None, resume: bool, save_every: int) -> None:
    """--resume and --save-every need --checkpoint-dir (without it a resumed run trains from scratch, silently)."""
    needs = [name for name, given in (("resume", resume), ("save_every", save_every)) if given]
    raise_if([Problem(name, "needs --checkpoint-dir: there is nowhere to " + (
        "resume from" if name == "resume" else "save to"), "give --checkpoint-dir DIR, or drop the option")
        for name in needs if checkpoint_dir is None])



__all__ = ["COUNT", "FOLDER", "InputFile", "OneOf", "OutputFile", "Script", "Whole", "ac", "batch", "mesh_and_batch",
           "check_checkpointing", "compile_", "documents", "losses_out", "lr", "model", "model_override", "no_experts",
           "read_recipe", "recipe", "seq_len", "steps", "world_size"]
