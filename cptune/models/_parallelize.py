"""Parallelizing a model, one unit at a time, in torchtitan's order: tensor parallelism by the model's own plan with
sequence parallelism on the residual stream, then FSDP2 (HSDP where replicated). ``cptune.models`` builds with it;
it knows nothing of CP (the block shards the sequence; sequence parallelism splits each CP rank's share further, over
tp) and imports nothing of cptune's but the mesh, the errors and expert parallelism's split."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import _tp_shards
from ..errors import Problem, ValidationError
from ..experts import experts_modules, split
from ..mesh import MODEL_DIMS


PER_HEAD = "replicated_with_grad_allreduce"
"""transformers' style for a module between column- and row-parallel matmuls that acts on each head alone (Qwen3's,
Gemma3's q/k norms over the head dim): replicated over tp, its gradient summed over tp."""
_SHARDING = ("colwise", PER_HEAD)
"""Styles whose output is this tp rank's share of the heads or features: a whole module beside them sees a share."""
_ACTIVATIONS = ("transformers.activations", "torch.nn.modules.activation")


def tp_styles() -> dict[str, Any]:
    """The transformers TP plan styles cptune applies, as torch's ``parallelize_module`` styles (torchtitan's
    mapping); a plan with any other style is refused by name (:func:`tp_problems`). ``replicated_with_grad_allreduce``
    replicates the module's parameters over tp and declares its input this rank's share along dim 1 (heads or
    sequence, never the normalized last dim), so the parameters' gradient is each rank's partial sum, all-reduced
    over tp by DTensor as for the residual stream's norms."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    gather, split = ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate())
    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
            "colwise_gather_output": gather, "colwise_rep": gather,  # the names of transformers 5 and of 4.x
            "rowwise_split_input": split, "rowwise_rep": split,
            PER_HEAD: SequenceParallel(sequence_dim=1, use_local_output=True)}


def unapplied_styles(plan: dict[str, str]) -> list[str]:
    """The entries of a TP plan (module -> style name) whose style cptune does not apply, as 'module: style'."""
    styles = tp_styles()
    return sorted({f"{key}: {style}" for key, style in plan.items() if style not in styles})


def layer_plan(config, layers: list[nn.Module]) -> dict[str, str]:
    """``config``'s TP plan for its decoder ``layers`` (module under a layer -> style name): its own entries under
    ``layers.*.``, and ``replicated_with_grad_allreduce`` for the modules a plan leaves whole beside split ones that
    act on each head or feature alone: a module whose parameters are each one head's width (the per-head q/k norms of
    Qwen3 and Gemma3 in transformers 4.x's plans) and an activation whose parameters are single numbers (Apertus'
    xIELU beside its column-parallel up projection, which no release's plan names)."""
    text = getattr(config, "get_text_config", lambda: config)()
    plan = {key.split("layers.*.", 1)[1]: style for key, style in (text.base_model_tp_plan or {}).items()
            if key.startswith("layers.*.")}
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for layer in layers:
        for name in whole_beside_split(layer, plan):
            module = layer.get_submodule(name)
            params = list(module.parameters())
            per_head = all(p.ndim == 1 and p.shape[0] == head_dim for p in params)
            scalars = type(module).__module__ in _ACTIVATIONS and all(p.numel() == 1 for p in params)
            if per_head or scalars:
                plan[name] = PER_HEAD
    return plan


def whole_beside_split(layer: nn.Module, plan: dict[str, str]) -> list[str]:
    """Modules with parameters that ``plan`` (module -> style name) leaves whole beside modules whose output it
    splits (``self_attn.q_norm`` beside a column-parallel ``self_attn.q_proj``, as transformers 4.x's Qwen3 plan
    does): they see each tp rank's share of the heads, so each rank's gradient would be a part of the whole one.
    Beside projections that gather their output (``colwise_gather_output``: OLMo2's q/k norms over every head) a
    module sees the whole activations, as do norms on the residual stream (siblings of no split module): they stay
    whole rightly."""
    present = {key: plan[key] for key in present_keys(layer, plan)}
    found = []
    for prefix, module in layer.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_children()]
        if not any(present.get(name) in _SHARDING for name in names):
            continue
        found += [name for name, child in zip(names, module.children())
                  if name not in present and any(True for _ in child.parameters())]
    return found


