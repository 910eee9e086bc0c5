"""Reading a JSON file a user gave (a config.json, a hardware profile, a benchmark's results): whatever is wrong with
it is a ValidationError naming the argument it was given as, never a decoder's traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import Problem, ValidationError


def read_json_object(path: str | Path, argument: str, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; an unreadable file, text that is not JSON, or JSON that is not an object is an
    error naming ``argument``, with ``fix``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError([Problem(argument, f"{path} is not a JSON file ({exc})", fix)]) from None
    if not isinstance(data, dict):
        raise ValidationError([Problem(argument, f"{path} holds a JSON {type(data).__name__}, not an object", fix)])
    return data


_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def special_floats(value: Any) -> Any:
    """``value`` with transformers' JSON form of infinities and NaN (``{"__float__": "Infinity"}``, as
    ``save_pretrained`` writes Bamba's ``time_step_limit``) read back as floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOATS:
            return _FLOATS[value["__float__"]]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value
