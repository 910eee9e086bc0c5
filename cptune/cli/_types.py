"""What the CLI's options take, as click types: click checks each value and names the option, before the command
runs. The rules themselves live in the library (a size is :func:`~cptune.sizes.parse_size`'s, a documents spec is
the Workload's); these types only call them. :func:`in_flags` turns the Python names of a library error into the
command's flags. Every option of every command has one of these types or one of click's own checked types
(``IntRange``, ``FloatRange``, ``Choice``, ``Path``, flags): ``tests/test_cli_walk.py`` holds them to it."""

from __future__ import annotations

import re
from typing import Any

import click

from ..errors import CPTuneError, Problem, ValidationError


class _Fixed:
    """click's own check, its message followed by the fix."""

    fix = ""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)  # type: ignore[misc]
        except click.BadParameter as exc:
            self.fail(f"{exc.message.rstrip('.')}. Fix: {self.fix}", param, ctx)  # type: ignore[attr-defined]


class _Checked(click.ParamType):
    """A value read by a library rule: its ValidationError becomes click's message for this option."""

    def read(self, value: str) -> Any:
        raise NotImplementedError

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.read(value)
        except ValidationError as exc:
            self.fail("; ".join(f"{p.message}. Fix: {p.fix}" for p in exc.problems), param, ctx)


class _Read(_Checked):
    """A value a library rule reads (raising its ValidationError), given to the command as it was typed."""

    def rule(self, value: str) -> Any:
        raise NotImplementedError

    def read(self, value: str) -> str:
        self.rule(value)
        return value


class _Matching(_Checked):
    """A value of one written form (``pattern``, a regular expression the whole value matches, and ``accept`` of the
    match), else ``argument``'s problem: the value, ``what`` it is not, and the ``fix``."""

    pattern = argument = what = fix = ""

    def accept(self, match: re.Match) -> bool:
        return True

    def read(self, value: str) -> str:
        match = re.fullmatch(self.pattern, value)
        if not match or not self.accept(match):
            raise ValidationError([Problem(self.argument, f"{value!r} {self.what}", self.fix)])
        return value


class _Integers(_Checked):
    """Positive integers, comma-separated (digits only): ``count`` of them (None: one or more)."""

    count: int | None = None
    argument = what = fix = ""

    def read(self, value: str) -> list[int]:
        parts = [x.strip() for x in value.split(",")]
        found = [int(x) for x in parts] if all(re.fullmatch(r"[0-9]+", x) and int(x) > 0 for x in parts) else None
        if found is None or self.count is not None and len(found) != self.count:
            raise ValidationError([Problem(self.argument, f"cannot read {value!r} as {self.what}", self.fix)])
        return found


class Size(_Read):
    """A memory size with its unit: 70GiB, 512MiB, 2GB."""

    name = "size"

    def rule(self, value: str) -> Any:
        from ..sizes import parse_size

        return parse_size(value, "size")


class Lengths(_Integers):
    """One or more positive integers, comma-separated: 8192 or 8192,16384,32768."""

    name, argument, what = "lengths", "lengths", "positive lengths"
    fix = "give a length like 8192, or several like 8192,16384,32768"


class Dims(_Integers):
    """Six positive integers: layers, hidden, heads, kv heads, ffn, vocab."""

    name, argument, what, count = "dims", "dims", "six positive integers", 6
    fix = "give layers, hidden, heads, kv heads, ffn, vocab, e.g. 32,4096,32,8,14336,128256"

    def read(self, value: str) -> tuple[int, ...]:
        return tuple(super().read(value))


class Video(_Integers):
    """Three positive integers: a video's grid in patches (temporal patches, height, width), kept as ``'T,H,W'``."""

    name, argument, what, count = "video", "video", "three positive integers T,H,W", 3
    fix = "give the video's grid in patches as T,H,W (a video_grid_thw row), e.g. 8,16,16"

    def read(self, value: str) -> str:
        return ",".join(map(str, super().read(value)))


class KeyValue(_Read):
    """KEY=VALUE (a config field and its value); the value is read by the library."""

    name = "key=value"

    def rule(self, value: str) -> Any:
        from ..models import parse_overrides

        return parse_overrides([value], "value")


class Reference(_Matching):
    """MODULE:FUNCTION, importable from the current folder (imported by the library before any rank starts)."""

    name, argument, pattern = "module:function", "step", r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"
    what, fix = "is not MODULE:FUNCTION", "give a module and a function in it, e.g. mytrain:step"


class Documents(_Read):
    """A packed-documents spec: a count (16), 'longtail', or lengths (1024,512,...); read against --seq-len later."""

    name = "documents"

    def rule(self, value: str) -> Any:
        from ..attention import read_spec

        return read_spec(value)


class Storage(_Matching):
    """An Optuna storage URL: sqlite:///path.db, postgresql+psycopg2://user@host/db, ..."""

    name, argument, pattern = "url", "storage", r"[a-z][a-z0-9+]*://.*\S.*"
    what, fix = "is not a storage URL", "give one like sqlite:///cptune.db or postgresql+psycopg2://user@host/db"


class Endpoint(_Matching):
    """HOST:PORT."""

    name, argument, pattern = "host:port", "endpoint", r"(\[[0-9a-fA-F:]+\]|[^\s:/]+):([0-9]{1,5})"
    what, fix = "is not HOST:PORT", "give node 0's host and a free port, e.g. node0:29500"

    def accept(self, match: re.Match) -> bool:
        return 0 < int(match[2]) < 65536


