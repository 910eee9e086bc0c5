"""A model's dimensions, the step model's input: from a transformers config (the loader ``cptune search --model``
uses, else the JSON read directly), from dims given by hand, or from a search's workload."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from .._files import read_json_object
from ..config import StrictModel
from ..errors import Problem, ProblemError, ValidationError
from ..workload import Workload
from ._tower import TowerDims, tower_from_fields
from ._experts import ExpertDims, LatentDims, attention_params, dense_width, experts_from_fields, \
    latent_from_fields


class MixerDims(StrictModel):
    """A hybrid's layers that mix tokens outside softmax attention, as the step model prices them (read from the
    config by :func:`mixer_from_fields`). Widths are per token over all the layer's heads."""

    kind: Literal["gated_deltanet", "mamba2", "short_conv"]
    layers: int = Field(gt=0)
    """How many of the model's layers are this kind (the rest are softmax attention)."""
    heads: int = Field(0, ge=0)
    """What the heads path divides over cp (a Gated DeltaNet's key heads, Mamba2's heads); 0: a short convolution
    (the halo path: any cp)."""
    width: int = Field(gt=0)
    """What the in-projections make per token."""
    exchanged: int = Field(0, ge=0)
    """What the heads path's all-to-alls carry per token, in and out (the recurrence's inputs and its output)."""
    gathered: int = Field(0, ge=0)
    """What the heads path gathers whole on every rank per token (Mamba2's B and C, one per group of heads)."""
    key_width: int = Field(0, ge=0)
    value_width: int = Field(0, ge=0)
    state: int = Field(0, ge=0)
    """The recurrent state's elements over all heads (0: none, a convolution)."""
    chunk: int = Field(64, gt=0)
    """The chunked kernel's chunk length."""
    params: int = Field(gt=0)
    """One such layer's parameters, in place of attention's q, k, v and o."""

    def fits(self, cp: int) -> bool:
        """Whether the split path runs these layers under ``cp`` ranks (:func:`cptune.mixers._choice.path`'s rule)."""
        return self.heads == 0 or self.heads % cp == 0


def mixer_from_fields(text: Mapping[str, Any]) -> MixerDims | None:
    """The mixer layers a transformers config states: Gated DeltaNet (``linear_num_key_heads``; Qwen3.5, Qwen3-Next),
    Mamba2 (``mamba_n_heads``; Bamba, Granite 4, Nemotron-H, Falcon-H1) and LFM2's short convolutions
    (``conv_L_cache``), counted from ``layer_types`` (or, for Bamba, ``attn_layer_indices``)."""
    h, layers = text["hidden_size"], int(text["num_hidden_layers"])
    kinds = [str(k).lower() for k in (text.get("layer_types") or text.get("layers_block_type") or [])]

    def count(*names: str) -> int:
        if kinds:
            return sum(k in names for k in kinds)
        return layers - len(text.get("attn_layer_indices") or [])

    if text.get("linear_num_key_heads"):
        nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
        dk, dv, k = text["linear_key_head_dim"], text["linear_value_head_dim"], text.get("linear_conv_kernel_dim", 4)
        conv = 2 * nk * dk + nv * dv
        return MixerDims(kind="gated_deltanet", layers=count("linear_attention"), heads=nk,
                         width=conv + nv * dv + 2 * nv, exchanged=conv + 2 * nv + nv * dv, key_width=nv * dk,
                         value_width=nv * dv, state=nv * dk * dv, chunk=64,
                         params=h * (conv + nv * dv + 2 * nv) + conv * k + nv * dv * h + 2 * nv + dv)
    if text.get("mamba_n_heads"):
        heads, dh, n = text["mamba_n_heads"], text["mamba_d_head"], text["mamba_d_state"]
        inner = int(text.get("mamba_d_ssm") or text.get("mamba_expand", 2) * h)
        bc, k = 2 * text.get("mamba_n_groups", 1) * n, text.get("mamba_d_conv", 4)
        return MixerDims(kind="mamba2", layers=count("mamba", "m"), heads=heads, width=2 * inner + bc + heads,
                         exchanged=2 * inner + heads, gathered=bc, key_width=heads * n, value_width=inner, state=heads * dh * n,
                         chunk=int(text.get("mamba_chunk_size", 256)),
                         params=h * (2 * inner + bc + heads) + (inner + bc) * k + inner * h + 3 * heads + inner)
    if text.get("conv_L_cache") and "conv" in kinds:
        return MixerDims(kind="short_conv", layers=count("conv"), width=3 * h, params=4 * h * h + h * text["conv_L_cache"])
    return None


