"""What a transformers model can train under, read from its modules and its own TP plan before anything is made
on a device: tensor parallelism (its plan's styles, its blocks, its heads over tp), context parallelism (its layers
that mix tokens outside attention, :mod:`cptune.mixers`), the mesh as a whole, activation checkpointing with compile;
each a list of problems, named."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from .. import experts
from .. import mixers as _mixers
from ..errors import Problem
from ..mesh import ParallelDims
from . import _parallelize as P
from ._meta_device import empty_model as _empty_model
from ._config import _transformers, attention_shape

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
    layers = _mixers.decoder_layers(made)
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
                                "cptune does not apply beside tp yet)", "use tp=1 for this model (config.ep_degree "
                                "splits a mixture's experts over dp x cp)"))
    shape = attention_shape(config)
    return problems + ParallelDims(tp=tp).model_problems(heads=shape["heads"], kv_heads=shape["kv_heads"],
                                                         intermediate=getattr(text, "intermediate_size", None),
                                                         argument=argument)


def cp_problems(config, cp: int, argument: str = "config.mesh_shape", model: nn.Module | None = None,
                token_wise: Iterable[type | str] = ()) -> list[Problem]:
    """Why ``config``'s model cannot train right over ``cp`` CP ranks: layers that mix tokens outside softmax
    attention (:mod:`cptune.mixers._rule`' rule: convolutions over the sequence, recurrent, state-space and
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
    :mod:`cptune.mixers._choice`)."""
    made = model if model is not None else _empty_model(config)
    covered = _mixers.model_coverage(made)[0]
    return {path: (type(m).__name__, _mixers.path(m, cp, mixers)) for path, m in covered.items()}


def whole_layers(config, model: nn.Module | None = None, cp: int = 2, mixers: str = "split") -> dict[str, str]:
    """The modules of :func:`mixer_paths` that cptune's generic path runs whole over the gathered sequence
    (:mod:`cptune.mixers._generic`): path -> class name."""
    return {path: kind for path, (kind, taken) in mixer_paths(config, model, cp, mixers).items() if taken == "generic"}


def mesh_problems(config, dims: ParallelDims, argument: str = "config.mesh_shape",
                  model: nn.Module | None = None, ulysses: int = 1) -> list[Problem]:
    """Everything about ``config``'s model that ``dims`` cannot train right: :func:`cp_problems` and
    :func:`tp_problems`, experts its ep cannot split (:func:`cptune.experts.ep_problems`), and a Ulysses degree
    (``ulysses``: the configuration's, :meth:`cptune.CPConfig.degrees`) that does not divide the heads each tp rank
    holds; the check ``train_hf`` makes before any rank starts (and
    so ``cptune launch``, through its preflight)."""
    made = model if model is not None or (dims.cp == 1 and dims.tp == 1 and dims.ep == 1) else _empty_model(config)
    heads = ParallelDims(tp=dims.tp).model_problems(heads=attention_shape(config)["heads"], ulysses=ulysses) \
        if ulysses > 1 else []
    return cp_problems(config, dims.cp, argument, made) + tp_problems(config, dims.tp, argument, made) + \
        [p for p in heads if p.argument == "config.ulysses_degree"] + \
        (experts.ep_problems(made, dims.ep, "config.ep_degree") if dims.ep > 1 else [])


def training_problems(ac: str, compile: bool, config: Any = None, ep: int = 1) -> list[Problem]:
    """What this transformers cannot train right under CP: compile with activation checkpointing before the
    releases that have ``activation_checkpointing_enable`` (found by that name, not by version); compile of a
    vision-language ``config``'s model (its tower's blocks do not trace under cptune's block); selective
    checkpointing with expert parallelism (``ep`` above 1) under FSDP2, as the scripts and the search train."""
    if ac == "selective" and ep > 1:  # the experts' FSDP2 unit runs its hooks again in the recompute
        return [Problem("ac", f"is 'selective' with ep {ep} under FSDP2", "use ac='full' or 'none' with ep: "
                        "selective checkpointing's op cache meets ops of the experts' own FSDP2 unit in the "
                        "recompute that its forward did not record (DeepSeek-V3 fails there)")]
    if compile and getattr(config, "vision_config", None) is not None:
        return [Problem("compile (--compile)", f"compiles each decoder layer, and {type(config).__name__}'s vision "
                        "tower blocks do not compile under cptune's block yet (dynamo fails tracing their per-image "
                        "attention)", "train this model without --compile")]
    if not compile or ac == "none":
        return []
    transformers = _transformers("--model")
    if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        return []
    return [Problem("compile (--compile)", f"with activation checkpointing needs a newer transformers than "
                    f"{transformers.__version__}: there a compiled decoder layer's recompute under CP saves other "
                    "tensors than its forward did (torch's CheckpointError)",
                    "pip install -U transformers (verified: 5.25), or drop --compile or --ac")]
