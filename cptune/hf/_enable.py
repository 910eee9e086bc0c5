"""The implementation behind ``cptune.hf`` (its docstring says what it does): the ``"cptune"`` attention
implementation, the forward pre-hook's checks, packed documents and windows as transformers states them."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ..attention import documents_from_cu_seqlens, packed_documents, text_positions
from . import _families, _vision
from .. import mixers as _mixers
from ._check import CHECK_MODES, check_in_block
from ..mixers import cp_problems, layer_kinds, model_coverage
from ..losses import IGNORE_INDEX
from .._session import active
from ..context import scaled_dot_product_attention
from ..errors import Problem, raise_if
from .._torch_cp import not_compiled

ATTN_IMPLEMENTATION = "cptune"
_UNSUPPORTED = {"softcap": "attention logit softcapping", "position_bias": "a position bias (T5-style)"}


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; (B, H, S, D) in, (B, S, H, D) out."""
    if getattr(module, "_cptune_per_image", None):  # a vision tower's, within one image: never the block's
        return _vision.per_image_attention(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
    raise_if([Problem(name, f"is set: {what} cannot run under cptune's SDPA attention",
                      "train this model without it, or without context parallelism")
              for name, what in _UNSUPPORTED.items() if kwargs.get(name) is not None])
    session = active()
    if session is not None and session.cp > 1 and attention_mask is not None and _masks_some(attention_mask):
        raise_if([Problem("attention_mask", f"is a {tuple(attention_mask.shape)} mask that {type(module).__name__}'s "
                          f"model built itself for this rank's {query.shape[2]} tokens (not through transformers' "
                          "mask functions, which cptune stands in for inside a block); it cannot apply across CP "
                          "ranks", "train this model with cp=1, or with a transformers release whose modeling code "
                          "builds this family's masks with transformers' masking_utils (5.25 does for every family "
                          "of cptune's support matrix)")])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    window = kwargs.get("sliding_window")
    if window is not None:
        raise_if([] if causal else [Problem("sliding_window", f"is {window} in a non-causal attention layer",
                                            "cptune applies sliding windows of causal layers only")])
        window = (int(window) - 1, 0)  # transformers: kv_idx > q_idx - sliding_window
    documents = None
    if session is None and attention_mask is None and kwargs.get("position_ids") is not None:
        documents = packed_documents(kwargs["position_ids"])
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                       is_causal=causal, enable_gqa=key.shape[1] != query.shape[1],
                                       window=window, documents=documents, chunk=layer_chunk(module),
                                       sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


@not_compiled
def _masks_some(mask: torch.Tensor) -> bool:
    """Whether an attention mask hides anything (a bool mask with a False, an additive one with a non-zero)."""
    return not bool(mask.all()) if mask.dtype == torch.bool else bool(mask.any())


def layer_chunk(module: nn.Module) -> int | None:
    """The chunk an attention layer keeps to (Llama 4's ``chunked_attention`` layers: ``attention_chunk_size``
    tokens, block-diagonal), or None. transformers builds that mask for its own implementations only."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = layer_kinds(config) if config is not None and isinstance(index, int) else None
    if not kinds or index >= len(kinds) or kinds[index] != "chunked_attention":
        return None
    return getattr(getattr(config, "get_text_config", lambda: config)(), "attention_chunk_size", None)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


def _set_implementation(model: nn.Module, name: str) -> None:
    if getattr(model.config, "_attn_implementation", None) == name:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers before 4.56
        model.config._attn_implementation = name


def _all_ranks_true(flag: bool, session: Any) -> bool:
    """Agree across the CP group (a shard may hold the only masked token), so every rank raises or none."""
    t = torch.tensor([int(flag)], device=session.device_type if session.device_type != "cpu" else None)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=session.group)
    return bool(t.item())


@not_compiled
def _packed_documents(session: Any, given: dict[str, Any]) -> None:
    """Tell the block the documents of a packed batch, as transformers would find them."""
    cu = given.get("cu_seq_lens_q")
    if cu is not None:
        session.use_documents(documents_from_cu_seqlens(cu), "cu_seq_lens_q")
    positions = given.get("position_ids")
    if text_positions(positions) is None or given.get("attention_mask") is not None:
        return
    full = session.full_tensor(positions)
    if full is None:  # not one of the block's buffers: gather it (every rank runs this hook)
        full = session.unshard(positions, positions.ndim - 1) if session.cp > 1 else positions
    ids = packed_documents(text_positions(full))
    if ids is not None:
        session.use_documents(ids, "position_ids")


def _check_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    session = active()
    _set_implementation(module, ATTN_IMPLEMENTATION if session is not None else module._cptune_outside)
    if session is None:
        return None
    # a layer that mixes tokens outside attention: refused before this hook's own collective, on every rank alike
    raise_if(cp_problems(type(module).__name__, module._cptune_mixers, session.cp, "model") + _softcapped(module))
    names = [p for p in inspect.signature(module.forward).parameters]
    given = {**dict(zip(names, args)), **kwargs}  # positional arguments by name too
    problems = []
    mask = given.get("attention_mask")
    if session.cp > 1 and mask is not None and not _all_ranks_true(bool(mask.all()), session):
        problems.append(Problem("attention_mask", "masks some tokens (padding), which cptune's attention does not "
                                "apply inside a block", "train on unpadded sequences: pack documents and pass "
                                "position_ids that restart at each document (or documents= to the block), and "
                                "attention_mask=None"))
    if given.get("position_ids") is None and session.cp > 1:
        problems.append(Problem("position_ids", "is not given, so the model would number this rank's shard "
                                "from 0 (wrong rotary positions under CP)", "pass position_ids = "
                                "torch.arange(seq_len).expand(batch, seq_len) as a cptune buffer and to the model"))
    if given.get("labels") is not None and given.get("shift_labels") is None and session.cp > 1:
        problems.append(Problem("labels", "would be shifted inside this rank's shard, pairing tokens that are "
                                "not neighbours", "shift before sharding: labels = cptune.shift_labels(input_ids) "
                                "as a buffer, then call the model with shift_labels=labels (not labels=)"))
    if session.cp > 1:
        problems += _vision.call_problems(module, session, given)
    raise_if(problems)
    if session.cp > 1:
        _vision.stash(module, session, given)  # the whole batch's placeholders, for the tower's calls
    _packed_documents(session, given)
    if session.cp > 1 and not getattr(module, "_cptune_checking", False):
        check_in_block(module, session)  # a family the matrix has not proven: run whole and split, compared
    shifted = kwargs.get("shift_labels")
    if shifted is not None:
        kwargs = dict(kwargs)
        if kwargs.get("labels") is None:
            kwargs["labels"] = shifted  # transformers computes a loss only when labels is given
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = session.num_items_in_batch(shifted, kwargs.get("ignore_index", IGNORE_INDEX),
                                                                      "all")
    return args, kwargs


def _softcapped(model: nn.Module) -> list[Problem]:
    """Attention logit softcapping (Gemma 2: ``tanh`` of every score) has no SDPA kernel: refused by the config's
    name before the first collective, not from inside the first layer."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap is None:
        return []
    return [Problem("model", f"{type(text).__name__}.attn_logit_softcapping is {cap}: attention logit softcapping "
                    "(a tanh of every score) has no SDPA kernel, so cptune's attention cannot run it",
                    "train this model outside a cptune block, or set config.attn_logit_softcapping = None "
                    "(a different model from the one trained with it)")]


def enable(model: nn.Module, token_wise: Iterable[type | str] = (), check: str | None = None,
           check_tokens: int | None = None) -> nn.Module:
    """Make a transformers model CP-ready (attention inside blocks, checks, the loss divisor); returns the model.

    Inside a block of cp > 1, a model with layers that mix tokens outside softmax attention (convolutions over the
    sequence, recurrent, state-space and linear-attention layers, ``config.layer_types`` entries that are not
    attention; :mod:`cptune.mixers._rule`) is refused by name at its first forward, before any collective.
    ``token_wise``: module classes (or class names) you vouch for as per-token, which that rule cannot tell.
    ``check``: the first-step check (:mod:`cptune.hf._check`) at the first forward of each configuration: ``"auto"``
    (the default) for a family the support matrix has not proven, ``"always"``, or ``"never"``; ``check_tokens``:
    its sequence length (default: twice the longest reach the config states, within 4096)."""
    raise_if([Problem("check", f"is {check!r}", f"use one of {', '.join(CHECK_MODES)}")]
             if check is not None and check not in CHECK_MODES else [])
    raise_if([Problem("check_tokens", f"is {check_tokens!r}", "give a positive number of tokens, or None")]
             if check_tokens is not None and (not isinstance(check_tokens, int) or check_tokens < 1) else [])
    if check is not None:
        model._cptune_check = check
    if check_tokens is not None:
        model._cptune_check_tokens = check_tokens
    _register()
    vouched = {*getattr(model, "_cptune_token_wise", ()), *(t if isinstance(t, str) else t.__name__ for t in token_wise)}
    model._cptune_token_wise = vouched  # a later enable (cptune.models, the Trainer) keeps what the user vouched for
    _families.adapt(model)  # a family's own reading of the shard's positions, fixed from outside
    blocks, model._cptune_mixers = model_coverage(model, vouched)  # the blocks exact by the generic path
    for block in blocks.values():  # split paths where cptune has one for the layer, else the generic path
        _mixers.prepare(block)
    if not getattr(model, "_cptune_hook", None):
        current = getattr(model.config, "_attn_implementation", None)
        model._cptune_outside = current if current not in (None, ATTN_IMPLEMENTATION) else "sdpa"
    else:
        model._cptune_hook.remove()
    # first among the model's pre-hooks, FSDP2's included (it prepends its own when it wraps the model): the
    # first-step check runs whole forwards and backwards of the model, which must come before FSDP2 gathers the
    # root's parameters for the step (enable again after wrapping the model yourself)
    model._cptune_hook = model.register_forward_pre_hook(_check_call, with_kwargs=True, prepend=True)
    _vision.prepare(model)  # a vision-language model's tower: split over the ranks, its attention its own
    _set_implementation(model, ATTN_IMPLEMENTATION)
    return model
