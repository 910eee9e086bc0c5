"""The pydantic description of what a search measures (one training step's attention shape), as recipes carry it."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from .attention import documents_from_lengths, lengths_from_spec
from .config import StrictModel
from .errors import Problem, ProblemError, ValidationError

# defaults the library, the CLI and the planner share: each written once
MEMORY_MARGIN = 0.05
"""A configuration fits when its worst measured peak x (1 + this margin) is within the budget (allocator
reserve, fragmentation)."""

BUDGET_FRACTION = 0.9
"""The memory budget when none is given: this share of one GPU's memory (or of RAM / local ranks on CPU),
for a search and a plan alike."""

TRIAL_TIMEOUT_S = 300.0
"""Seconds before a search's trial is taken for a hang."""


DType = Literal["float32", "bfloat16", "float16"]
AC_MODES = ("none", "selective", "full")
"""Activation checkpointing a search or a plan can try (``--ac auto`` tries each): the one list."""
AC = Literal[(*AC_MODES, "auto")]  # type: ignore[valid-type]
LOSS_MODES = ("chunked", "whole")
"""How a --model's step takes its loss (:attr:`Workload.loss`), the first the default: the one list."""


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
    ac: AC = Field("none", json_schema_extra={"fix": "use --ac none, full, selective or auto"})
    """Activation checkpointing per proxy layer: full, or selective (keeps the ring attention's output); ``auto``:
    a searched dimension (each trial runs one of none, selective, full)."""
    step: str | None = Field(None, json_schema_extra={
        "fix": "give --workload as 'module:function' naming an importable function"})
    """'module:function' building the user's step (see :func:`load_user_step`); None: the proxy."""
    documents: str | None = Field(None, json_schema_extra={
        "fix": "give --documents as a count of equal documents (16), 'longtail', or lengths adding up to --seq-len"})
    """Packed documents per sequence: ``'16'`` (16 equal ones), ``'longtail'`` (a fixed long-tailed mix: a few long
    documents, many short ones) or ``'1024,512,...'`` (lengths); None: one sequence, unpacked."""
    window: int | None = Field(None, ge=0, json_schema_extra={
        "fix": "give --window as how many earlier tokens each token attends to (4095 for sliding_window=4096)"})
    """A causal sliding window: each token attends to this many earlier tokens besides itself; None: no window."""
    model: str | None = Field(None, json_schema_extra={
        "fix": "give --model as a local model directory or its config.json"})
    """A transformers model (directory or config.json) whose training step is measured: built from its config
    with random weights, trained with FSDP2 over dp x cp and AdamW (see cptune.models); None: the proxy."""
    loss: Literal[LOSS_MODES] = Field(LOSS_MODES[0], json_schema_extra={  # type: ignore[valid-type]
        "fix": "use --loss chunked (the default) or whole"})
    """How a --model's step takes its loss: ``chunked`` (:func:`cptune.hf.causal_lm_loss`: never the whole logits,
    vocabulary-parallel under tp), or ``whole`` (the model's own ``.loss`` from the whole logits, for a step that
    needs them)."""
    video: str | None = Field(None, pattern=r"^[1-9]\d*,[1-9]\d*,[1-9]\d*$", json_schema_extra={
        "fix": "give --video as T,H,W: temporal patches, height and width in patches (a video_grid_thw row)"})
    """A --model vision-language model's video per sequence: ``'T,H,W'`` (its ``video_grid_thw`` row: temporal patches,
    height and width in patches), synthetic frames of that shape in each row among text (:func:`cptune.hf.video_batch`);
    None: text only."""
    model_overrides: dict[str, Any] | None = Field(None, json_schema_extra={
        "fix": "give --model-override as KEY=VALUE, e.g. num_hidden_layers=4"})
    """Config fields changed before the model is built (e.g. fewer layers for a quick probe)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> Workload:
        if self.kv_heads is not None and self.heads % self.kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ProblemError(Problem("kv_heads", f"{self.kv_heads} does not divide heads "
                                       f"({self.heads})", f"use a divisor of {self.heads}: "
                                       f"{', '.join(map(str, divisors))}, or leave it out for kv_heads = heads"))
        if self.step is not None and (":" not in self.step or self.step.count(":") != 1):
            raise ProblemError(Problem("step", f"{self.step!r} is not 'module:function'",
                                       "name an importable function, e.g. examples.train_llama_cp:search_step"))
        if self.documents is not None:
            try:
                lengths_from_spec(self.documents, self.seq_len)
            except ValidationError as exc:
                raise ProblemError(exc.problems[0]) from None
        if self.model is not None and self.step is not None:
            raise ProblemError(Problem("model", "is given with --workload", "measure one of them: "
                                       "--model for a transformers model, --workload for your own step"))
        if self.video is not None and (self.model is None or self.documents is not None):
            raise ProblemError(Problem("video", "is given " + ("without --model" if self.model is None else
                                       "with --documents"), "measure a video with --model (a vision-language "
                                       "model) and one sample a sequence (no --documents)"))
        if self.window is not None and not self.causal:
            raise ProblemError(Problem("window", "is set for non-causal attention",
                                       "use --causal with --window (cptune's searches model causal windows)"))
        return self

    _ADDED = ("documents", "window", "model", "model_overrides", "loss", "video")  # fields after 0.1.0's studies: left out at their default

    def question(self) -> dict:
        """This workload as a study's question (its name's hash and the resume check): fields added since
        studies were first named are left out at their defaults, so those studies still resume."""
        data = self.model_dump(mode="json")
        return {k: v for k, v in data.items() if k not in self._ADDED or v != type(self).model_fields[k].default}

    def document_ids(self) -> torch.Tensor | None:
        """(1, S) document ids of the packed sequence, or None when unpacked."""
        if self.documents is None:
            return None
        return documents_from_lengths(lengths_from_spec(self.documents, self.seq_len))

    @property
    def video_grid(self) -> tuple[int, int, int] | None:
        """The video's (T, H, W), or None."""
        return None if self.video is None else tuple(int(x) for x in self.video.split(","))

    @property
    def window_pair(self) -> tuple[int, int] | None:
        """The window as ``context_parallel(window=...)`` takes it."""
        return None if self.window is None else (self.window, 0)

    @property
    def predictable(self) -> bool:
        """Whether the analytic memory model covers this step (the plain proxy: no user step, AC, compile,
        documents or window)."""
        return self.step is None and self.model is None and self.ac == "none" and not self.compile \
            and self.documents is None and self.window is None

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
        base += f" docs={self.documents}" if self.documents else ""
        base += f" window={self.window}" if self.window is not None else ""
        if self.model:
            changed = ",".join(f"{k}={v}" for k, v in (self.model_overrides or {}).items())
            base += f" model={self.model}" + (f" ({changed})" if changed else "")
            base += f" video={self.video}" if self.video else ""
            base += " loss=whole" if self.loss == "whole" else ""
        return base + (f" step={self.step}" if self.step else "")
