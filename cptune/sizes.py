"""Memory sizes as people write them ('70GiB') and as cptune prints them; rates as cptune prints them."""

from __future__ import annotations

import re

from .errors import Problem, ValidationError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str | int | float, argument: str = "size") -> int:
    """'70GiB', '512MB', '2g' -> bytes; a number (not a string) is bytes. A string needs its unit. A bad size is
    a ValidationError naming ``argument`` (the Python argument or field it was given as)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        size = int(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValidationError([Problem(argument, f"cannot read {text!r} as a size",
                                           "write it like 70GiB, 512MiB or 2GB")])
        if not match.group(2):
            raise ValidationError([Problem(argument, f"{text!r} has no unit", f"write {match.group(1)}MiB or "
                                           f"{match.group(1)}GiB (a plain number would mean bytes)")])
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValidationError([Problem(argument, f"{text!r} is not a positive size",
                                       "give a size above zero, like 70GiB")])
    return size


def format_size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return str(n)


def format_rate(x: float) -> str:
    """A rate (tokens/s) as a table prints it: whole numbers with thousands separators from 100 up, three
    significant figures below (a model that takes a minute a step runs at 0.533 tokens/s, not 0)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
