"""transformers models under cptune: one call, then train as transformers trains.

::

    import cptune, cptune.hf
    cptune.hf.enable(model)                      # once, after from_pretrained / from_config
    model.train(); model.gradient_checkpointing_enable()
    labels = cptune.shift_labels(input_ids)      # whole sequence, before sharding
    positions = torch.arange(seq_len).expand(batch, seq_len)
    with cptune.context_parallel(buffers=[input_ids, labels, positions], seq_dims=[1, 1, 1]) as cp:
        loss = model(input_ids=input_ids, position_ids=positions, shift_labels=labels, use_cache=False).loss
        loss.backward()

:func:`enable` registers an attention implementation named ``"cptune"`` (causal SDPA with no
mask tensor, which cptune runs as ring attention inside a block and as plain SDPA outside
one) and switches the model to it. transformers builds no mask for such an implementation,
so load-balanced local ``position_ids`` are not mistaken for packed sequences. It also adds a
forward pre-hook that, inside a CP block, refuses what would silently give wrong numbers
(labels shifted inside a shard, positions made inside the model, a padding mask) and fills in
``num_items_in_batch`` so the loss is the exact single-device mean over every rank's tokens.
Verified with transformers 5.24 (``shift_labels`` and ``num_items_in_batch`` are taken by its
causal-LM loss since 4.46 / 4.50). transformers is optional: only this module imports it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._loss import IGNORE_INDEX
from ._session import active
from .errors import Problem, raise_if

ATTN_IMPLEMENTATION = "cptune"


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; (B, H, S, D) in, (B, S, H, D) out."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


def _all_ranks_true(flag: bool, session: Any) -> bool:
    """Agree across the CP group (a shard may hold the only masked token), so every rank raises or none."""
    t = torch.tensor([int(flag)], device=session.device_type if session.device_type != "cpu" else None)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=session.group)
    return bool(t.item())


def _check_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    session = active()
    if session is None or session.cp == 1:
        return None
    names = [p for p in inspect.signature(module.forward).parameters]
    given = {**dict(zip(names, args)), **kwargs}  # positional arguments by name too
    problems = []
    mask = given.get("attention_mask")
    if mask is not None and not _all_ranks_true(bool(mask.all()), session):
        problems.append(Problem("attention_mask", "masks some tokens (padding or packed documents), which ring "
                                "attention cannot apply", "train on unpadded sequences of one length and pass "
                                "attention_mask=None (pack documents without a mask, or pad to full length)"))
    if given.get("position_ids") is None:
        problems.append(Problem("position_ids", "is not given, so the model would number this rank's shard "
                                "from 0 (wrong rotary positions under CP)", "pass position_ids = "
                                "torch.arange(seq_len).expand(batch, seq_len) as a cptune buffer and to the model"))
    if given.get("labels") is not None and given.get("shift_labels") is None:
        problems.append(Problem("labels", "would be shifted inside this rank's shard, pairing tokens that are "
                                "not neighbours", "shift before sharding: labels = cptune.shift_labels(input_ids) "
                                "as a buffer, then call the model with shift_labels=labels (not labels=)"))
    raise_if(problems)
    shifted = kwargs.get("shift_labels")
    if shifted is not None:
        kwargs = dict(kwargs)
        if kwargs.get("labels") is None:
            kwargs["labels"] = shifted  # transformers computes a loss only when labels is given
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = session.num_items_in_batch(shifted, kwargs.get("ignore_index", IGNORE_INDEX),
                                                                      "all")
    return args, kwargs


def enable(model: nn.Module) -> nn.Module:
    """Make a transformers model CP-ready (attention, mask, loss checks); returns the model."""
    _register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # transformers before 4.56
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if not getattr(model, "_cptune_hook", None):
        model._cptune_hook = model.register_forward_pre_hook(_check_call, with_kwargs=True)
    return model


__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "enable"]
