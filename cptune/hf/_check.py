"""The first-step check of a transformers model (:mod:`cptune.verify` says what it compares): at the first forward of
a block of cp > 1, :func:`cptune.hf.enable`'s model runs a short sequence of its own twice on the user's ranks, mesh
and configuration, as one process (each document alone, transformers' own attention and masks) and split as the
block is, before the user's step goes on. Once per configuration (strategy, degrees, load balancing, packing).

Which models: ``enable(model, check="auto")`` checks a family the support matrix has not proven exact
(``proven.json``, written by ``python -m benchmarks.matrix --update-docs`` from the matrix's run on each transformers
major release), a model whose code is not transformers' own (``trust_remote_code``), and one whose modules the user
vouched for (``token_wise=``); ``"always"`` checks every model, ``"never"`` none. :func:`check` runs it up front,
outside a block (``train_hf`` and ``cptune search --model`` do).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import verify as C
from ..experts import ep_parameters
from ._lm_loss import causal_lm_loss
from ..losses import packed_labels_and_positions
from ..mixers import decoder_layers
from .._session import active
from ..errors import CPTuneError, Problem, ValidationError, raise_if
from ..mesh import ParallelDims
from .._torch_cp import not_compiled

CHECK_MODES = ("auto", "always", "never")
PROVEN_FILE = Path(__file__).with_name("proven.json")
_FIX = ("train this model with cp=1 (data parallelism, FSDP2 or tp), or tell cptune's maintainers with this "
        "message; if you have verified it yourself, cptune.hf.enable(model, check='never')")
_LOG = logging.getLogger("cptune")


@functools.cache
def proven_families() -> dict[str, tuple[str, ...]]:
    """transformers major release -> the families the support matrix ran exact in every CP cell."""
    return {major: tuple(names) for major, names in json.loads(PROVEN_FILE.read_text()).items()}


def _proven_names(major: str) -> set[str]:
    """The model types proven on a major release: the matrix's families, and the vision rows' (their language models'
    text-only calls included)."""
    return {*proven_families().get(major, ()), *proven_families().get(f"{major}-vision", ())}


def family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    return str(getattr(text, "model_type", None) or getattr(config, "model_type", type(model).__name__))


def proven(config) -> bool:
    """Whether the support matrix ran ``config``'s family exact in every CP cell on this transformers' major release
    (a model built from it by transformers, nothing vouched for: :func:`unproven_why` says the rest)."""
    import transformers

    text = getattr(config, "get_text_config", lambda: config)()
    major = transformers.__version__.split(".", 1)[0]
    return str(getattr(text, "model_type", None)) in _proven_names(major)


def proven_vision(model: nn.Module) -> bool:
    """Whether the support matrix's vision rows ran ``model``'s family exact (its own model type, not its text
    model's, is in the file) on this transformers' major release."""
    import transformers

    major = transformers.__version__.split(".", 1)[0]
    return str(getattr(model.config, "model_type", None)) in proven_families().get(f"{major}-vision", ())


def unproven_why(model: nn.Module) -> str | None:
    """Why ``model`` is not proven by the matrix (None: it is)."""
    import transformers

    if not base_class(model).__module__.startswith("transformers."):
        return f"{base_class(model).__module__} is not transformers' own code"
    if getattr(model, "_cptune_token_wise", None):
        return f"modules vouched for as per-token ({', '.join(sorted(model._cptune_token_wise))})"
    major = transformers.__version__.split(".", 1)[0]
    if family(model) not in _proven_names(major):
        return f"the support matrix has not proven {family(model)} on transformers {major}.x"
    return None


def _key(config, dims: ParallelDims, load_balance: bool, packed: bool) -> tuple:
    return (config.strategy, config.ulysses_degree, dims.shape, bool(load_balance), config.mixers, packed)


def wanted(model: nn.Module, key: tuple) -> bool:
    """Whether ``model`` is to be checked for this configuration now (its mode; once per configuration)."""
    mode = getattr(model, "_cptune_check", "auto")
    if mode == "never" or key in getattr(model, "_cptune_checks", {}):
        return False
    return mode == "always" or unproven_why(model) is not None


def _sequence(model: nn.Module, tokens: int, packed: bool, device: torch.device):
    """Seeded token ids, labels, positions and document ids (None: not packed) of one row."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, int(text.vocab_size), (1, tokens), generator=gen)
    docs = None
    if packed:  # three documents of uneven lengths, positions restarting at each
        cuts = [tokens * 3 // 8, tokens // 8]
        docs = torch.cat([torch.full((n,), i) for i, n in enumerate([*cuts, tokens - sum(cuts)])]).view(1, tokens)
    labels, positions = packed_labels_and_positions(ids, docs)
    move = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return move(ids), move(labels), move(positions), move(docs)


def _device(model: nn.Module) -> torch.device:
    weight = model.get_input_embeddings().weight
    return (weight.to_local() if hasattr(weight, "to_local") else weight).device


def _probes(model: nn.Module) -> tuple[C.Probes, dict[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    layers = {names[id(layer)]: layer for layer in decoder_layers(model, required=False)}
    head = model.get_output_embeddings()
    probes = C.Probes(outputs={f"layer {n} ({type_of(model, n)})": m for n, m in layers.items()},
                      inputs={"outputs": head} if head is not None else {},
                      grads={"input gradient": model.get_input_embeddings()})
    return probes, layers


_LABELS = {"loss": "the loss", "outputs": "the final hidden states", "input gradient": "the input embeddings' gradient"}


def _whole(model: nn.Module, probes: C.Probes, ids, labels, positions, docs) -> tuple[dict, dict, float]:
    """One process's run: each document alone, forward and backward (FSDP2 accumulates its gradients); what the
    probes kept, the gradients, the loss."""
    pieces = [(0, ids.shape[1])] if docs is None else _runs(docs[0])
    total, whole = labels.ne(-100).sum(), 0.0
    for a, b in pieces:
        probes.length = b - a
        piece = causal_lm_loss(model, ids[:, a:b], labels[:, a:b], num_items_in_batch=total,
                               position_ids=positions[:, a:b])
        piece.backward()
        whole += piece.item()
    return probes.take(len(pieces)), C.take_grads(model), whole


def _errors(got: dict, want: dict, got_grads: dict, want_grads: dict, loss: float, want_loss: float) -> dict:
    """Every measure's relative error: the probes' (those both runs kept), each parameter's, the loss's."""
    found = {name: C.relative(got[name], t) for name, t in want.items() if name in got and got[name].shape == t.shape}
    return {**found, **C.grad_errors(got_grads, want_grads), "loss": abs(loss - want_loss) / max(abs(want_loss), 1e-12)}


def run(model: nn.Module, config, mesh, dims: ParallelDims, causal: bool = True, packed: bool = False,
        tokens: int | None = None, seq_len: int | None = None, window: Any = None) -> C.CheckReport:
    """Check ``model`` under ``config`` on ``mesh`` (every rank calls it; no block active): run as one process, again
    with its rounding perturbed (the floor of each measure), and split; the report, or the refusal by name (a
    :class:`cptune.ValidationError`)."""
    elapsed = C.timed()
    count, notes = C.check_tokens(C.reaches(model.config), 16 * dims.cp * dims.tp, seq_len, tokens)
    ids, labels, positions, docs = _sequence(model, count, packed, _device(model))
    subject = f"{base_class(model).__name__} ({family(model)})"
    layout = C.layout_label(config, dims, causal)
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())  # it averages the gradients over its ranks
    experts = ep_parameters(model)
    with C.quiet(model):
        probes, layers = _probes(model)
        try:
            want, want_grads, want_loss = _whole(model, probes, ids, labels, positions, docs)
            C.per_rank(want_grads, experts, fsdp)
            dtype = probes.dtype or torch.float32
            with C.perturbed(layers.values(), dtype):
                noisy, noisy_grads, noisy_loss = _whole(model, probes, ids, labels, positions, docs)
            C.per_rank(noisy_grads, experts, fsdp)
            floors = _errors(noisy, want, noisy_grads, want_grads, noisy_loss, want_loss)
            del noisy, noisy_grads
            buffers = {"input_ids": ids, "shift_labels": labels, "position_ids": positions}
            try:
                with C.opened(config, causal, mesh, buffers, docs, window) as block:
                    shards = [block.shards[name] for name in block.plan.names]
                    probes.length = shards[0].shape[1]
                    loss = causal_lm_loss(model, shards[0], shards[1], position_ids=shards[2])
                    loss.backward()
                    taken = probes.take()
                    kept = [name for name in sorted(probes.names) if _everywhere(name in taken)]
                    got = {name: block.unshard(taken[name], 1) for name in kept}
                    if "input gradient" in got:  # each rank's loss is cp x its share (gradients are averaged)
                        got["input gradient"] /= dims.cp
                    loss = loss.detach().clone()
                    if block.group is not None:
                        dist.all_reduce(loss, group=block.group)
                    group = block.group
            except CPTuneError:
                raise
            except Exception as exc:  # noqa: BLE001 - the family's own code failing on a shard, named
                raise C.raised_problem(exc, model, subject, layout, "model", _FIX) from None
            got_grads = C.take_grads(model)
            C.average_over(got_grads, group, dims.cp, fsdp, experts)
        finally:
            probes.close()
    errors = _errors(got, want, got_grads, want_grads, loss.item() / dims.cp, want_loss)
    order = [name for name in probes.names if name.startswith("layer ")]
    report = C.CheckReport(subject, layout, count, packed, str(dtype).replace("torch.", ""),
                           C.assess(errors, floors, dtype, _LABELS, [n[6:] for n in order]), notes=notes)
    report.seconds = elapsed()
    return report


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a probe kept by all of them is gathered; one some lack is not)."""
    return C.agree([0.0 if flag else 1.0])[0] == 0.0


def base_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 makes a subclass of it)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _runs(row: torch.Tensor) -> list[tuple[int, int]]:
    change = (row[1:] != row[:-1]).nonzero().flatten().add(1).tolist()
    return [(int(a), int(b)) for a, b in zip([0, *change], [*change, row.numel()])]


def type_of(model: nn.Module, path: str) -> str:
    return base_class(model.get_submodule(path)).__name__


def _verdict(model: nn.Module, key: tuple, report: C.CheckReport) -> C.CheckReport:
    model.__dict__.setdefault("_cptune_checks", {})[key] = report
    if not dist.is_initialized() or dist.get_rank() == 0:
        _LOG.info(report.line())
    raise_if([] if report.passed else [report.problem("model", _FIX)])
    return report


@not_compiled
def check_in_block(model: nn.Module, session) -> None:
    """The check at the first forward of ``session`` (a block of cp > 1), if ``model`` wants one: the block set aside
    while it runs; the user's step then goes on as it was."""
    packed = session.documents is not None
    key = _key(session.config, session.dims, session.plan.load_balance, packed)
    if not wanted(model, key):
        return
    hooks = getattr(model, "_forward_pre_hooks", {})
    if isinstance(model, FSDPModule) and next(iter(hooks), None) != model._cptune_hook.id:
        raise ValidationError([Problem("model", "was wrapped by FSDP2 (fully_shard) after cptune.hf.enable, so FSDP2 "
                                       "has gathered its parameters for this step before cptune's first-step check "
                                       "could run the model", "call cptune.hf.enable(model) again after fully_shard "
                                       "(or call cptune.hf.check(model, ...) before the first step)")])
    request = model.__dict__.pop("_cptune_loss_request", None)  # the user's causal_lm_loss, under way
    path = model.__dict__.get("_cptune_loss_path")
    model._cptune_checking = True
    try:
        with C.set_aside(session):
            report = run(model, session.config, session.mesh, session.dims, session.causal, packed,
                         getattr(model, "_cptune_check_tokens", None), session.plan.seq_len, session._asked[1])
    finally:
        model._cptune_checking = False
        if request is not None:
            model._cptune_loss_request = request
        if path is not None:
            model._cptune_loss_path = path
    _verdict(model, key, report)


def check(model: nn.Module, *, config: Any = None, recipe: Any = None, mesh: Any = None, packed: bool = False,
          tokens: int | None = None, seq_len: int | None = None) -> C.CheckReport | None:
    """Run the first-step check now, outside any block, on every rank (a collective): the report, or None when
    ``model`` wants none (its mode, or a proven family, or checked already). ``config``/``recipe``/``mesh`` as for
    :class:`cptune.context_parallel`; ``packed``: check it on packed documents; ``tokens``: the check's length
    (default: twice the longest reach its config states, within :data:`cptune.verify.TOKENS`)."""
    from ..context import config_for

    raise_if([Problem("model", "is not enabled", "call cptune.hf.enable(model) first")]
             if not getattr(model, "_cptune_hook", None) else [])
    if active() is not None:
        raise ValidationError([Problem("check", "was called inside a cptune.context_parallel block",
                                       "call it before the block (inside one, the model checks itself at its "
                                       "first forward)")])
    config = config_for(config, recipe)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.of_mesh(mesh)[0] if mesh is not None else config.parallel_dims(world)
    if dims.cp == 1:
        return None
    key = _key(config, dims, config.load_balance_for(True, dims.cp), packed)
    if not wanted(model, key):
        return None
    model._cptune_checking = True
    try:
        report = run(model, config, mesh, dims, True, packed, tokens or getattr(model, "_cptune_check_tokens", None),
                     seq_len)
    finally:
        model._cptune_checking = False
    return _verdict(model, key, report)