class HardwareProfile(_Read):
    """A shipped hardware profile's name (h100, ...) or a JSON profile file (:func:`cptune.plan.load_hardware`)."""

    name = "profile"

    def rule(self, value: str) -> Any:
        from ..plan import load_hardware

        return load_hardware(value, "hardware")


class Name(_Matching):
    """Free text that must not be empty (a study's name)."""

    name, argument, pattern, what, fix = "name", "name", r"(?s).*\S.*", "is empty", "give a name, or leave the option out"


class CheckedPath(_Fixed, click.Path):
    """click's Path (its options as ``path_options``), its refusals followed by ``fix``."""

    def __init__(self, fix: str, **path_options: Any) -> None:
        super().__init__(**path_options)
        self.fix = fix


class InputFile(CheckedPath):
    """A file (or, with ``dir_okay``, a folder) that must exist and whose contents the command reads as data (a
    recipe, a config.json, a benchmark's JSON): contents that do not read are the library's named errors."""

    def __init__(self, dir_okay: bool = False, fix: str = "") -> None:
        super().__init__(fix or f"give the path of an existing file{' or folder' if dir_okay else ''}", exists=True,
                         dir_okay=dir_okay)


class OneOf(_Fixed, click.Choice):
    """One of ``choices``."""

    def __init__(self, choices: list[str]) -> None:
        super().__init__(choices)
        self.fix = f"use one of: {', '.join(choices)}"


class OutputFile(CheckedPath):
    """A file the command writes at its end (a recipe, a profile): checked first, so that a long search is not
    lost to a path that cannot be written (a folder, or a folder that is a file)."""

    def __init__(self) -> None:
        super().__init__("give a file's path, not a folder's", dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        value = super().convert(value, param, ctx)
        from pathlib import Path

        folder = Path(value).resolve().parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            self.fail(f"{value!r} is inside {str(folder)!r}, which is a file. Fix: give a path in a folder", param, ctx)
        return value


RECIPE = InputFile(fix="check the path; cptune ls lists the shipped and local recipes")
SIZE, LENGTHS, DIMS, VIDEO, KEY_VALUE, REFERENCE = Size(), Lengths(), Dims(), Video(), KeyValue(), Reference()
DOCUMENTS, STORAGE, ENDPOINT, NAME, HARDWARE = Documents(), Storage(), Endpoint(), Name(), HardwareProfile()
FOLDER = CheckedPath("give a folder, not a file", file_okay=False)
"""A folder (it need not exist yet where the command makes it)."""


class Whole(_Fixed, click.IntRange):
    """A whole number of at least ``low``."""

    def __init__(self, low: int) -> None:
        super().__init__(min=low)
        self.fix = f"give a whole number of at least {low}"


class Number(_Fixed, click.FloatRange):
    """A number in a range (``above``: strictly above ``low``; ``below``: strictly below ``high``)."""

    def __init__(self, low: float, high: float | None = None, above: bool = False, below: bool = False,
                 fix: str = "") -> None:
        super().__init__(min=low, max=high, min_open=above, max_open=below)
        self.fix = fix

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number != number:  # nan passes every comparison click makes
            self.fail(f"{value!r} is not a number. Fix: {self.fix}", param, ctx)
        if number in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not finite. Fix: {self.fix}", param, ctx)
        return number


COUNT = Whole(1)
"""A count of things (ranks, heads, layers, GPUs, trials): 1 or more."""
SECONDS = Number(0, above=True, fix="give a positive number of seconds, or leave the option out")
"""A positive duration in seconds."""


def _same(name: str, param: str) -> bool:
    """Whether the library's ``name`` is the CLI parameter ``param``: the same, one the plural of the other
    (seq_lens is --seq-len's), or ``param`` its path (recipe is RECIPE's, held as recipe_path)."""
    return name == param or name + "s" == param or param + "s" == name or param == name + "_path"


def in_flags(exc: CPTuneError, command: click.Command | None) -> CPTuneError:
    """``exc`` with each problem's Python name (``memory_budget``, ``model``) replaced by ``command``'s flag for it
    (``--memory-budget``): the library speaks Python, the CLI speaks flags."""
    if not isinstance(exc, ValidationError) or command is None:
        return exc

    def said(p: click.Parameter) -> str:  # an option by its flag, an argument as the usage line shows it
        return max(p.opts, key=len) if isinstance(p, click.Option) else p.human_readable_name

    def flag(argument: str) -> str:
        match = re.match(r"([A-Za-z_]\w*)(.*)", argument, re.S)  # the name, then what follows it (a file, a field)
        for p in command.params if match else []:
            if _same(match[1], p.name or ""):
                return said(p) + match[2]
        return argument

    return ValidationError([Problem(flag(p.argument), p.message, p.fix) for p in exc.problems])


def refuse(ctx: click.Context, exc: CPTuneError, command: click.Command | None) -> None:
    """A library error as this command's one error line (its Python names said as flags), exit code 1."""
    click.secho(f"error: {in_flags(exc, command)}", fg="red", err=True)
    ctx.exit(1)


class Script(click.Command):
    """A training script's command (the ones recipes launch): click checks each option, and a
    :class:`~cptune.CPTuneError` raised while the script checks its inputs or trains is its one error line naming
    the flag, exit 1, as ``cptune``'s own commands say it. The same script runs under python and torchrun."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CPTuneError as exc:
            refuse(ctx, exc, self)


FINITE_RATE = Number(0, above=True, fix="give a finite number above 0, e.g. 1e-3")
"""A learning rate: finite and above 0."""