class ModelDims(StrictModel):
    """A decoder-only transformer: ``layers`` blocks of attention (``heads`` query heads, ``kv_heads`` key/value
    heads of ``head_dim``, values ``v_head_dim`` wide) and a gated MLP of width ``ffn``, with a ``vocab``-wide
    embedding and head; a mixture of experts in place of the MLP in ``experts.layers`` of them. ``attention_only``:
    the search's attention proxy (no projections, MLP or embedding). ``kv_expanded``: the model repeats its key/value
    heads to the query heads before attention (torchtitan's Llama, ``repeat_kv``), so attention and the ring carry and
    accumulate query-wide K and V; cptune's models and ``cptune.hf`` pass ``enable_gqa`` instead."""

    layers: int = Field(gt=0, json_schema_extra={"fix": "give --layers as a positive count"})
    hidden: int = Field(gt=0, json_schema_extra={"fix": "give the model width (hidden_size)"})
    heads: int = Field(gt=0, json_schema_extra={"fix": "give the query heads (num_attention_heads)"})
    kv_heads: int = Field(gt=0, json_schema_extra={"fix": "give the key/value heads (num_key_value_heads)"})
    head_dim: int = Field(gt=0, json_schema_extra={"fix": "give head_dim"})
    """A query's and a key's width per head (MLA's: qk_nope_head_dim + qk_rope_head_dim)."""
    v_head_dim: int = Field(0, ge=0)
    """A value's width per head (0: head_dim; MLA's v_head_dim)."""
    ffn: int = Field(0, ge=0, json_schema_extra={"fix": "give the MLP width (intermediate_size)"})
    """The dense MLP's width (an MoE model's dense layers')."""
    vocab: int = Field(0, ge=0, json_schema_extra={"fix": "give vocab_size"})
    tied_embeddings: bool = False
    attention_only: bool = False
    kv_expanded: bool = False
    attention_params: int = Field(0, ge=0)
    """One layer's attention parameters as the config builds them (projections, biases, q/k norms, MLA's low-rank
    projections and norms; :func:`cptune.plan._experts.attention_params`); 0: q, k, v and o of the widths."""
    mixer: MixerDims | None = None
    """A hybrid's layers that mix tokens outside attention (None: every layer is softmax attention)."""
    experts: ExpertDims | None = None
    """A mixture of experts' layers (None: a dense MLP in every layer)."""
    latent: LatentDims | None = None
    """Multi-head latent attention's ranks (None: q, k, v projections)."""
    tower: TowerDims | None = None
    """A vision-language model's vision tower (None: text only)."""
    name: str = ""

    @model_validator(mode="after")
    def _heads(self) -> ModelDims:
        if self.heads % self.kv_heads:
            raise ProblemError(Problem("kv_heads", f"{self.kv_heads} does not divide heads ({self.heads})",
                                       "give a kv_heads that divides heads"))
        return self

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """K's width (V's is ``v_width``)."""
        return self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.value_dim

    @property
    def attended_kv_heads(self) -> int:
        """Key/value heads as attention receives them."""
        return self.heads if self.kv_expanded else self.kv_heads

    @property
    def attention_layer_params(self) -> int:
        """One layer's attention parameters."""
        if self.attention_only:
            return 0
        return self.attention_params or (self.hidden * (self.q_width + self.kv_width + self.v_width)
                                          + self.heads * self.value_dim * self.hidden)

    @property
    def layer_params(self) -> int:
        """Parameters of one dense block: attention, the gated MLP, two norms."""
        if self.attention_only:
            return 0
        return self.attention_layer_params + 3 * self.hidden * self.ffn + 2 * self.hidden

    def _layers_with(self, moe_params: int) -> int:
        if self.mixer is not None:
            attention = self.attention_layer_params
            mixed = self.layers * self.layer_params + self.mixer.layers * (self.mixer.params - attention)
        else:
            mixed = self.layers * self.layer_params
        if self.experts is None:
            return mixed
        return mixed + self.experts.layers * (moe_params - 3 * self.hidden * self.ffn)

    @property
    def all_layer_params(self) -> int:
        """Every block's parameters: a hybrid's mixer layers have theirs in place of attention's projections, an MoE
        layer every expert, its router and its shared experts in place of the dense MLP."""
        return self._layers_with(self.experts.params if self.experts else 0)

    @property
    def active_layer_params(self) -> int:
        """The blocks' parameters a token goes through (an MoE layer's: its top-k experts, the router, the shared
        experts): what the FLOPs count."""
        return self._layers_with(self.experts.active_params if self.experts else 0)

    @property
    def unit_params(self) -> float:
        """A decoder layer's parameters as FSDP2 gathers it (a unit a layer): an MoE model's largest layer (an MoE
        layer, every expert in it), else the mean of the layers."""
        if self.experts is None or self.attention_only:
            return self.all_layer_params / self.layers
        return self.layer_params + self.experts.params - 3 * self.hidden * self.ffn

    @property
    def params(self) -> int:
        if self.attention_only:
            return 0
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.all_layer_params + embed + self.hidden + (self.tower.params if self.tower else 0)

    @property
    def active_params(self) -> int:
        """The parameters a token goes through: :attr:`params` with an MoE layer's top-k experts only."""
        return self.params - self.all_layer_params + self.active_layer_params

    def describe(self) -> str:
        if self.attention_only:
            return f"attention proxy: {self.layers} layer(s), {self.heads}/{self.kv_heads} heads x {self.head_dim}"
        moe = self.experts
        total = f"{self.params / 1e9:.2f}B parameters" + (
            f" ({self.active_params / 1e9:.2f}B active: {moe.describe()})" if moe else "")
        heads = f"{self.heads}/{self.kv_heads} heads x {self.head_dim}" + (
            f"/{self.value_dim}" if self.value_dim != self.head_dim else "")
        mlp = f"ffn {self.ffn}" if moe is None else (
            (f"ffn {self.ffn} in {self.layers - moe.layers} dense layer(s), " if moe.layers < self.layers else "")
            + f"experts {moe.experts} x {moe.width}" + (f", shared {moe.shared_width}" if moe.shared_width else ""))
        return (f"{self.name or 'model'}: {total}, {self.layers} layers, hidden {self.hidden}, {heads}"
                + (f" {self.latent.describe()}" if self.latent else "") + f", {mlp}, vocab {self.vocab}"
                + (f", {self.mixer.layers} of the layers {self.mixer.kind}" if self.mixer else "")
                + (f"; a vision tower of {self.tower.params / 1e9:.2f}B ({self.tower.depth} blocks x "
                   f"{self.tower.width})" if self.tower else ""))


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
    model_type = str(text.get("model_type") or data.get("model_type") or "")
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or hidden // heads
    v_head_dim = text.get("v_head_dim") or head_dim
    latent = latent_from_fields(text)
    if latent is not None:  # kv_b_proj makes every head's key and value; q and k are nope + rope wide
        kv_heads, head_dim, v_head_dim = heads, latent.nope + latent.rope, latent.v_head_dim
    experts = experts_from_fields(text, model_type)
    return ModelDims(layers=text["num_hidden_layers"], hidden=hidden, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, v_head_dim=v_head_dim if v_head_dim != head_dim else 0,
                     ffn=dense_width(text), vocab=text.get("vocab_size") or 0,
                     tied_embeddings=bool(text.get("tie_word_embeddings", False)),
                     attention_params=attention_params(text, model_type, heads, kv_heads, head_dim, v_head_dim, latent),
                     mixer=mixer_from_fields(text), experts=experts, latent=latent, tower=tower_from_fields(data),
                     name=name)


