"""A transformers model built sharded (on the meta device, then one FSDP2-sharded unit at a time, weights from its
own initialization or its safetensors) and prepared for training as transformers trains it (the package's docstring
says how)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import experts, mixers as _mixers
from ..attention import RING_ATTENTION_OPS, ULYSSES_OPS
from ..errors import Problem, ValidationError, raise_if
from ..hf import enable
from ..mesh import ep_problems
from . import _parallelize as P
from . import _tp_shards
from . import _weights
from ._meta_device import empty_model as _empty_model, materialize as _materialize
from ._rules import cp_problems, tp_problems, training_problems
from ..workload import AC_MODES

def build_model(config, device: torch.device | str, weights: str | Path | None = None, *, seed: int = 0,
                fsdp_mesh: Any = None, ac: str | None = None, compile: bool = False,
                dtype: torch.dtype = torch.float32, cp: int = 1, keep_tp_shards: bool | None = None,
                ep: int = 1) -> nn.Module:
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
    again (:mod:`cptune.models._tp_shards`); under AC the recompute gathers it again. ``keep_tp_shards=False`` keeps the
    gathered input instead (``benchmarks.tp_shards`` compares the two).

    ``cp``: the CP degree it will train under; above 1, a model with layers that mix tokens outside attention is
    refused by name before anything is made (:func:`cp_problems`; the block refuses it at the first forward too).

    ``ep``: each MoE layer's experts split over groups of ``ep`` consecutive ranks as the layer is made
    (:mod:`cptune.experts`: each rank keeps E / ep experts and trades tokens for them by all-to-all); under FSDP2
    the experts are a unit of their own, sharded over their replicas (the ranks of the other groups that hold the
    same experts), their gradients summed there and divided by the world, as the rest are averaged. Every rank
    calls it (it makes the groups); with a 1-D ``fsdp_mesh`` or none (no tp, no dp_replicate), without ``weights``,
    and under FSDP2 with ``ac`` none or full (selective is refused)."""
    device = torch.device(device)
    tp_mesh, fsdp_mesh = P.split_mesh(fsdp_mesh)
    model = _empty_model(config)
    raise_if(cp_problems(config, cp, "cp", model) + (tp_problems(config, tp_mesh.size(), model=model)
                                                      if tp_mesh is not None else []) +
             _ep_problems(model, ep, fsdp_mesh, tp_mesh, weights, ac))
    groups = experts.ep_groups(ep) if ep > 1 else None
    if weights is not None:
        tensors = _weights.stored_tensors(weights)
        raise_if(_weights.weight_problems(model, tensors))
    if ac is not None:
        _prepare(model, ac, compile)
    layers, shard = _mixers.decoder_layers(model), P.sharder(fsdp_mesh, dtype)
    plan = P.layer_plan(config, layers) if tp_mesh is not None else None
    embeddings = P.embedding_units(model)
    keep = _tp_shards.applies(ac, compile) if keep_tp_shards is None else keep_tp_shards
    inside = {id(m) for unit in [*layers, *(e for e, _ in embeddings)] for m in unit.modules()}
    rest = [m for m in model.modules() if id(m) not in inside]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i, layer in enumerate(layers):
            _materialize(model, list(layer.modules()), device, seed, i + 1)
            if groups is not None:
                P.split_experts(layer, groups, shard, device.type)
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


def _ep_problems(model: nn.Module, ep: int, fsdp_mesh: Any, tp_mesh: Any, weights: Any, ac: str | None) -> list:
    if ep <= 1:
        return []
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tp = tp_mesh.size() if tp_mesh is not None else 1
    replicas = fsdp_mesh.size(0) if fsdp_mesh is not None and fsdp_mesh.ndim > 1 else 1
    # the mesh's rule for the fold: beside tp or HSDP not built, and ep dividing the ranks it folds over
    problems = experts.ep_problems(model, ep) + ep_problems((replicas, world // replicas // tp, 1, tp), ep, "ep")
    if fsdp_mesh is not None:  # selective checkpointing's refusal (the experts' FSDP2 unit)
        problems += training_problems(ac or "none", False, ep=ep)
    if weights is not None:
        problems.append(Problem("ep", f"is {ep} with weights=", "load a checkpoint with ep=1: reading each rank's "
                                "experts from safetensors is not built yet"))
    return problems


def check_weights(config, weights: str | Path, argument: str = "weights") -> None:
    """Refuse, by name and before any tensor is read or any rank starts, a safetensors folder that
    :func:`build_model` would refuse for ``config`` (damaged files, missing tensors, other shapes or dtypes)."""
    raise_if(_weights.weight_problems(_empty_model(config), _weights.stored_tensors(weights, argument), argument))


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
    layers = _mixers.decoder_layers(model)
    P.parallelize_layers(model, layers, tp_mesh, P.layer_plan(model.config, layers) if tp_mesh is not None else None,
                         shard, keep_shards=_tp_shards.applies(ac, compile))
    return enable(model)  # cptune's pre-hook first again, before the one FSDP2 put in front


def _prepare(model: nn.Module, ac: str, compile: bool) -> None:
    """cptune.hf.enable, train mode, no KV cache, activation checkpointing, compile per decoder layer."""
    if ac not in AC_MODES:
        raise ValidationError([Problem("ac", f"{ac!r} is not one of {', '.join(AC_MODES)}", "use one of them")])
    raise_if(training_problems(ac, compile, model.config))
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
        for layer in _mixers.decoder_layers(model):
            layer.compile()
