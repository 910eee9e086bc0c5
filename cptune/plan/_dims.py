"""A model's dimensions, the step model's input: from a transformers config (the loader ``cptune search --model``
uses, else the JSON read directly), from dims given by hand, or from a search's workload."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from .._files import read_json_object
from ..config import StrictModel
from ..errors import Problem, ProblemError, ValidationError
from ..workload import Workload


class ModelDims(StrictModel):
    """A decoder-only transformer: ``layers`` blocks of attention (``heads`` query heads, ``kv_heads`` key/value
    heads of ``head_dim``) and a gated MLP of width ``ffn``, with a ``vocab``-wide embedding and head.
    ``attention_only``: the search's attention proxy (no projections, MLP or embedding). ``kv_expanded``: the
    model repeats its key/value heads to the query heads before attention (torchtitan's Llama, ``repeat_kv``), so
    attention and the ring carry and accumulate query-wide K and V; cptune's models and ``cptune.hf`` pass
    ``enable_gqa`` instead."""

    layers: int = Field(gt=0, json_schema_extra={"fix": "give --layers as a positive count"})
    hidden: int = Field(gt=0, json_schema_extra={"fix": "give the model width (hidden_size)"})
    heads: int = Field(gt=0, json_schema_extra={"fix": "give the query heads (num_attention_heads)"})
    kv_heads: int = Field(gt=0, json_schema_extra={"fix": "give the key/value heads (num_key_value_heads)"})
    head_dim: int = Field(gt=0, json_schema_extra={"fix": "give head_dim"})
    ffn: int = Field(0, ge=0, json_schema_extra={"fix": "give the MLP width (intermediate_size)"})
    vocab: int = Field(0, ge=0, json_schema_extra={"fix": "give vocab_size"})
    tied_embeddings: bool = False
    attention_only: bool = False
    kv_expanded: bool = False
    name: str = ""

    @model_validator(mode="after")
    def _heads(self) -> ModelDims:
        if self.heads % self.kv_heads:
            raise ProblemError(Problem("kv_heads", f"{self.kv_heads} does not divide heads ({self.heads})",
                                       "give a kv_heads that divides heads"))
        return self

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attended_kv_heads(self) -> int:
        """Key/value heads as attention receives them."""
        return self.heads if self.kv_expanded else self.kv_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one block: q, k, v, o projections, the gated MLP, two norms."""
        if self.attention_only:
            return 0
        h = self.hidden
        return h * (self.q_width + 2 * self.kv_width) + self.q_width * h + 3 * h * self.ffn + 2 * h

    @property
    def params(self) -> int:
        if self.attention_only:
            return 0
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embed + self.hidden

    def describe(self) -> str:
        if self.attention_only:
            return f"attention proxy: {self.layers} layer(s), {self.heads}/{self.kv_heads} heads x {self.head_dim}"
        return (f"{self.name or 'model'}: {self.params / 1e9:.2f}B parameters, {self.layers} layers, hidden "
                f"{self.hidden}, {self.heads}/{self.kv_heads} heads x {self.head_dim}, ffn {self.ffn}, "
                f"vocab {self.vocab}")


def dims_from_values(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                     argument: str = "dims") -> ModelDims:
    """A model's dims given by hand (``cptune plan --dims``); head_dim is hidden / heads, which must divide."""
    values = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads:
        raise ValidationError([Problem(argument, f"heads ({heads}) do not divide hidden ({hidden})",
                                       "give a hidden size that is a multiple of heads (head_dim = hidden / heads)")])
    try:
        return ModelDims(**values, head_dim=hidden // heads if isinstance(heads, int) and heads > 0 else 0,
                         name=argument)
    except ValidationError as exc:  # a field's problem, said as the argument's
        raise ValidationError([Problem(f"{argument}: {p.argument}", p.message, p.fix) for p in exc.problems]) from None


def _from_fields(data: Mapping[str, Any], name: str) -> ModelDims:
    text = data.get("text_config") or data
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    return ModelDims(layers=text["num_hidden_layers"], hidden=hidden, heads=heads,
                     kv_heads=text.get("num_key_value_heads") or heads,
                     head_dim=text.get("head_dim") or hidden // heads, ffn=text.get("intermediate_size") or 4 * hidden,
                     vocab=text.get("vocab_size") or 0, tied_embeddings=bool(text.get("tie_word_embeddings", False)),
                     name=name)


def dims_from_config(path: str | Path, overrides: Mapping[str, Any] | None = None,
                     argument: str = "model") -> ModelDims:
    """A model's dims from its local directory or config.json: through transformers' config when it is
    installed (the loader ``cptune search --model`` uses, so derived fields follow overrides), else the JSON."""
    from .. import models

    found = models.config_path(path, argument)
    name = found.parent.name if found.name == "config.json" else found.stem
    try:
        import transformers  # noqa: F401
    except ImportError:
        data = {**read_json_object(found, argument, "give a model's config.json as save_pretrained writes it"),
                **(overrides or {})}
    else:
        data = models.load_config(found, overrides, argument).to_dict()
    try:
        return _from_fields(data, name)
    except KeyError as exc:
        raise ValidationError([Problem(argument, f"{found} has no {exc.args[0]}", "use a decoder-only transformers "
                                       "config (num_hidden_layers, hidden_size, num_attention_heads)")]) from None


def dims_from_workload(workload: Workload) -> ModelDims:
    """What a search measures, as dims: its --model's config, else a Llama-style block of the workload's
    attention shape (a --workload step), or the attention-only proxy."""
    if workload.model is not None:
        return dims_from_config(workload.model, workload.model_overrides)
    width = workload.heads * workload.head_dim
    return ModelDims(layers=workload.layers, hidden=width, heads=workload.heads,
                     kv_heads=workload.kv_heads or workload.heads, head_dim=workload.head_dim,
                     ffn=4 * width if workload.step else 0, attention_only=workload.step is None,
                     name=workload.step or "proxy")
