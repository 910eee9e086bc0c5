"""transformers models under cptune: one call, then train as transformers trains.

::

    import cptune, cptune.hf
    cptune.hf.enable(model)                      # once, after from_pretrained / from_config
    model.train(); model.gradient_checkpointing_enable()
    labels = cptune.shift_labels(input_ids)      # whole sequence, before sharding
    positions = torch.arange(seq_len).expand(batch, seq_len)   # or restarting per packed document
    with cptune.context_parallel(buffers=[input_ids, labels, positions], seq_dims=[1, 1, 1]) as cp:
        loss = model(input_ids=input_ids, position_ids=positions, shift_labels=labels, use_cache=False).loss
        # or the same loss without the whole logits (tokens x vocabulary: the largest tensor at long context):
        # loss = cptune.hf.causal_lm_loss(model, input_ids, labels, position_ids=positions)
        loss.backward()

:func:`enable` registers an attention implementation named ``"cptune"`` and uses it inside CP
blocks; outside them the model runs its own implementation (``sdpa``, ``eager``, ...) with the
masks transformers builds, so evaluation, padding and generation on one device are unchanged.
Inside a block transformers builds no mask (it would build one for this rank's shard only):

* **packed documents** are recognized the way transformers recognizes them: ``position_ids``
  that restart at each document with no attention mask (``DataCollatorWithFlattening``), or the
  flash-attention kwargs ``cu_seq_lens_q`` a collator passes. The whole sequence's position ids
  are read from the block's buffer (or gathered), and the block's attention keeps to documents.
  With load balancing, name the position ids in the buffers (``buffers={"input_ids": ...,
  "position_ids": positions}``, or the decorator's ``position_ids`` argument): the block then
  reads the packing when it opens and deals the tokens by work, as ``documents=`` does; found only
  by the model call, they are dealt head-tail (a warning says so when that is unbalanced);
* **sliding windows** (Mistral, Qwen2 and Gemma sliding layers: ``sliding_window=W`` lets a token
  see W tokens, itself included) become the block's window ``(W - 1, 0)`` for that layer.

A forward pre-hook refuses, inside a block, what would silently give wrong numbers (labels
shifted inside a shard, positions made inside the model, a padding mask) and fills in
``num_items_in_batch`` so the loss is the exact single-device mean over every rank's tokens.
Attention features SDPA cannot run (softcapping, a position bias) are refused; attention sinks (GPT-OSS) run
exactly under every strategy.
``cptune.hf.Trainer`` is transformers' Trainer with each training step in a block (``_trainer``).
:func:`causal_lm_loss` is the model's loss without the whole logits (:mod:`cptune.losses`): chunked, exact, the path
cptune's training scripts, the Trainer and the search take.
Verified with transformers 5.24 (``shift_labels`` and ``num_items_in_batch`` are taken by its
causal-LM loss since 4.46 / 4.50). transformers is optional: only this package's modules and ``cptune.models`` import it.
"""

from __future__ import annotations

from typing import Any

from ._check import CHECK_MODES, PROVEN_FILE, check, proven, proven_families
from ._enable import ATTN_IMPLEMENTATION, attention_forward, enable
from ._lm_loss import causal_lm_loss
from ._vision import position_ids, video_batch


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "takes_sharded_models", "trainer_problems"):  # imported when asked for (accelerate)
        from . import _trainer

        return getattr(_trainer, name)
    raise AttributeError(f"module 'cptune.hf' has no attribute {name!r}")


__all__ = ["ATTN_IMPLEMENTATION", "CHECK_MODES", "PROVEN_FILE", "Trainer", "attention_forward",  # noqa: F822
           "causal_lm_loss", "check", "enable", "position_ids", "proven", "proven_families",
           "takes_sharded_models", "trainer_problems", "video_batch"]  # (__getattr__'s)
