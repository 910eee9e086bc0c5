"""Which configurations exist for a world of ranks, and which can run a workload: the one list the search's
space and ``cptune plan`` both enumerate (meshes, strategies and their splits), and how a configuration is keyed."""

from __future__ import annotations

import itertools

import torch

from ..config import ROTATE_METHODS, CPConfig, decide_load_balance  # noqa: F401  (the search's axis)
from ..attention import RING_BACKENDS, backend_problem
from ..mesh import ep_problems, full_shape
from ..models import training_problems
from ..workload import AC_MODES, Workload  # noqa: F401  (AC_MODES: the planner's and the search's name for it)
from ._experts import fewer_experts


def strategies(world_size: int) -> tuple[str, ...]:
    """'ring', 'ulysses', and 'hybrid-u<k>' for each Ulysses group size k that leaves a ring of 2 or more."""
    hybrids = [f"hybrid-u{u}" for u in range(2, world_size // 2 + 1) if world_size % u == 0 and world_size // u >= 2]
    return ("ring", "ulysses", *hybrids)


def mesh_shapes(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, cp) with dp * cp == world_size, most context-parallel first."""
    return [(world_size // cp, cp) for cp in range(world_size, 0, -1) if world_size % cp == 0]


def tp_degrees(world_size: int, per_node: int, max_tp: int | None = None) -> tuple[int, ...]:
    """The tensor-parallel degrees of ``world_size`` ranks, ``per_node`` a node (tp stays inside a node): the divisors
    of a node's ranks that divide the world, up to ``max_tp`` (None: a node's)."""
    node = min(world_size, per_node)
    return tuple(t for t in range(1, node + 1) if node % t == 0 and world_size % t == 0 and t <= (max_tp or node))


def transformers_missing() -> bool:
    """Whether transformers cannot be imported: a ``--model`` is then read from its config.json's fields alone, and
    neither its family's TP plan nor its layer rule (which layers mix tokens outside attention) can be read."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return True
    return False


def model_limits(workload: Workload, degrees: tuple[int, ...]) -> tuple[tuple[int, ...], str | None, str | None]:
    """What a ``--model`` workload's model can train under: (those of ``degrees`` its TP plan can split, why it cannot
    take cp > 1 or None, what cptune's generic path runs whole on every rank under cp > 1 -- '3 x
    Qwen3NextGatedDeltaNet' -- or None), by :func:`cptune.models.tp_problems`, :func:`cptune.models.cp_problems` and
    :func:`cptune.models.whole_layers` on one model made on the meta device, every tensor there (nothing allocated,
    whatever its size); the one rule the search's space and ``cptune plan`` both apply, so neither proposes what the
    training script refuses. Without transformers (:func:`transformers_missing`) nothing of the family can be read:
    tp = 1 only, and nothing refused or run whole."""
    if workload.model is None:
        return degrees, None, None
    if transformers_missing():
        return tuple(t for t in degrees if t == 1), None, None
    from collections import Counter

    from .. import models

    config = models.load_config(workload.model, workload.model_overrides)
    fewer = fewer_experts(config.to_dict())  # the same modules, made in a moment
    if fewer:
        config = models.load_config(workload.model, {**(workload.model_overrides or {}), **fewer})
    model = models.empty_model(config, structure_only=True)
    refused = models.cp_problems(config, 2, "model", model)
    kinds = Counter(models.whole_layers(config, model).values())
    return (tuple(t for t in degrees if not models.tp_problems(config, t, model=model)),
            refused[0].message.replace("is cp=2 but ", "") if refused else None,
            ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) or None)


def mixer_choices(workload: Workload) -> tuple[str, ...]:
    """How a ``--model`` workload's layers that mix tokens outside attention may cross the CP ranks (the search's
    ``mixers`` axis, :attr:`cptune.CPConfig.mixers`): ('split', 'whole') where one of them has a split path
    (:mod:`cptune.mixers._choice`), else none to choose."""
    if workload.model is None:
        return ()
    from .. import models
    from .. import mixers as _mixers

    model = models.empty_model(models.load_config(workload.model, workload.model_overrides), structure_only=True)
    return ("split", "whole") if any(_mixers.splits(m) for m in _mixers.model_coverage(model)[0].values()) else ()