def unjoined_blocks(layer: nn.Module, plan: dict[str, str]) -> list[str]:
    """The blocks of ``layer`` (parents of planned modules) that ``plan`` splits column-wise with no row-parallel
    matmul to join the shares again (transformers 4.56's Starcoder2 plan names its MLP's ``c_proj`` ``colwise``):
    their output would leave the block split by feature."""
    present = {key: plan[key] for key in present_keys(layer, plan)}
    blocks = {key.rsplit(".", 1)[0] for key in present if "." in key}
    return sorted(f"{block} ({', '.join(k for k in present if k.startswith(block + '.'))})" for block in blocks
                  if any(present[k] == "colwise" for k in present if k.startswith(block + "."))
                  and not any(present[k].startswith("rowwise") for k in present if k.startswith(block + ".")))


def unsplit_blocks(layer: nn.Module, plan_keys: list[str]) -> list[str]:
    """The layer's children with parameters that the plan neither splits nor enters and that are not single
    token-wise modules (an MoE block beside split attention, Mixtral's), or that it enters only through expert-wise
    keys (transformers 4.x's ``block_sparse_moe.experts.*.w1``, which cptune does not apply): under sequence
    parallelism each tp rank runs them on its share of the tokens, so each rank's gradient would be a part of the
    whole one; only a norm-like leaf (``SequenceParallel``) is made whole again."""
    present = present_keys(layer, plan_keys)
    entered = set(present) | {key.rsplit(".", 1)[0] for key in present if "." in key}  # split, or a block
    wildcard = {key.split(".", 1)[0] for key in plan_keys if "*" in key}  # 4.x's 'experts.*.w1': not applied
    return [f"{name} ({type(child).__name__})" for name, child in layer.named_children()
            if (name not in entered or name in wildcard) and any(True for _ in child.parameters())
            and any(True for _ in child.children())]


def present_keys(layer: nn.Module, plan_keys) -> list[str]:
    """The plan's keys that name modules of ``layer`` (a plan names the dense MLP of an MoE model's other layers)."""
    named = {name for name, _ in layer.named_modules()}
    return [key for key in plan_keys if key in named]


