"""transformers models from their config, built sharded and trained as transformers trains them: one loader for
``cptune search --model``, ``examples/train_hf.py`` and ``cptune.hf.Trainer``.

::

    config = cptune.models.load_config("path/to/model", {"num_hidden_layers": 4})  # dir or config.json
    model = cptune.models.build_model(config, device, fsdp_mesh=mesh, ac="selective")  # random weights, sharded
    model = cptune.models.build_model(config, device, weights="path/to/model", fsdp_mesh=mesh)  # its safetensors
    cptune.models.export_model(model, "out/")   # a folder from_pretrained loads (every rank calls it)

Nothing is downloaded: a model is a local directory (or its ``config.json``). The model is made
on the meta device and materialized one unit at a time (each decoder layer, then the root), each
sharded by FSDP2 before the next is made, so no rank ever holds the whole model; weights come
from the model's own initialization, seeded per unit (the same at any world size), or from a
safetensors checkpoint read into each rank's shards (:mod:`cptune._weights`). Training as
transformers does means ``model.train()``, ``use_cache=False``, :func:`cptune.hf.enable`,
activation checkpointing through transformers' own switch (``selective`` keeps matmuls and the
CP attention's output, recomputing the rest), ``torch.compile`` per decoder layer, and FSDP2 per
decoder layer then the root (torchtitan's order). transformers is optional; without it these
functions say which extra to install.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import _mixers, _parallelize as P, _paths, _tp_shards, _weights
from ._meta import materialize as _materialize, parameters_on_meta as _parameters_on_meta
from ._mixers import decoder_layers
from .attention import RING_ATTENTION_OPS, ULYSSES_OPS
from ._hf import enable
from ._files import read_json_object, special_floats
from .errors import Problem, ValidationError, raise_if
from .mesh import ParallelDims
from .workload import AC_MODES, Workload

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


def tp_problems(config, tp: int, argument: str = "mesh.tp", model: nn.Module | None = None) -> list[Problem]:
    """Why ``config``'s model cannot be split over ``tp`` ranks by its own TP plan (``base_model_tp_plan``): no
    plan, a style cptune does not apply, a module left whole beside split ones, or heads, key/value heads or
    intermediate size tp does not divide. ``model``: the model already made from ``config`` (else one is made on
    the meta device to read its layers)."""
    if tp == 1:
        return []
    text = getattr(config, "get_text_config", lambda: config)()
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        return [Problem(argument, f"is {tp} but {type(text).__name__} has no tensor-parallel plan "
                        "(base_model_tp_plan)", "use tp=1 for this model, or a model whose config has one")]
    odd = P.unapplied_styles(plan)
    problems = [Problem(argument, f"is {tp} but {type(text).__name__}'s TP plan has styles cptune does not apply "
                        f"({'; '.join(odd)})", f"use tp=1 for this model (cptune applies {', '.join(P.tp_styles())})")
                ] if odd else []
    made = model or _empty_model(config)
    layers = decoder_layers(made)
    mixers = _mixers.model_mixers(made)
    if mixers:  # the generic path gathers over cp; under sequence parallelism their input is split over tp too
        problems.append(Problem(argument, f"is {tp} but {type(made).__name__} has layers that mix tokens outside "
                                f"attention ({_mixers.describe(mixers)}), which cptune does not split over tp",
                                "use tp=1 for this model (cp > 1 runs them exactly)"))
    keys = P.layer_plan(config, layers)
    whole = sorted({name for layer in layers for name in P.whole_beside_split(layer, keys)})
    if whole:
        problems.append(Problem(argument, f"is {tp} but {type(text).__name__}'s TP plan leaves {', '.join(whole)} "
                                "whole beside the modules it splits: each tp rank's gradient there would be a part "
                                "of the whole one", "use tp=1 for this model"))
    unjoined = sorted({name for layer in layers for name in P.unjoined_blocks(layer, keys)})
    if unjoined:
        problems.append(Problem(argument, f"is {tp} but {type(text).__name__}'s TP plan splits {', '.join(unjoined)} "
                                "column-wise with no row-wise matmul after: the block's output would stay split by "
                                "feature", "use tp=1 for this model (or a transformers release whose plan joins it: "
                                "pip install -U transformers)"))
    blocks = sorted({name for layer in layers for name in P.unsplit_blocks(layer, keys)})
    if blocks:
        problems.append(Problem(argument, f"is {tp} but {type(text).__name__}'s TP plan leaves {', '.join(blocks)} "
                                "unsplit: under sequence parallelism each tp rank would run it on its share of the "
                                "tokens and hold a part of its gradient (MoE experts need expert parallelism, which "
                                "cptune does not apply)", "use tp=1 for this model"))
    shape = attention_shape(config)
    return problems + ParallelDims(tp=tp).model_problems(heads=shape["heads"], kv_heads=shape["kv_heads"],
                                                         intermediate=getattr(text, "intermediate_size", None),
                                                         argument=argument)


def cp_problems(config, cp: int, argument: str = "config.mesh_shape", model: nn.Module | None = None,
                token_wise: Iterable[type | str] = ()) -> list[Problem]:
    """Why ``config``'s model cannot train right over ``cp`` CP ranks: layers that mix tokens outside softmax
    attention (:mod:`cptune._mixers`' rule: convolutions over the sequence, recurrent, state-space and
    linear-attention layers, ``layer_types`` that are not attention), named with their layers. ``model``: the model
    already made from ``config`` (else one is made on the meta device to read its layers)."""
    if cp <= 1:
        return []
    made = model if model is not None else _empty_model(config)
    return _mixers.cp_problems(type(made).__name__, _mixers.model_coverage(made, token_wise)[1], cp, argument)


def mixer_paths(config, model: nn.Module | None = None, cp: int = 2, mixers: str = "split") -> dict[str, tuple[str,
                                                                                                       str]]:
    """Each module of ``config``'s model that mixes tokens outside attention: path -> (class name, the path it takes
    under ``cp`` ranks and ``mixers``, :attr:`cptune.CPConfig.mixers`: 'heads', 'halo' or 'generic';
    :mod:`cptune._paths`)."""
    made = model if model is not None else _empty_model(config)
    return {path: (type(m).__name__, _paths.path(m, cp, mixers)) for path, m in _mixers.model_coverage(made)[0].items()}


def whole_layers(config, model: nn.Module | None = None, cp: int = 2, mixers: str = "split") -> dict[str, str]:
    """The modules of :func:`mixer_paths` that cptune's generic path runs whole over the gathered sequence
    (:mod:`cptune._gathered`): path -> class name."""
    return {path: kind for path, (kind, taken) in mixer_paths(config, model, cp, mixers).items() if taken == "generic"}


def mesh_problems(config, dims: ParallelDims, argument: str = "config.mesh_shape",
                  model: nn.Module | None = None) -> list[Problem]:
    """Everything about ``config``'s model that ``dims`` cannot train right: :func:`cp_problems` and
    :func:`tp_problems`, the one check the scripts, ``cptune launch``, the search and the plan make."""
    made = model if model is not None or (dims.cp == 1 and dims.tp == 1) else _empty_model(config)
    return cp_problems(config, dims.cp, argument, made) + tp_problems(config, dims.tp, argument, made)


def build_model(config, device: torch.device | str, weights: str | Path | None = None, *, seed: int = 0,
                fsdp_mesh: Any = None, ac: str | None = None, compile: bool = False,
                dtype: torch.dtype = torch.float32, cp: int = 1) -> nn.Module:
    """A float32 causal LM from ``config``, SDPA attention outside CP blocks, never whole on a rank when sharded.

    Built on the meta device, then materialized one unit at a time (each decoder layer, then the rest):
    ``to_empty`` on ``device``, the model's own initialization seeded by (``seed``, unit), and, with
    ``fsdp_mesh``, FSDP2 sharding of that unit before the next is made (torchtitan's order: layers, then the
    root). A rank's build peak is its shards plus one unit; the weights are the same on every rank, from run
    to run and at any world size (one process builds what the sharded ranks hold). ``weights``: a local
    safetensors folder (``save_pretrained``'s), checked against the config before any tensor is read, then
    read into each rank's shards (bf16/fp16 files into float32). ``ac`` (none, full, selective) prepares the
    model for training first, as :func:`prepare_for_training` does; ``dtype``: its compute dtype.

    ``fsdp_mesh`` may also be the model's mesh of a named mesh (:meth:`cptune.ParallelDims.model_mesh`): each
    decoder layer is then split over its ``tp`` dim by the model's own TP plan first (torchtitan's order: TP,
    AC and compile, FSDP2), and FSDP2 shards over ``dp_shard_cp``, replicated over ``dp_replicate`` (HSDP).
    Without AC or compile, backward keeps each split block's input as this tp rank's sequence shard and gathers it
    again (:mod:`cptune._tp_shards`); under AC the recompute gathers it again.

    ``cp``: the CP degree it will train under; above 1, a model with layers that mix tokens outside attention is
    refused by name before anything is made (:func:`cp_problems`; the block refuses it at the first forward too)."""
    device = torch.device(device)
    tp_mesh, fsdp_mesh = P.split_mesh(fsdp_mesh)
    model = _empty_model(config)
    raise_if(cp_problems(config, cp, "cp", model) + (tp_problems(config, tp_mesh.size(), model=model)
                                                      if tp_mesh is not None else []))
    if weights is not None:
        tensors = _weights.stored_tensors(weights)
        raise_if(_weights.weight_problems(model, tensors))
    if ac is not None:
        _prepare(model, ac, compile)
    layers, shard = decoder_layers(model), P.sharder(fsdp_mesh, dtype)
    plan = P.layer_plan(config, layers) if tp_mesh is not None else None
    embeddings = P.embedding_units(model)
    keep = _tp_shards.applies(ac, compile)
    inside = {id(m) for unit in [*layers, *(e for e, _ in embeddings)] for m in unit.modules()}
    rest = [m for m in model.modules() if id(m) not in inside]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i, layer in enumerate(layers):
            _materialize(model, list(layer.modules()), device, seed, i + 1)
            P.parallelize_unit(layer, tp_mesh, plan, shard, keep_shards=keep)
        for j, (unit, reshard) in enumerate(embeddings):  # untied embedding and head: units of their own
            _materialize(model, list(unit.modules()), device, seed, len(layers) + 1 + j)
            P.parallelize_unit(unit, None, None, shard, reshard)
        _materialize(model, rest, device, seed, 0)
    if tp_mesh is not None:
        P.split_sequence(layers, tp_mesh)
        P.vocabulary_over(model, tp_mesh)
    P.parallelize_unit(model, None, None, shard)
    if getattr(model, "_cptune_hook", None):
        enable(model)  # cptune's pre-hook first again, before the one FSDP2 put in front
    if weights is not None:
        _weights.load_weights(model, weights, tensors)
    if fsdp_mesh is None and dtype != torch.float32:
        model.to(dtype)
    return model


def _empty_model(config, structure_only: bool = False) -> nn.Module:
    """``config``'s causal LM, its parameters on the meta device, its buffers made. ``structure_only``: every tensor
    made on the meta device, buffers too (nothing allocated, whatever the model's size: a DeepSeek-V3's experts), for
    the rules that read only its modules (:func:`cptune._space.model_limits`)."""
    transformers = _transformers("model")
    with torch.device("meta") if structure_only else _parameters_on_meta():
        try:
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                 dtype=torch.float32)
        except RuntimeError as exc:  # an _init_weights that assigns .data (Bamba's on 4.56) fails on the meta device
            from ._deps import version_tuple  # the fix never names the release already installed

            fix = "pip install -U transformers (verified: 5.25)" if version_tuple(transformers.__version__) < \
                (5, 25, 0) else "report the config to cptune (this is the release it verified); cptune plan " \
                "--model plans it from the config's fields without building it"
            raise ValidationError([Problem("model", f"{type(config).__name__}: transformers {transformers.__version__}"
                                           f" cannot build it on the meta device ({str(exc).splitlines()[0][:160]})",
                                           fix)]) from None
        except ValueError as exc:  # e.g. 'Gemma2ForCausalLM does not support an attention implementation through SDPA'
            if "attention implementation" not in str(exc):
                raise
            first = str(exc).strip().split(". ")[0]
            raise ValidationError([Problem("model", f"{type(config).__name__}: transformers {transformers.__version__}"
                                           f" says {first!r}; cptune's attention under CP is SDPA's", "use a model "
                                           "family that runs with attn_implementation='sdpa' (softcapping and "
                                           "attention sinks do not)")]) from None


def check_weights(config, weights: str | Path, argument: str = "weights") -> None:
    """Refuse, by name and before any tensor is read or any rank starts, a safetensors folder that
    :func:`build_model` would refuse for ``config`` (damaged files, missing tensors, other shapes or dtypes)."""
    raise_if(_weights.weight_problems(_empty_model(config), _weights.stored_tensors(weights, argument), argument))


def training_problems(ac: str, compile: bool) -> list[Problem]:
    """What this transformers cannot train right under CP: compile with activation checkpointing before the
    releases that have ``activation_checkpointing_enable`` (found by that name, not by version)."""
    if not compile or ac == "none":
        return []
    transformers = _transformers("--model")
    if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        return []
    return [Problem("compile (--compile)", f"with activation checkpointing needs a newer transformers than "
                    f"{transformers.__version__}: there a compiled decoder layer's recompute under CP saves other "
                    "tensors than its forward did (torch's CheckpointError)",
                    "pip install -U transformers (verified: 5.25), or drop --compile or --ac")]


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    keep = op in RING_ATTENTION_OPS or op in ULYSSES_OPS or op == torch.ops.aten.mm.default
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def prepare_for_training(model: nn.Module, ac: str = "none", compile: bool = False, fsdp_mesh: Any = None,
                         dtype: torch.dtype = torch.float32, cp: int = 1) -> nn.Module:
    """For a model built elsewhere (:func:`build_model` does this itself with ``ac=``): cptune.hf.enable, train
    mode, no KV cache, then activation checkpointing, torch.compile per decoder layer and FSDP2 (per decoder
    layer, then the root) over ``fsdp_mesh`` when given. A ``dtype`` below float32 is the compute dtype: FSDP2
    keeps float32 parameters and reduces gradients in float32 (without FSDP the model is cast). Returns the
    model. ``fsdp_mesh`` may be a model mesh (:meth:`cptune.ParallelDims.model_mesh`), as for :func:`build_model`:
    tensor parallelism by the model's own plan first. ``cp``: as for :func:`build_model`."""
    tp_mesh, fsdp_mesh = P.split_mesh(fsdp_mesh)
    raise_if(cp_problems(model.config, cp, "cp", model, getattr(model, "_cptune_token_wise", ()))
             + (tp_problems(model.config, tp_mesh.size(), model=model) if tp_mesh is not None else []))
    _prepare(model, ac, compile)
    shard = P.sharder(fsdp_mesh, dtype)
    if shard is None:
        model.to(dtype)
    layers = decoder_layers(model)
    P.parallelize_layers(model, layers, tp_mesh, P.layer_plan(model.config, layers) if tp_mesh is not None else None,
                         shard, keep_shards=_tp_shards.applies(ac, compile))
    return enable(model)  # cptune's pre-hook first again, before the one FSDP2 put in front


def _prepare(model: nn.Module, ac: str, compile: bool) -> None:
    """cptune.hf.enable, train mode, no KV cache, activation checkpointing, compile per decoder layer."""
    if ac not in AC_MODES:
        raise ValidationError([Problem("ac", f"{ac!r} is not one of {', '.join(AC_MODES)}", "use one of them")])
    raise_if(training_problems(ac, compile))
    enable(model)
    model.train()
    model.config.use_cache = False
    if ac != "none":
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if ac == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if compile:
        for layer in decoder_layers(model):
            layer.compile()


check_export = _weights.check_export
export_model = _weights.export_model

__all__ = ["attention_shape", "build_model", "check_export", "check_weights", "config_path", "cp_problems",
           "decoder_layers", "mesh_problems", "mixer_paths", "whole_layers",
           "export_model", "load_config", "model_workload", "parse_overrides", "prepare_for_training", "tp_problems"]
