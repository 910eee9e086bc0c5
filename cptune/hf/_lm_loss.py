"""The loss a transformers causal LM trains with under cptune, without the whole logits: ``cptune.hf.causal_lm_loss``
(its docstring says what it does), asked of the model's LM head while the model runs."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ..losses import head_of, loss_sum
from ..losses import IGNORE_INDEX
from .._session import active


def _head_forward(model: nn.Module, forward, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's forward: while :func:`causal_lm_loss` asks, the chunked loss of ``hidden`` kept for it and
    empty logits returned (no vocabulary dim: nothing the model does to them afterwards costs anything)."""
    request = model.__dict__.get("_cptune_loss_request")
    if request is None:
        return forward(hidden)
    head = model.get_output_embeddings()
    request["loss"], request["path"] = loss_sum(hidden, head.weight, request["labels"], model._cptune_head,
                                                bias=getattr(head, "bias", None), ignore_index=request["ignore_index"],
                                                path=request["path"], group=getattr(head, "_cptune_tp_group", None))
    # empty, yet made from the loss: a caller that walks the graph from the model's outputs (DDP finding unused
    # parameters) reaches every parameter the loss used
    return request["loss"].reshape(1, 1, 1).expand(*hidden.shape[:-1], 0)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, shift_labels: torch.Tensor,
                   num_items_in_batch: torch.Tensor | float | None = None, ignore_index: int = IGNORE_INDEX,
                   whole: bool = False, **inputs: Any) -> torch.Tensor:
    """A causal LM's next-token loss, as ``model(input_ids=..., shift_labels=..., **inputs).loss`` gives it, without
    the whole logits (the chunked loss of :mod:`cptune.losses`); in a block or out of one. ``shift_labels``: the
    targets shifted over the whole sequence before sharding (:func:`cptune.shift_labels`); the loss is their summed
    token losses over ``num_items_in_batch`` (default: inside a block the exact count over every rank, as the
    pre-hook gives transformers; outside one the valid targets of this call). A model whose head cptune cannot chunk
    exactly (its forward does more to the logits than scale or softcap them) takes its own whole-logits loss, and
    ``model._cptune_loss_path`` says so, as it says which chunked path ran ("torch", "cptune", and under tensor
    parallelism "vocab-parallel"). ``whole``: the model's own loss from the whole logits, asked for (``cptune search
    --loss whole`` and its recipe)."""
    inner = getattr(model, "module", model)  # DDP's wrapper: the head is its module's
    head = inner.__dict__.get("_cptune_head")
    if head is None:
        head = inner._cptune_head = head_of(inner)
        output = inner.get_output_embeddings()
        if not isinstance(head, str) and not getattr(output, "_cptune_chunked", False):
            output.forward = functools.partial(_head_forward, inner, output.forward)
            output._cptune_chunked = True
    if isinstance(head, str) or whole:
        inner._cptune_loss_path = f"whole logits: {head}" if isinstance(head, str) else "whole logits (asked)"
        return model(input_ids=input_ids, labels=shift_labels, shift_labels=shift_labels,
                     num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, **inputs).loss
    session = active()
    if num_items_in_batch is None:
        num_items_in_batch = session.num_items_in_batch(shift_labels, ignore_index, "all") if session is not None \
            else (shift_labels != ignore_index).sum()
    request = {"labels": shift_labels, "ignore_index": ignore_index, "path": None}
    inner._cptune_loss_request = request
    try:
        model(input_ids=input_ids, use_cache=False, **inputs)
    finally:
        del inner._cptune_loss_request
    inner._cptune_loss_path = request["path"]
    return request["loss"] / num_items_in_batch
