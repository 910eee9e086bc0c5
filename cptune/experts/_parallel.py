"""Expert parallelism: each mixture-of-experts layer's experts split over an ``ep`` group of ranks, every routed token
sent to its expert's rank and its output sent back, by two all-to-alls (torchtitan's and Megatron-Core's way).

A transformers 5 MoE layer keeps its experts as one module whose parameters stack every expert along their first dim
(``gate_up_proj``: (experts, ...), GPT-OSS's biases too) and whose forward takes the layer's tokens with each token's
top-k expert indices and weights (``Qwen3MoeExperts``, ``MixtralExperts``, ``GptOssExperts``, DeepSeek-V3's, ...).
:func:`expert_parallel` keeps on each rank its ``experts / ep`` of those rows and replaces the module's forward:

1. each (token, k) pair goes to the rank that holds its expert (one all-to-all of the split sizes, one of the rows);
2. that rank runs the module's own forward on what it received, with its local experts and a weight of one, so each
   family's expert (its activation, clamps, biases) is its own code;
3. the outputs come back by the reverse all-to-all, are weighted by the router's weights on the token's own rank
   (the router's gradient stays local) and summed over the k experts.

Backward runs the same all-to-alls in reverse (cptune's differentiable all-to-all, ``_collectives``). A rank's expert
gradients sum every token its ep group routed to them; summed again over the expert's replicas (the ranks of the
other groups that hold it) they are the whole world's, divided by the world as every other gradient is averaged
(:func:`average_gradients`). Tokens are independent for the experts, so the ep groups may be any ranks: inside the
CP group, across it, or over data-parallel ranks too (ep folded over dp_shard x cp, as torchtitan and Megatron do).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._collectives import all_to_all_rows, groups as made_groups
from ..errors import Problem, raise_if


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The grouped-experts modules of ``model`` (name -> module): transformers 5's experts (its
    ``use_experts_implementation`` marks them: called with the tokens, each token's top-k expert indices and their
    weights), an integer ``num_experts`` and a parameter of three or more dims whose first dim is that number.
    transformers 4.x's experts (lists of modules; 4.56's GPT-OSS weighs by a dense (tokens, experts) matrix) are not
    among them."""
    found = {}
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1 or \
                not hasattr(module, "_is_expert_parallel"):
            continue
        stacked = [p for p in module.parameters(recurse=False) if p.ndim >= 3 and p.shape[0] == experts]
        if stacked:
            found[name] = module
    return found


def ep_problems(model: nn.Module, ep: int, argument: str = "ep") -> list[Problem]:
    """Why ``model``'s experts cannot be split over ``ep`` ranks (none: they can, or ep is 1)."""
    if ep <= 1:
        return []
    found = experts_modules(model)
    if not found:
        return [Problem(argument, f"is {ep} but {type(model).__name__} has no grouped experts (a module whose "
                        "parameters stack every expert, as transformers 5 builds a mixture of experts)",
                        "use ep=1 for this model (a dense model; a mixture of experts needs transformers 5: "
                        "pip install -U transformers)")]
    problems = []
    for name, module in found.items():
        if module.num_experts % ep:
            problems.append(Problem(argument, f"is {ep}, which does not divide {name}'s {module.num_experts} experts",
                                    f"use an ep that divides {module.num_experts}"))
        elif hasattr(module, "_cptune_experts"):
            problems.append(Problem(argument, f"{name} is split over expert-parallel ranks already",
                                    "call expert_parallel once per model"))
    return problems


def expert_parallel(model: nn.Module, ep: int) -> nn.Module:
    """Split each grouped-experts module of ``model`` over ``ep`` ranks: the world in groups of ``ep`` consecutive
    ranks, rank r of a group keeping experts ``[r E/ep, (r+1) E/ep)`` of each layer and trading tokens for them by
    all-to-all inside its group; the ranks that hold the same experts (one in each group) are its replicas. Every
    rank calls it (it makes the groups), on the model every rank built alike, before FSDP2 (``build_model(ep=)``
    splits them as it builds, under FSDP2); returns ``model``."""
    raise_if(ep_problems(model, ep) + world_problems(ep))
    groups = ep_groups(ep)
    for module in experts_modules(model).values():
        split(module, groups)
    return model


