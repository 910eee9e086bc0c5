"""The pydantic description of what a search measures (one training step's attention shape), as recipes carry it."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from .config import StrictModel
from .errors import Problem, ProblemError

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

    def question(self) -> dict:
        """This workload as a study's question (its name's hash and the resume check)."""
        return self.model_dump(mode="json")

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
