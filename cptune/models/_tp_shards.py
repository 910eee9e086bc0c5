"""Tensor parallelism that keeps only its shards. Under sequence parallelism each split block all-gathers its input
over tp, and its column-parallel matmuls keep that whole input for backward: a tp rank's whole share of the tokens,
once per block. Megatron keeps the sequence shard and gathers it again in backward; so does this, with autograd's
saved-tensor hooks around each block (:func:`keep_shards`): a tensor saved for backward whose storage is a gathered
input is kept as the shard it was gathered from and all-gathered again when backward needs it (the same values:
exact). Only where nothing else handles saved tensors: not under activation checkpointing (its recompute gathers
again already) nor compile. Imports nothing of cptune's."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

_GATHERED: dict[int, tuple[Any, int]] = {}
"""A gathered input's storage (its address) -> (the shard DTensor it came from, its offset in that storage); an entry
leaves when the gathered tensor does, so no later tensor at that address is taken for it."""
_MARK = object()
stats = {"kept_as_shard": 0}
"""Saved tensors kept as shards since the process started (tests read it)."""


def applies(ac: str | None, compile: bool) -> bool:
    """Whether a unit trained with activation checkpointing ``ac`` and ``compile`` keeps its shards this way: not
    under AC (its recompute gathers again) nor compile (hooks and compile do not mix)."""
    return ac in (None, "none") and not compile


def remember(gathered: Any, shard: Any) -> None:
    """``gathered`` (a replicated DTensor) was all-gathered from ``shard`` (a DTensor split by sequence)."""
    local = gathered._local_tensor
    if not local.is_contiguous():
        return
    key = local.untyped_storage().data_ptr()
    _GATHERED[key] = (shard, local.storage_offset())
    weakref.finalize(local, _GATHERED.pop, key, None)


def _pack(t: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    local = t._local_tensor
    entry = _GATHERED.get(local.untyped_storage().data_ptr())
    if entry is None:
        return t
    shard, base = entry
    stats["kept_as_shard"] += 1
    return (_MARK, shard, shard._local_tensor._version, tuple(local.shape), local.stride(),
            local.storage_offset() - base, t.device_mesh, t.placements)


def _unpack(packed: Any) -> torch.Tensor:
    if not (isinstance(packed, tuple) and packed and packed[0] is _MARK):
        return packed
    from torch.distributed.tensor import DTensor, Replicate

    _, shard, version, shape, stride, offset, mesh, placements = packed
    if shard._local_tensor._version != version:
        raise RuntimeError("cptune: a block's input was modified in place after tensor parallelism kept it as its "
                           "shard for backward; do not modify a split block's input in place")
    with torch.no_grad():
        whole = shard.redistribute(mesh, [Replicate()] * mesh.ndim)._local_tensor.contiguous()
        return DTensor.from_local(whole.as_strided(shape, stride, offset), mesh, placements, run_check=False)


def keep_shards(block: nn.Module) -> None:
    """While ``block`` runs forward, the tensors it saves for backward that are its gathered input (or views of it)
    are kept as the shard they were gathered from (:func:`remember`) and gathered again in backward."""
    def enter(module, args, kwargs):
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        module.__dict__.setdefault("_cptune_saved_hooks", []).append(hooks)

    def leave(module, args, kwargs, output):
        module.__dict__["_cptune_saved_hooks"].pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    block.register_forward_hook(leave, with_kwargs=True, always_call=True)