def world_problems(ep: int, argument: str = "ep") -> list[Problem]:
    """Why the world cannot be cut into groups of ``ep`` ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep > 1 and world % ep:
        return [Problem(argument, f"is {ep}, which does not divide the {world} ranks", f"use an ep that divides {world}")]
    return []


def ep_groups(ep: int) -> tuple[Any, Any]:
    """(this rank's ep group, its replicas' group) of the world cut into groups of ``ep`` consecutive ranks (every
    rank calls it: it makes every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made = made_groups([list(range(g, g + ep)) for g in range(0, world, ep)] +
                       [list(range(r, world, ep)) for r in range(ep)])
    return made[rank // ep], made[world // ep + rank % ep]


def split(module: nn.Module, groups: tuple[Any, Any]) -> None:
    """``module``'s experts of this rank's place in its ep group (:func:`ep_groups`), its forward trading tokens."""
    ep = dist.get_world_size(groups[0])
    keep(module, dist.get_rank(groups[0]), ep)
    module._cptune_ep = groups
    module.forward = functools.partial(_forward, module, type(module).forward)


def average_gradients(model: nn.Module) -> None:
    """Each split expert's gradient as the world's average, where nothing averages it (no FSDP2): summed over its
    replicas (each summed what its own ep group routed to it), divided by the world, as the other parameters'
    gradients are averaged over it. Every rank calls it after backward."""
    split = ep_parameters(model)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None and name in split}
    averaged(grads, split)


def averaged(grads: dict[str, torch.Tensor], split: dict[str, Any]) -> None:
    """:func:`average_gradients` on gradients taken off the model (``split``: :func:`ep_parameters`)."""
    world = dist.get_world_size()
    for name, grad in grads.items():
        if name in split:
            if dist.get_world_size(split[name]) > 1:
                dist.all_reduce(grad, group=split[name])
            grad /= world


def keep(module: nn.Module, rank: int, ep: int) -> None:
    """``module``'s experts of this ep rank, as parameters of their own (the others freed)."""
    total = module.num_experts
    local = total // ep
    for name, p in list(module.named_parameters(recurse=False)):
        if p.shape[0] == total:
            rows = p.detach()[rank * local:(rank + 1) * local].clone()
            setattr(module, name, nn.Parameter(rows, requires_grad=p.requires_grad))
    module.num_experts = local
    module._cptune_experts = (total, rank * local)


def local_experts(module: nn.Module) -> tuple[int, int]:
    """(all experts of the layer, the first this rank holds) of a module :func:`expert_parallel` split."""
    return module._cptune_experts


def saved_names(model: nn.Module) -> dict[str, str]:
    """Each split expert parameter's name -> the name a checkpoint keeps it under: ``<name>@experts<first>-<last>of
    <all>``. A distributed checkpoint keys tensors by name, and the ranks of different ep groups hold different experts
    under one name: saved as they are, one group's would stand for every group's."""
    names = {}
    for full, module in _split_parameters(model):
        total, first = module._cptune_experts
        for wrapper in _WRAPPERS:  # a state dict's names are the model's without its wrappers'
            full = full.replace(wrapper, "")
        names[full] = f"{full}@experts{first}-{first + module.num_experts - 1}of{total}"
    return names


def _split_parameters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, its module) of each parameter :func:`split` left: the rows :func:`keep` kept, this rank's experts."""
    return [(f"{name}.{pname}" if name else pname, module) for name, module in model.named_modules()
            if hasattr(module, "_cptune_experts")
            for pname, p in module.named_parameters(recurse=False) if p.shape[0] == module.num_experts]


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""What activation checkpointing's wrapper and torch.compile's module put in a parameter's name and
``torch.distributed.checkpoint.state_dict`` takes out."""


def renamed(model_state: dict, optim_state: dict, names: dict[str, str]) -> tuple[dict, dict]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict``'s model and optimizer state with each name in
    ``names`` as it maps it (:func:`saved_names` to save; its inverse to load back); a name of ``names`` the model
    state lacks is refused by name (its experts would be saved under one name for every ep group)."""
    missing = sorted(set(names) - set(model_state) - set(names.values()))
    raise_if([Problem("model", f"has split experts the state dict does not name: {missing[0]}", "save the model "
                      "without wrappers around its experts' modules (checkpoint_wrapper and torch.compile are known)")]
             if missing else [])
    model_state = {names.get(k, k): v for k, v in model_state.items()}
    optim_state = {**optim_state, "state": {names.get(k, k): v for k, v in optim_state.get("state", {}).items()},
                   "param_groups": [{**g, "params": [names.get(k, k) for k in g["params"]]}
                                    for g in optim_state.get("param_groups", [])]}
    return model_state, optim_state


def ep_parameters(model: nn.Module) -> dict[str, Any]:
    """Each parameter :func:`expert_parallel` split (its name in ``model``) -> the process group of its replicas (the
    ranks that hold the same experts)."""
    return {name: module._cptune_ep[1] for name, module in _split_parameters(model)}


def _forward(module: nn.Module, own: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    group = module._cptune_ep[0]
    ep, local = dist.get_world_size(group), module.num_experts
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    dest = torch.div(flat, local, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    rows = hidden_states[torch.div(order, k, rounding_mode="floor")]
    ids = torch.empty(sum(recv_sizes), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(ids, (flat % local)[order].contiguous(), recv_sizes, send_sizes, group=group)
    got = all_to_all_rows(rows, recv_sizes, send_sizes, group)
    ones = torch.ones(got.shape[0], 1, dtype=top_k_weights.dtype, device=got.device)
    out = own(module, got, ids.unsqueeze(1), ones)
    back = all_to_all_rows(out, send_sizes, recv_sizes, group)
    pairs = torch.empty_like(back).index_copy(0, order, back)  # back in (token, k) order
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(1).to(hidden_states.dtype)


__all__ = ["average_gradients", "averaged", "ep_groups", "ep_parameters", "ep_problems", "expert_parallel",
           "experts_modules", "local_experts", "split", "world_problems"]
