"""The steps a search measures: the attention-only proxy step, or the user's own step function."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import models
from ..config import CPConfig
from ..hf import causal_lm_loss, check, enable, proven, video_batch
from ..attention import RING_ATTENTION_OPS, ULYSSES_OPS
from ..losses import packed_labels_and_positions
from ..mesh import model_mesh, world_mesh
from ..mesh import ParallelDims
from ..errors import CPTuneError, Problem, ValidationError
from ..workload import Workload

StepFn = Callable[..., object]


class ProxyStep:
    """``layers`` residual self-attention layers, forward + backward, on this rank's (B, H, S/cp, D) shard.

    Each layer computes ``h = h + SDPA(h, h', h')`` (``h'``: the first kv_heads heads, for
    GQA), so what a layer keeps for backward grows with its share of the sequence, like a
    model's activations, while the ring's buffers live one layer at a time. Inputs are made
    at their local size (each rank holds only its part of the sequence, as in training where
    activations come from sharded token ids), so measured memory is what CP really uses.
    """

    def __init__(self, workload: Workload, device: torch.device, cp: int) -> None:
        w = workload
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (w.batch, w.heads, w.seq_len // cp, w.head_dim)
        self.x = torch.randn(shape, device=device, generator=gen).to(w.torch_dtype).requires_grad_()
        self.grad = torch.randn(shape, device=device, generator=gen).to(w.torch_dtype)
        self.kv_heads = w.kv_heads or w.heads
        self.causal, self.layers, self.gqa = w.causal, w.layers, self.kv_heads != w.heads
        layer = self.layer
        if w.ac != "none":
            layer = functools.partial(_checkpointed, self.layer, w.ac == "selective")
        self.run_layer = torch.compile(layer) if w.compile else layer

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        kv = h[:, : self.kv_heads].contiguous() if self.gqa else h
        return h + F.scaled_dot_product_attention(h, kv, kv, is_causal=self.causal, enable_gqa=self.gqa)

    def __call__(self) -> None:
        self.x.grad = None
        h = self.x
        for _ in range(self.layers):
            h = self.run_layer(h)
        h.backward(self.grad)


def _keep_ring(ctx, op, *args, **kwargs):
    keep = op in RING_ATTENTION_OPS or op in ULYSSES_OPS  # never recompute communication
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(layer: Callable, selective: bool, h: torch.Tensor) -> torch.Tensor:
    if selective:
        return checkpoint(layer, h, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_ring))
    return checkpoint(layer, h, use_reentrant=False)


def load_user_step(spec: str) -> Callable[[Workload, torch.device], tuple[StepFn, Sequence[torch.Tensor], Sequence[int]]]:
    """Import 'module:function'. The function takes (workload, device), builds its model once and
    returns (step, buffers, seq_dims): ``step(*buffers)`` runs one forward + backward on the
    buffers cptune has sharded (e.g. input_ids, labels), and ``seq_dims`` gives their sequence dims."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValidationError([Problem("step", f"cannot import {module_name!r}: {exc}",
                                       "make the module importable (run from its folder or install it)")]) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValidationError([Problem("step", f"{module_name} has no function {attr!r}",
                                       f"name a function defined in {module_name}")])
    return fn


def build_user_step(workload: Workload, device: torch.device):
    made = load_user_step(workload.step)(workload, device)
    if not (isinstance(made, tuple) and len(made) == 3 and callable(made[0])):
        raise CPTuneError(f"{workload.step} must return (step, buffers, seq_dims); got {type(made).__name__}")
    return made


def build_model_step(workload: Workload, device: torch.device, dims: ParallelDims | None = None):
    """A transformers model's training step, as it trains (see :mod:`cptune.models`): built on the meta device
    and materialized one FSDP2-sharded unit at a time over all ranks (no rank holds the whole model), random
    weights the same at any world size, and an AdamW step after backward, so the peak holds parameters,
    gradients and optimizer state; synthetic tokens, packed as ``documents`` says. ``dims``: the trial's mesh; with tp
    or dp_replicate the model is split by its own TP plan over the model mesh (:meth:`ParallelDims.model_mesh`); its
    ``ep``: the experts split over groups of that many ranks (:mod:`cptune.experts`)."""
    config = models.load_config(workload.model, workload.model_overrides)
    mesh = world_mesh(device.type) if dist.is_initialized() and dist.get_world_size() > 1 else None
    if dims is not None and not dims.is_dp_cp:
        mesh = model_mesh(dims, device.type)
    model = models.build_model(config, device, fsdp_mesh=mesh, ac=workload.ac, compile=workload.compile,
                               dtype=workload.torch_dtype, ep=dims.ep if dims is not None else 1)
    enable(model, check="never")  # the search checked it once, up front (:func:`check_model`): none in a trial
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    video: dict[str, torch.Tensor] = {}
    if workload.video_grid is not None:  # a vision-language model: one video a row, its pixels whole on every rank
        input_ids, labels, positions, video = video_batch(model, workload.seq_len, workload.batch, workload.video_grid)
        video = {k: v.to(device) for k, v in video.items()}
    else:
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, config.get_text_config().vocab_size, (workload.batch, workload.seq_len),
                                  generator=gen)
        labels, positions = packed_labels_and_positions(input_ids, workload.document_ids())

    def step(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> None:
        causal_lm_loss(model, input_ids, labels, position_ids=position_ids,  # as train_hf trains it
                       whole=workload.loss == "whole", **video).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, [t.to(device) for t in (input_ids, labels, positions)], [1, 1, positions.ndim - 1]


def check_model(workload: Workload, device: torch.device):
    """The first-step check of ``workload``'s model (:func:`cptune.hf.check`) on these ranks, split over all of them
    by the ring: once, before the search measures anything. Its report line, or None for a family the support
    matrix has proven; a refusal is a :class:`cptune.ValidationError`."""
    world, config = dist.get_world_size(), models.load_config(workload.model, workload.model_overrides)
    if proven(config):  # nothing to check: not even built
        return None
    model = models.build_model(config, device, fsdp_mesh=world_mesh(device.type), ac=workload.ac,
                               compile=workload.compile, dtype=workload.torch_dtype)
    report = check(model, config=CPConfig(mesh_shape=(1, world)), packed=workload.documents is not None,
                   seq_len=workload.seq_len)
    return None if report is None else report.line()