def dims_from_config(path: str | Path, overrides: Mapping[str, Any] | None = None,
                     argument: str = "model") -> ModelDims:
    """A model's dims from its local directory or config.json: through transformers' config when it is
    installed and knows the model (the loader ``cptune search --model`` uses, so derived fields follow overrides),
    else the JSON; a mixture of experts and MLA read by :mod:`cptune.plan._experts` either way. Nothing is built."""
    from .. import models

    found = models.config_path(path, argument)
    name = found.parent.name if found.name == "config.json" else found.stem
    raw = read_json_object(found, argument, "give a model's config.json as save_pretrained writes it")
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is None or raw.get("model_type") not in transformers.CONFIG_MAPPING:  # planned from the JSON
        data = {**raw, **(overrides or {})}
    else:
        data = models.load_config(found, overrides, argument).to_dict()
    try:
        return _from_fields(data, name)
    except KeyError as exc:
        raise ValidationError([Problem(argument, f"{found} has no {exc.args[0]}", "use a decoder-only transformers "
                                       "config (num_hidden_layers, hidden_size, num_attention_heads)")]) from None
    except ValidationError:
        raise
    except (TypeError, ValueError) as exc:  # a count that is not a number, a list where a count goes
        raise ValidationError([Problem(argument, f"{found}: a field is not of its type ({exc})", "give each field a "
                                       "value of its type, as in the model's config.json")]) from None


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
