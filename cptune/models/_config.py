"""A transformers model's config, read from a local directory or its config.json (nothing is downloaded), with
overrides applied before it is made; the model's attention shape and the search's workload of it. transformers is
optional: without it these say which extra to install."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._files import read_json_object, special_floats
from ..errors import Problem, ValidationError, raise_if
from ..workload import Workload

INSTALL = "pip install 'cptune[hf]' (transformers)"


def _transformers(argument: str):
    try:
        import transformers
    except ImportError:
        raise ValidationError([Problem(argument, "needs transformers, which is not installed",
                                       INSTALL)]) from None
    return transformers


def parse_overrides(items: Iterable[str], argument: str = "model_overrides") -> dict[str, Any]:
    """``["num_hidden_layers=4", "rope_theta=1e6", "tie_word_embeddings=false"]`` -> a dict (JSON values,
    else the text)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValidationError([Problem(argument, f"{item!r} is not KEY=VALUE",
                                           "give a config field and its value, e.g. num_hidden_layers=4")])
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def config_path(path: str | Path, argument: str = "model") -> Path:
    """The model's ``config.json``: PATH itself, or PATH/config.json."""
    p = Path(path).expanduser()
    found = p / "config.json" if p.is_dir() else p
    if not found.is_file():
        raise ValidationError([Problem(argument, f"{path!s}: no config.json there", "give a local model "
                                       "directory (with config.json) or the config.json itself; nothing is "
                                       "downloaded")])
    return found


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None, argument: str = "model"):
    """The model's transformers config from a local directory or config.json, with ``overrides`` applied."""
    transformers = _transformers(argument)
    found = config_path(path, argument)
    data = read_json_object(found, argument, "give a model's config.json as save_pretrained writes it")
    if "model_type" not in data:
        raise ValidationError([Problem(argument, f"{found} has no model_type", "use a transformers config.json")])
    fields = {k: special_floats(v) for k, v in data.items() if k != "transformers_version"}
    known = _config(transformers, fields, argument, found)
    if overrides:  # checked against the config as saved (made with them, any name would be an attribute)
        raise_if(_override_problems(known, overrides))
    # applied before the config is made, so fields derived from them (head_dim from hidden_size) follow
    config = _config(transformers, {**fields, **overrides}, "model_overrides", found) if overrides else known
    config.use_cache = False
    return config


def _config(transformers, fields: dict, argument: str, found: Path):
    """transformers' config class for ``fields``, its refusals said as cptune's."""
    model_type = fields["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValidationError([Problem("model", f"{found}: model_type {model_type!r} is not one transformers "
                                       f"{transformers.__version__} knows", "use a config.json of a model this "
                                       "transformers supports, or a transformers release that has it")])
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5's configs are strict dataclasses
    except ImportError:
        StrictDataclassError = ValueError  # noqa: N806 - older huggingface_hub: nothing more to catch
    try:
        return transformers.AutoConfig.for_model(**fields)
    except (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError) as exc:
        text = str(exc).strip().splitlines()
        raise ValidationError([Problem(argument, f"{type(exc).__name__} from transformers' "
                                       f"{transformers.CONFIG_MAPPING[model_type].__name__}: "
                                       f"{text[0][:200] if text else ''}", "give each field a value of its type, "
                                       "as in the model's config.json")]) from None


def _override_problems(known, overrides: Mapping[str, Any]) -> list[Problem]:
    """Overrides that name no field of ``known``, or give a field a value of another type than it holds."""
    unknown = [k for k in overrides if not hasattr(known, k)]
    if unknown:
        return [Problem("model_overrides", f"{', '.join(unknown)}: not fields of this {type(known).__name__}",
                        "use field names from its config.json, e.g. num_hidden_layers")]
    problems = []
    for key, value in overrides.items():
        saved = getattr(known, key)
        kind = type(saved)
        fits = (value is None or saved is None or kind not in (int, float, bool, str)
                or isinstance(value, kind) and not (kind is int and isinstance(value, bool))
                or kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            problems.append(Problem("model_overrides", f"{key}={value!r}: the config holds a {kind.__name__} there "
                                    f"({saved!r})", f"give {key} a {kind.__name__}, e.g. {key}={json.dumps(saved)}"))
    return problems


def attention_shape(config) -> dict[str, int]:
    """The shape cptune's search needs from a model config: heads, kv_heads, head_dim, layers."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"heads": heads, "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": head_dim, "layers": text.num_hidden_layers}


def model_workload(model: str | Path, overrides: Mapping[str, Any] | None = None, **fields: Any) -> Workload:
    """What ``cptune search --model`` measures: ``model``'s training step, its attention shape (heads,
    kv_heads, head_dim, layers) read from its config; ``fields`` give the rest (seq_len, batch, ac, ...)."""
    shape = attention_shape(load_config(model, overrides))
    return Workload(model=str(model), model_overrides=dict(overrides) if overrides else None, **shape, **fields)