def expert_degrees(workload: Workload, world: int) -> tuple[int, ...]:
    """The ep degrees (:attr:`cptune.CPConfig.ep_degree`) a ``--model`` workload's mixture of experts may take on
    ``world`` ranks (the search's and the plan's ``ep`` axis): 1 and each divisor of the world that divides the
    routed experts, where transformers builds them grouped (:func:`cptune.experts.experts_modules`, read on a model
    made on the meta device with fewer experts: the same modules); none (no axis) for a dense model, without
    transformers, or on one rank."""
    if workload.model is None or world < 2 or transformers_missing():
        return ()
    from .. import experts, models
    from ._experts import experts_from_fields

    config = models.load_config(workload.model, workload.model_overrides)
    text = config.get_text_config()
    moe = experts_from_fields(text.to_dict(), text.model_type)
    if moe is None:
        return ()
    fewer = fewer_experts(config.to_dict())  # the same modules, made in a moment (a composite config's: as they are)
    if fewer:
        config = models.load_config(workload.model, {**(workload.model_overrides or {}), **fewer})
    if not experts.experts_modules(models.empty_model(config, structure_only=True)):
        return ()
    return tuple(d for d in range(1, world + 1) if world % d == 0 and moe.experts % d == 0)


def meshes(world_size: int, tp_degrees: tuple[int, ...] = (1,), replicas: tuple[int, ...] = (1,)
           ) -> list[tuple[int, ...]]:
    """Every mesh of ``world_size`` ranks with a tp among ``tp_degrees`` and a dp_replicate among ``replicas``: (dp,
    cp) without either (as every configuration before the named mesh is written), (dp_replicate, dp_shard, cp, tp)
    otherwise; by replicas, tp, then most context-parallel first."""
    return [(dp, cp) if tp == 1 and r == 1 else (r, dp, cp, tp)
            for r in replicas if world_size % r == 0 for tp in tp_degrees if world_size // r % tp == 0
            for dp, cp in mesh_shapes(world_size // r // tp)]


def usable_backends(device_type: str, dtype: torch.dtype) -> list[str]:
    """Backends that can ring-attend on this device and dtype, in PyTorch's priority order."""
    return [b for b in RING_BACKENDS if backend_problem(device_type, b, dtype, ring=True) is None]


def canonical(config: CPConfig) -> CPConfig:
    """The same configuration written one way: with cp == 1 the strategy, rotate method and load
    balancing don't apply; under Ulysses the rotate method and load balancing don't."""
    if config.mesh_shape and _dims(config).cp == 1:
        return config.model_copy(update={"rotate_method": "allgather", "load_balance": False, "strategy": "ring",
                                         "ulysses_degree": None, "mixers": "split"})
    if config.strategy == "ulysses":
        return config.model_copy(update={"rotate_method": "allgather", "load_balance": False})
    return config


def config_key(config: CPConfig, ac: str | None = None) -> str:
    """One name per distinct configuration (with ``ac``: the activation checkpointing a search tries with it)."""
    c = canonical(config)
    dims = _dims(c)
    mesh = (f"dpr{dims.dp_replicate}-" if dims.dp_replicate > 1 else "") + f"dp{dims.dp_shard}-cp{dims.cp}" + (
        f"-tp{dims.tp}" if dims.tp > 1 else "") + (f"-ep{c.ep_degree}" if c.ep_degree > 1 else "")  # as before
    backend = "+".join(c.sdpa_backend) + ("-mixers-whole" if c.mixers == "whole" else "") + (f"-ac-{ac}" if ac else "")
    if c.strategy == "ulysses":
        return f"{mesh}-ulysses-{backend}"
    strategy = f"hybrid{c.ulysses_degree}-" if c.strategy == "hybrid" else ""  # ring keys as before strategies
    return f"{mesh}-{strategy}{c.rotate_method}-{'lb' if c.load_balance else 'nolb'}-{backend}"


def _dims(config: CPConfig):
    """``config``'s mesh without its ep (a configuration whose ep the mesh cannot fold is still keyed and told why)."""
    return config.model_copy(update={"ep_degree": 1}).parallel_dims()


def config_from(params: dict) -> CPConfig:
    """A configuration from the search's parameters; ``mesh`` is a shape of :func:`meshes`, 'DPxCP' or
    'DPRxDPxCPxTP'; ``ep`` (absent: 1) its expert-parallel degree."""
    shape = tuple(int(x) for x in params["mesh"].split("x"))
    strategy, _, u = params.get("strategy", "ring").partition("-u")
    lb = bool(params["load_balance"]) and strategy != "ulysses"
    return canonical(CPConfig(mesh_shape=shape, strategy=strategy, ulysses_degree=int(u) if u else None,
                              rotate_method=params["rotate_method"], sdpa_backend=(params["sdpa_backend"],),
                              load_balance=lb, mixers=params.get("mixers", "split"), ep_degree=params.get("ep", 1)))


def invalid_reason(workload: Workload, config: CPConfig, device_type: str | None) -> str | None:
    """Why ``config`` can never run this workload (on ``device_type``'s kernels; None: not checked), or None."""
    dims = _dims(config)
    folded = ep_problems(dims.shape, config.ep_degree) + training_problems(workload.ac, False, ep=config.ep_degree)
    if folded:
        return f"{folded[0].argument} {folded[0].message}"
    cp, s = dims.cp, workload.seq_len
    split = config.degree_problems(cp)
    if split:
        return f"{config.strategy} with ulysses_degree={config.ulysses_degree} does not split cp={cp}"
    ulysses, ring = config.degrees(cp)
    if s % cp:
        return f"sequence length {s} is not divisible by cp={cp}"
    balance = decide_load_balance(config.load_balance, causal=workload.causal, cp=cp, ring=ring, seq_len=s)
    if balance.problems:
        return balance.problems[0].message
    heads = dims.model_problems(heads=workload.heads, kv_heads=workload.kv_heads or workload.heads,
                                ulysses=ulysses) + dims.sequence_problems(s)
    if heads:
        return heads[0].message
    if device_type is None:  # a plan for a cluster not at hand: kernels are not checked here
        return None
    why = backend_problem(device_type, config.sdpa_backend[0], workload.torch_dtype, ring=ring > 1)
    return f"sdpa_backend {config.sdpa_backend[0]}: {why}" if why else None


def configurations(workload: Workload, world: int, backends: tuple[str, ...], device_type: str | None = None,
                   tp_degrees: tuple[int, ...] = (1,), replicas: tuple[int, ...] = (1,), cp_refused: str | None = None,
                   mixers: tuple[str, ...] = (), ep: tuple[int, ...] = ()) -> tuple[list[CPConfig],
                                                                                     list[tuple[str, str]]]:
    """Every distinct configuration of ``world`` ranks for ``workload`` over ``backends``: (the valid ones, in
    mesh / strategy / rotate / backend / load-balance order, and (label, why) for the invalid ones). The one
    enumeration the search's oracle and ``cptune plan`` both use; a hybrid whose Ulysses group does not split a
    mesh's cp is not a configuration of that mesh (skipped, not listed as invalid). ``cp_refused``: why the model
    cannot take cp > 1 (:func:`model_limits`), each such configuration invalid for it; ``mixers``: the ways its
    hybrid layers may cross the ranks (:func:`mixer_choices`; none: as the configuration's default); ``ep``: its
    experts' degrees (:func:`expert_degrees`; an ep a mesh cannot fold is not a configuration of that mesh)."""
    seen: set[str] = set()
    valid: list[CPConfig] = []
    invalid: list[tuple[str, str]] = []
    balance = (True, False) if workload.causal else (False,)
    for shape, strategy, rotate, backend, lb, mix, degree in itertools.product(
            meshes(world, tp_degrees, replicas), strategies(world), ROTATE_METHODS, backends, balance,
            mixers or ("split",), ep or (1,)):
        if ep_problems(full_shape(shape), degree):
            continue
        config = config_from({"mesh": "x".join(map(str, shape)),
                              "strategy": strategy, "rotate_method": rotate, "sdpa_backend": backend,
                              "load_balance": lb, "mixers": mix, "ep": degree})
        key = config_key(config)
        if key in seen or config.degree_problems(config.parallel_dims().cp):
            continue
        seen.add(key)
        reason = cp_refused if cp_refused and config.parallel_dims().cp > 1 else \
            invalid_reason(workload, config, device_type)
        if reason is None:
            valid.append(config)
        else:
            invalid.append((config.label(), reason))
    return valid, invalid
