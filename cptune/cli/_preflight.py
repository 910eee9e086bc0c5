"""``cptune launch``'s checks before torchrun starts: the script's own, run once here as its ranks would run them, so
a recipe, an override or a script argument the script refuses is one message, not one per rank and a traceback.

A training script opts in with a module-level ``preflight(argv)`` (:func:`script_check` makes one from its click
command and its checking function; cptune's shipped scripts have it). A script that has none is launched as before:
a script file is imported only where its text names ``preflight``, so no user script's top level runs here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import Problem, ValidationError

HOOK = "preflight"


def script_check(command: click.Command, check: Callable[..., Any]) -> Callable[[list[str]], None]:
    """A script's ``preflight``: ``argv`` parsed by ``command`` (click's refusal said as a cptune error naming the
    flag), then ``check(**options)``, the script's own reading of its inputs, without training."""

    def preflight(argv: list[str]) -> None:
        try:
            ctx = command.make_context(command.name or "script", list(argv), resilient_parsing=False)
        except click.exceptions.Exit:  # --help
            return
        except click.UsageError as exc:
            name = getattr(getattr(exc, "param", None), "opts", None)
            raise ValidationError([Problem(name[0] if name else "arguments", exc.format_message(),
                                           "see the script's --help")]) from None
        with ctx:
            check(**ctx.params)

    return preflight


def _module(script: str) -> Any | None:
    from ..recipe import is_module

    if is_module(script):
        return importlib.import_module(script)
    path = Path(script)
    if not path.is_file() or HOOK not in path.read_text(errors="replace"):
        return None
    spec = importlib.util.spec_from_file_location(f"_cptune_launch_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def preflight(script: str, args: list[str], recipe_path: str, world: int, per_node: int) -> None:
    """Run ``script``'s own checks on ``args`` with the recipe at ``recipe_path`` on ``world`` ranks, as each rank
    would before it joins; raises the script's :class:`~cptune.ValidationError`. A script without them: nothing."""
    module = _module(script)
    check = getattr(module, HOOK, None) if module is not None else None
    if check is None:
        return
    with _environment({"CPTUNE_RECIPE": recipe_path, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node)}):
        check(list(args))
