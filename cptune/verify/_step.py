"""``cptune.check``: the first-step check (:mod:`cptune.verify`) for a plain PyTorch model, whose code can read a
shard's shapes or positions as any transformers family's can. The user's step runs on short buffers of their own
twice, in a block of cp = 1 (the block's documents and window applied, as one process means them) and split as
configured; its output, the gradients of the buffers that require grad and of the model's parameters are compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import attention as A
from .._session import active
from ..context import config_for
from ..errors import CPTuneError, Problem, ValidationError, raise_if
from ..mesh import ParallelDims
from . import _report as R
from . import _runs

_FIX = ("train with cp=1, or make the step read positions and lengths from the block's buffers (every position a "
        "buffer: cptune's README, Semantics)")


def _weights(shape: list[int], device: torch.device) -> torch.Tensor:
    """The fixed random weights the check's loss puts on each output element (the same on every rank)."""
    gen = torch.Generator().manual_seed(4321)
    return torch.randn(shape, generator=gen).to(device)


def _run(step: Callable[..., torch.Tensor], config, mesh, buffers: dict[str, torch.Tensor], seq_dims: dict[str, int],
         out_dim: int, causal: bool, documents: Any, window: Any, weight: torch.Tensor | None
         ) -> tuple[torch.Tensor, float, torch.Tensor, Any]:
    """``step`` in a block of ``config``: (its output, whole along ``out_dim``; its loss as one process's; that loss's
    weights; the block)."""
    with _runs.opened(config, causal, mesh, buffers, documents, window, seq_dims) as block:
        shards = dict(zip(buffers, (block.shards[name] for name in block.plan.names)))
        out = step(**shards)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ValidationError([Problem("step", f"returned {type(out).__name__}", "return the step's output, a "
                                           "floating tensor with the sequence along out_dim")])
        whole_len = next(iter(buffers.values())).shape[next(iter(seq_dims.values()))]
        if weight is None:
            weight = _weights([*out.shape[:out_dim], whole_len, *out.shape[out_dim + 1:]], out.device)
        local = A.shard(weight, out_dim, block.layout, block.cp_rank) if block.cp > 1 else weight
        share = (out.float() * local).sum()
        (share * block.cp).backward()  # gradients are averaged over the cp ranks, as FSDP and DDP average them
        gathered = block.unshard(out, out_dim)
        share = share.detach().clone()
        if block.group is not None:
            dist.all_reduce(share, group=block.group)
    return gathered, share.item(), weight, block


def _measures(got: tuple, want: tuple) -> dict[str, float]:
    """(output, loss, buffers' gradients, parameters' gradients) of two runs: each measure's relative error."""
    inputs = [R.relative(got[2][k], t) for k, t in want[2].items() if t is not None and got[2][k] is not None]
    return {"outputs": R.relative(got[0], want[0]), "loss": abs(got[1] - want[1]) / max(abs(want[1]), 1e-12),
            "input gradient": max(inputs, default=0.0), **_runs.grad_errors(got[3], want[3])}


_LABELS = {"loss": "the loss", "outputs": "the step's output", "input gradient": "the buffers' gradients"}


def check(step: Callable[..., torch.Tensor], buffers: Mapping[str, torch.Tensor], seq_dims: int | Mapping[str, int] = 1,
          *, model: nn.Module | None = None, out_dim: int = 1, config: Any = None, recipe: Any = None,
          mesh: Any = None, causal: bool = True, documents: Any = None, window: Any = None) -> R.CheckReport:
    """Check a plain model's step under CP before training it: ``step(**shards)`` is run on ``buffers`` (whole
    tensors, short: a few hundred tokens) as one process (a block of cp = 1: its documents and window applied), again
    with every linear layer's rounding perturbed (what rounding alone moves each measure), and split as ``config``
    says; it returns the output (sequence along ``out_dim``). The output, the gradients of the buffers that require
    grad and of ``model``'s parameters are compared. Every rank calls it (a collective), outside any block. Returns
    the report, or raises a :class:`cptune.ValidationError` saying what differs by how much."""
    if active() is not None:
        raise ValidationError([Problem("check", "was called inside a cptune.context_parallel block",
                                       "call it before the block")])
    raise_if([Problem("buffers", "is empty", "give the step's sequence inputs by name")] if not buffers else [])
    dims_given = dict(seq_dims) if isinstance(seq_dims, Mapping) else dict.fromkeys(buffers, seq_dims)
    config = config_for(config, recipe)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.of_mesh(mesh)[0] if mesh is not None else config.parallel_dims(world)
    whole_config = config.model_copy(update={"mesh_shape": (dims.dp_replicate, dims.dp_shard * dims.cp, 1, dims.tp),
                                             "strategy": "ring", "ulysses_degree": None})
    subject = type(model).__name__ if model is not None else getattr(step, "__name__", "the step")
    layout = R.layout_label(config, dims, causal)
    elapsed = R.timed()
    params = model if model is not None else nn.Module()
    given = {k: v for k, v in buffers.items() if v.requires_grad}
    fsdp = any(isinstance(m, FSDPModule) for m in params.modules())

    def ran(config, mesh, weight):
        for t in given.values():
            t.grad = None
        out, loss, weight, block = _run(step, config, mesh, dict(buffers), dims_given, out_dim, causal, documents,
                                        window, weight)
        return (out, loss, {k: t.grad for k, t in given.items()}, _runs.take_grads(params)), weight, block

    with _runs.quiet(params):
        try:
            want, weight, _ = ran(whole_config, None, None)
            with _runs.perturbed([m for m in params.modules() if isinstance(m, nn.Linear)], want[0].dtype):
                noisy = ran(whole_config, None, weight)[0]
            try:
                got, _, block = ran(config, mesh, weight)
            except CPTuneError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's code failing on a shard, named
                raise R.raised_problem(exc, params, subject, layout, "step", _FIX) from None
            _runs.average_over(got[3], block.group, dims.cp, fsdp)
        finally:
            for t in given.values():
                t.grad = None
    dtype = want[0].dtype
    tokens = next(iter(buffers.values())).shape[next(iter(dims_given.values()))]
    report = R.CheckReport(subject, layout, tokens, documents is not None, str(dtype).replace("torch.", ""),
                           R.assess(_measures(got, want), _measures(noisy, want), dtype, _LABELS, []))
    report.seconds = elapsed()
    raise_if([] if report.passed else [report.problem("step", _FIX)])
    return report
