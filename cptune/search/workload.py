"""What the search measures: the attention-only proxy step, or the user's own step function."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from ..config import StrictModel
from ..errors import CPTuneError, Problem, ProblemError, ValidationError

DType = Literal["float32", "bfloat16", "float16"]
AC = Literal["none", "full", "selective"]


class Workload(StrictModel):
    """One training step's attention shape, per data-parallel replica."""

    seq_len: int = Field(8192, gt=0, json_schema_extra={"fix": "give --seq-len as a positive token count"})
    batch: int = Field(1, gt=0, json_schema_extra={"fix": "give --batch as a positive count per replica"})
    heads: int = Field(8, gt=0, json_schema_extra={"fix": "give --heads as a positive count"})
    kv_heads: int | None = Field(None, gt=0, json_schema_extra={
        "fix": "give --kv-heads dividing --heads, or leave it out for kv_heads = heads"})
    head_dim: int = Field(64, gt=0, json_schema_extra={"fix": "give --head-dim as a positive size"})
    dtype: DType = Field("float32", json_schema_extra={"fix": "use --dtype float32, bfloat16 or float16"})
    causal: bool = True
    layers: int = Field(1, gt=0, json_schema_extra={"fix": "give --layers as a positive count"})
    """Attention layers in the proxy step; each keeps its activations for backward, as a model's do."""
    compile: bool = False
    """torch.compile each proxy layer (compile time is measured apart from the step time)."""
    ac: AC = Field("none", json_schema_extra={"fix": "use --ac none, full or selective"})
    """Activation checkpointing per proxy layer: full, or selective (keeps the ring attention's output)."""
    step: str | None = Field(None, json_schema_extra={
        "fix": "give --workload as 'module:function' naming an importable function"})
    """'module:function' building the user's step (see :func:`load_user_step`); None: the proxy."""

    @model_validator(mode="after")
    def _heads_divide(self) -> Workload:
        if self.kv_heads is not None and self.heads % self.kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ProblemError(Problem("kv_heads (--kv-heads)", f"{self.kv_heads} does not divide heads "
                                       f"({self.heads})", f"use a divisor of {self.heads}: "
                                       f"{', '.join(map(str, divisors))}, or leave it out for kv_heads = heads"))
        if self.step is not None and (":" not in self.step or self.step.count(":") != 1):
            raise ProblemError(Problem("step (--workload)", f"{self.step!r} is not 'module:function'",
                                       "name an importable function, e.g. examples.train_llama_cp:search_step"))
        return self

    @property
    def predictable(self) -> bool:
        """Whether the analytic memory model covers this step (the plain proxy: no user step, AC or compile)."""
        return self.step is None and self.ac == "none" and not self.compile

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def describe(self) -> str:
        kind = "causal" if self.causal else "non-causal"
        gqa = f"/{self.kv_heads}kv" if self.kv_heads and self.kv_heads != self.heads else ""
        layers = f" L={self.layers}" if self.layers != 1 else ""
        base = f"S={self.seq_len} B={self.batch} H={self.heads}{gqa} D={self.head_dim}{layers} {self.dtype} {kind}"
        base += " compiled" if self.compile else ""
        base += f" ac={self.ac}" if self.ac != "none" else ""
        return base + (f" step={self.step}" if self.step else "")


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
    from torch.utils.checkpoint import CheckpointPolicy

    from .._torch_cp import RING_ATTENTION_OPS
    from .._ulysses import ULYSSES_OPS

    keep = op in RING_ATTENTION_OPS or op in ULYSSES_OPS  # never recompute communication
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(layer: Callable, selective: bool, h: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

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
        raise ValidationError([Problem("--workload", f"cannot import {module_name!r}: {exc}",
                                       "make the module importable (run from its folder or install it)")]) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValidationError([Problem("--workload", f"{module_name} has no function {attr!r}",
                                       f"name a function defined in {module_name}")])
    return fn


def build_user_step(workload: Workload, device: torch.device):
    made = load_user_step(workload.step)(workload, device)
    if not (isinstance(made, tuple) and len(made) == 3 and callable(made[0])):
        raise CPTuneError(f"{workload.step} must return (step, buffers, seq_dims); got {type(made).__name__}")
    return made