def split_mesh(mesh: Any, argument: str = "fsdp_mesh") -> tuple[Any, Any]:
    """(the tp mesh or None, the mesh FSDP2 shards over) of ``build_model``'s ``fsdp_mesh`` (``argument``: its name
    where it was given): a 1-D mesh as it is; a model mesh (:meth:`cptune.ParallelDims.model_mesh`) split into tp
    (None when 1) and dp_replicate x dp_shard_cp (HSDP when replicated, else dp_shard_cp alone)."""
    if mesh is None or mesh.ndim == 1:
        return None, mesh
    names = mesh.mesh_dim_names or ()
    if names != MODEL_DIMS:
        raise ValidationError([Problem(argument, f"has {mesh.ndim} dims named {names}", "pass a 1-D mesh, or "
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


def split_experts(layer: nn.Module, groups: tuple[Any, Any], shard: Any, device_type: str) -> None:
    """Each grouped-experts module of ``layer`` split over its ep group (:func:`cptune.experts.split`), then, under
    FSDP2 (``shard``), a unit of its own sharded over its replicas' group, its gradients summed there and divided by
    the world (the rest of the model is averaged over it), before the layer is sharded around it."""
    for module in experts_modules(layer).values():
        split(module, groups)
        if shard is not None:
            replicas = DeviceMesh.from_group(groups[1], device_type)
            shard(module, mesh=replicas)
            module.set_gradient_divide_factor(float(torch.distributed.get_world_size()))
            if device_type == "cpu" and replicas.size() > 1:  # gloo has no pre-multiplied sum: sum, then divide
                module.set_force_sum_reduction_for_comms(True)  # (alone on its mesh FSDP2 divides once already)


def sequence_parallel(layer: nn.Module, plan: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """``plan`` (module -> style name) as torch styles, with sequence parallelism, torchtitan's default beside TP:
    between the split blocks the residual stream is split over tp by sequence, each tp rank holding its share of the
    tokens. The row-parallel matmuls that
    end a block reduce-scatter their output by sequence instead of all-reducing it; the layer's own token-wise
    modules with parameters (its norms) run on the tokens a rank holds; the blocks (the parents of split modules,
    returned) all-gather their input (:func:`gather_block_inputs`). Returns (the plan, the blocks)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    styles = tp_styles()
    plan = {key: styles[plan[key]] for key in present_keys(layer, plan)}
    blocks = sorted({key.rsplit(".", 1)[0] for key in plan if "." in key})
    out = {key: RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(1))
           if isinstance(style, RowwiseParallel) else style for key, style in plan.items()}
    for name, child in layer.named_children():
        if name not in blocks and name not in plan and any(True for _ in child.parameters()):
            out[name] = SequenceParallel(use_local_output=True)
    return out, blocks


def _map_hidden(args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> tuple[tuple, dict]:
    """A forward pre-hook's (args, kwargs) with ``fn`` applied to the hidden states: the first positional argument,
    or the ``hidden_states`` keyword (transformers passes them either way)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _placed(x: torch.Tensor, mesh: Any, source: Any, target: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [source], run_check=False)
    return x.redistribute(mesh, [target])


def gather_block_inputs(layer: nn.Module, blocks: list[str], tp_mesh: Any, keep_shards: bool = False) -> None:
    """Each block of ``layer`` takes the whole sequence: its hidden states (first positional argument, or the
    ``hidden_states`` keyword) all-gathered over tp, kept a replicated DTensor so that the column-parallel matmuls
    inside reduce-scatter its gradient. ``keep_shards``: backward keeps the shard and gathers again
    (:mod:`cptune.models._tp_shards`), where the matmuls would keep the gathered input."""
    from torch.distributed.tensor import Replicate, Shard

    def whole(x):
        shard = _placed(x, tp_mesh, Shard(1), Shard(1))
        out = shard.redistribute(tp_mesh, [Replicate()])
        if keep_shards:
            _tp_shards.remember(out, shard)
        return out

    def gather(module, args, kwargs):
        return _map_hidden(args, kwargs, whole)

    for name in blocks:
        block = layer.get_submodule(name)
        block.register_forward_pre_hook(gather, with_kwargs=True)
        if keep_shards:
            _tp_shards.keep_shards(block)


def split_sequence(layers: list[nn.Module], tp_mesh: Any) -> None:
    """The residual stream enters the first decoder layer split by sequence over tp (each tp rank its share of the
    tokens it holds whole) and leaves the last one whole again, for the final norm and the LM head; a sequence tp
    does not divide is refused by name."""
    from torch.distributed.tensor import Replicate, Shard

    tp = tp_mesh.size()

    def share(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % tp:  # the scripts and the search say it before any rank starts (sequence_problems)
            raise ValidationError([Problem("seq_len", f"each CP rank's {x.shape[1]} tokens do not split over "
                                           f"tp={tp} ranks (sequence parallelism)", "use a sequence length "
                                           "divisible by cp x tp")])
        return _placed(x, tp_mesh, Replicate(), Shard(1)).to_local()

    def split(module, args, kwargs):
        return _map_hidden(args, kwargs, share)

    def gather(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        whole = _placed(first, tp_mesh, Shard(1), Replicate()).to_local()
        return (whole, *output[1:]) if isinstance(output, tuple) else whole

    layers[0].register_forward_pre_hook(split, with_kwargs=True)
    layers[-1].register_forward_hook(gather)


def vocabulary_over(model: nn.Module, tp_mesh: Any) -> None:
    """The LM head's loss is vocabulary-parallel over ``tp_mesh`` (cptune's chunked loss reads the group from the
    head; the head's weight stays whole on each tp rank, sharded by FSDP2 over the data dims as before, and a forward
    for logits gives them whole)."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None:
        output._cptune_tp_group = tp_mesh.get_group()


def apply_tp(layer: nn.Module, tp_mesh: Any, plan: dict[str, str], keep_shards: bool = False) -> None:
    """``layer`` split over ``tp_mesh`` by ``plan`` (style names) with sequence parallelism (:func:`sequence_parallel`,
    :func:`gather_block_inputs`, ``keep_shards``); the layers' ends are :func:`split_sequence`'s."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, blocks = sequence_parallel(layer, plan)
    parallelize_module(layer, tp_mesh, plan)
    gather_block_inputs(layer, blocks, tp_mesh, keep_shards)


def embedding_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """A transformers model's input embedding and LM head, each a unit of its own (made and sharded before the next,
    so that a rank's build never holds both whole), with whether FSDP2 reshards it after forward: not the head,
    whose loss cptune takes inside its forward (:mod:`cptune.losses`), so its backward finds it gathered. None when
    tied (one parameter: it stays the root's)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            found.append(module)
    if len(found) < 2 or {id(p) for p in found[0].parameters()} & {id(p) for p in found[1].parameters()}:
        return []
    return [(found[0], True), (found[1], False)]


def parallelize_unit(unit: nn.Module, tp_mesh: Any, plan: dict[str, str] | None, shard: Any,
                     reshard: bool = True, keep_shards: bool = False) -> None:
    """One decoder layer (or the root, ``plan`` None): split over ``tp_mesh`` by ``plan`` (:func:`apply_tp`), then
    sharded by ``shard`` (:func:`sharder`; None: not sharded; ``reshard``: FSDP2's reshard_after_forward;
    ``keep_shards``: :func:`gather_block_inputs`', for a unit neither checkpointed nor compiled). ``build_model`` takes it a layer at a time, each
    made just before; :func:`parallelize_layers` is the same for layers already made."""
    if plan is not None and tp_mesh is not None:
        apply_tp(unit, tp_mesh, plan, keep_shards)
    if shard is not None:
        shard(unit) if reshard else shard(unit, reshard_after_forward=False)


def parallelize_layers(model: nn.Module, layers: list[nn.Module] | nn.ModuleList, tp_mesh: Any,
                       plan: dict[str, str] | None, shard: Any, wrap: Callable[[nn.Module], nn.Module] | None = None,
                       keep_shards: bool = False) -> None:
    """Each of ``layers`` split over ``tp_mesh`` by ``plan`` (:func:`apply_tp`; neither: not split), then replaced in
    ``layers`` by ``wrap(layer)`` (AC, compile), then sharded by ``shard`` (:func:`sharder`; None: not sharded); with
    tp the residual stream split between the first and the last (:func:`split_sequence`); the root sharded last."""
    split = plan is not None and tp_mesh is not None
    for i, layer in enumerate(layers):
        if split:
            apply_tp(layer, tp_mesh, plan, keep_shards)
        if wrap is not None:
            layers[i] = wrap(layer)
    if split:
        split_sequence(list(layers), tp_mesh)
        vocabulary_over(model, tp_mesh)
    if shard is not None:
        for layer in layers:
            shard(layer)
        shard(model)


def parallelize(model: nn.Module, layers: nn.ModuleList, mesh: Any = None, tp_plan: dict[str, str] | None = None,
                wrap: Callable[[nn.Module], nn.Module] | None = None, dtype: torch.dtype = torch.float32,
                keep_shards: bool = False) -> nn.Module:
    """A plain PyTorch model parallelized in one step, in torchtitan's order, as ``cptune.models.build_model`` does a
    transformers one: each of ``layers`` (the model's blocks) split over ``mesh``'s tp dim by ``tp_plan`` (module
    names under a block -> ``"colwise"`` or ``"rowwise"``, transformers' style names) with sequence parallelism on
    the residual stream, then ``wrap(block)`` (activation checkpointing, compile: it returns the block to keep), then
    FSDP2 over the data-parallel dims (HSDP across dp_replicate), the root last. ``keep_shards``: backward keeps
    each block's input as this tp rank's sequence shard and gathers it again (Megatron's way), where the
    column-parallel matmuls would keep it whole; only for blocks ``wrap`` neither checkpoints nor compiles. ``mesh``:
    :meth:`cptune.ParallelDims.model_mesh`, a 1-D mesh (FSDP2 alone), or None (``wrap`` alone). Returns ``model``."""
    tp_mesh, data = split_mesh(mesh, "mesh")
    plan = None
    if tp_mesh is not None:
        styles = tp_styles()
        if not tp_plan or unapplied_styles(tp_plan):
            raise ValidationError([Problem("tp_plan", f"is {tp_plan!r} with tp={tp_mesh.size()}", "map each "
                                           f"module to split to one of {', '.join(styles)}")])
        named = {name for name, _ in layers[0].named_modules()}
        missing = sorted(key for key in tp_plan if key not in named)
        if missing:  # parallelize_module would only warn, and the block would run half split
            raise ValidationError([Problem("tp_plan", f"names {', '.join(missing)}, not modules of a "
                                           f"{type(layers[0]).__name__}", "name modules under a block, e.g. "
                                           f"{sorted(named - {''})[:3]}")])
        plan = tp_plan
    parallelize_layers(model, layers, tp_mesh, plan, sharder(data, dtype), wrap, keep_shards)
    return model
