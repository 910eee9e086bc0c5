"""Parallelizing a model, one unit at a time, in torchtitan's order: tensor parallelism by the model's own plan,
then FSDP2 (HSDP where replicated). ``cptune.models`` builds with it; it knows nothing of CP (the block shards the
sequence) and imports nothing of cptune's but the mesh and the errors."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .errors import Problem, ValidationError
from .mesh import MODEL_DIMS


def tp_styles() -> dict[str, Any]:
    """The transformers TP plan styles cptune applies, as torch's ``parallelize_module`` styles (torchtitan's
    mapping); a plan with any other style is refused by name (:func:`tp_problems`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    gather, split = ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate())
    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
            "colwise_gather_output": gather, "colwise_rep": gather,  # the names of transformers 5 and of 4.x
            "rowwise_split_input": split, "rowwise_rep": split}


def layer_plan(model: nn.Module) -> dict[str, Any]:
    """The model's TP plan for one decoder layer: its own entries under ``layers.*.``, as torch styles."""
    styles = tp_styles()
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    return {key.split("layers.*.", 1)[1]: styles[style] for key, style in text.base_model_tp_plan.items()
            if key.startswith("layers.*.")}


def whole_beside_split(layer: nn.Module, plan_keys: list[str]) -> list[str]:
    """Modules with parameters that the plan leaves whole beside modules it splits (``self_attn.q_norm`` beside
    ``self_attn.q_proj``, as transformers 4.x's Qwen3 plan does): they see each tp rank's share of the heads, so
    each rank's gradient would be a part of the whole one. Norms on the residual stream (siblings of no split
    module) see every rank's same activations and stay whole rightly."""
    planned = set(plan_keys)
    found = []
    for prefix, module in layer.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_children()]
        if not planned.intersection(names):
            continue
        found += [name for name, child in zip(names, module.children())
                  if name not in planned and any(True for _ in child.parameters())]
    return found


def split_mesh(mesh: Any) -> tuple[Any, Any]:
    """(the tp mesh or None, the mesh FSDP2 shards over) of ``build_model``'s ``fsdp_mesh``: a 1-D mesh as it is; a
    model mesh (:meth:`cptune.ParallelDims.model_mesh`) split into tp (None when 1) and dp_replicate x dp_shard_cp
    (HSDP when replicated, else dp_shard_cp alone)."""
    if mesh is None or mesh.ndim == 1:
        return None, mesh
    names = mesh.mesh_dim_names or ()
    if names != MODEL_DIMS:
        raise ValidationError([Problem("fsdp_mesh", f"has {mesh.ndim} dims named {names}", "pass a 1-D mesh, or "
                                       "ParallelDims.model_mesh(device_type) for tensor parallelism and HSDP")])
    tp = mesh["tp"] if mesh["tp"].size() > 1 else None
    data = mesh["dp_replicate", "dp_shard_cp"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard_cp"]
    return tp, data


def sharder(mesh: Any, dtype: torch.dtype):
    """FSDP2 of one unit over ``mesh``: float32 parameters and gradient reduction, ``dtype`` compute; None
    without a mesh."""
    if mesh is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return functools.partial(fully_shard, mesh=mesh,
                             mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))


def parallelize_unit(unit: nn.Module, tp_mesh: Any, plan: dict[str, Any] | None, shard: Any) -> None:
    """One decoder layer (or the root, ``plan`` None): split over ``tp_mesh`` by ``plan``, then sharded by ``shard``
    (:func:`sharder`; None: not sharded)."""
    if plan is not None and tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(unit, tp_mesh, plan)
    if shard is not None:
        shard(unit)
