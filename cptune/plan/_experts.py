"""What a config states beyond a Llama block, read from its fields as transformers' families name them: a mixture of
experts' MLP layers (:class:`ExpertDims`), multi-head latent attention (:class:`LatentDims`, DeepSeek-V2/V3's MLA)
and one layer's attention parameters (:func:`attention_params`: its projections and their biases, q/k norms, sinks).
Pure reading of a dict (a config.json, or transformers' ``to_dict()``): no transformers, nothing allocated.

Field names per family (transformers' configuration classes):

* routed experts: ``num_experts`` (Qwen2/3-MoE, OLMoE), ``num_local_experts`` (Mixtral, GPT-OSS, Granite-MoE),
  ``n_routed_experts`` (DeepSeek, GLM-4.5, dots1), ``moe_num_experts`` (ERNIE 4.5);
* experts per token: ``num_experts_per_tok``, ``num_experts_per_token``, ``moe_k`` (ERNIE), ``moe_topk`` (Hunyuan);
* an expert's width: ``moe_intermediate_size`` where the config has it, else ``intermediate_size`` (Mixtral, GPT-OSS,
  OLMoE, Granite-MoE, Llama 4);
* shared experts: ``n_shared_experts`` / ``num_shared_experts`` / ``moe_num_shared_experts`` of the experts' width
  (DeepSeek, GLM), ``shared_expert_intermediate_size`` (Qwen2-MoE, Qwen3-Next: with a one-output gate),
  ``shared_intermediate_size`` (Granite-MoE-shared), Llama 4's one of ``intermediate_size``;
* which layers are MoE: ``mlp_layer_types`` ('dense' or not), ``moe_layers`` / ``interleave_moe_layer_step``
  (Llama 4), ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen2/3-MoE), ``first_k_dense_replace`` with
  ``moe_layer_freq`` (DeepSeek, GLM), ``num_dense_layers``, ``expert_layer_period`` / ``expert_layer_offset`` (Jamba),
  ``moe_layer_start_index`` / ``moe_layer_end_index`` / ``moe_layer_interval`` (ERNIE); the dense layers' MLP is
  ``intermediate_size_mlp`` (Llama 4) or ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ..config import StrictModel

_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk")
_SHARED_COUNT = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")

_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "qwen3_next": "head", "dots1": "head", "exaone_moe": "head",
            "hunyuan_v1_moe": "head", "glm4_moe": "head", "sarvam_moe": "head",
            "olmoe": "width", "olmo2": "width", "olmo3": "width", "flex_olmo": "width", "minimax_m2": "width"}
"""Families whose attention normalizes q and k with weights: over each head ('head', Qwen3's) or over the whole
projection ('width', OLMo's). GLM-4.5 and Sarvam only under ``use_qk_norm``."""
_QKV_BIAS = {"qwen2"}
"""Families whose q, k and v projections always have biases (Qwen2-MoE says so in ``qkv_bias``)."""
_NO_O_BIAS = {"glm4_moe", "solar_open", "qwen2_moe", "qwen2", "dots1"}
"""Families whose ``attention_bias`` gives q, k and v biases and leaves o_proj's out."""
_EXPERT_BIAS = {"gpt_oss"}
"""Families whose experts and router carry biases (GPT-OSS: gate_up and down biases per expert, the router's)."""
_GATED_SHARED = {"qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_omni_moe"}
"""Families whose shared expert is scaled by a gate of its own (a hidden x 1 projection)."""


def fewer_experts(text: Mapping[str, Any], most: int = 8) -> dict[str, int]:
    """Overrides that build ``text``'s model with at most ``most`` routed experts a layer (no fewer than a token goes
    through): the same modules and layers, for the rules that read only them (a DeepSeek-V3's 256 experts a layer are
    15,000 modules on transformers 4.x, half a minute to make even on the meta device)."""
    k = first(text, _PER_TOKEN) or 1
    return {name: max(most, int(k)) for name in _EXPERTS
            if isinstance(text.get(name), int) and not isinstance(text.get(name), bool) and text[name] > max(most, k)}


def first(text: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    """The first of ``names`` that ``text`` holds with a value (None: none)."""
    return next((text[n] for n in names if text.get(n) is not None), None)


class ExpertDims(StrictModel):
    """A mixture of experts' MLP layers as the step model prices them: every expert's parameters for memory (the
    parameters, their gradients and optimizer state, the FSDP unit gathered whole: all of a layer's experts, or E / ep
    under expert parallelism, :class:`EpTerms`), those a token goes through for FLOPs (``active`` routed experts, the
    shared ones, the router)."""

    experts: int = Field(gt=0)
    """Routed experts in an MoE layer."""
    active: int = Field(gt=0)
    """Routed experts each token goes through (top-k)."""
    width: int = Field(gt=0)
    """One expert's intermediate width (a gated MLP: gate, up and down)."""
    shared: int = Field(0, ge=0)
    """Shared experts every token goes through (counted as ``shared_width``)."""
    shared_width: int = Field(0, ge=0)
    """The shared experts' intermediate width, together (0: none)."""
    layers: int = Field(gt=0)
    """How many of the model's layers are MoE (the rest have the dense MLP of ``ModelDims.ffn``)."""
    params: int = Field(gt=0)
    """One MoE layer's MLP parameters: every routed expert, the router, the shared experts."""
    active_params: int = Field(gt=0)
    """Those of one MoE layer a token goes through: ``active`` routed experts, the router, the shared experts."""
    routed: int = Field(0, ge=0)
    """One MoE layer's routed experts' parameters: what expert parallelism splits (0: not read)."""

    @property
    def active_width(self) -> int:
        """The intermediate width a token goes through in an MoE layer: its routed experts' and the shared ones'."""
        return self.active * self.width + self.shared_width

    def describe(self) -> str:
        shared = f" + {self.shared} shared" if self.shared else (" + a shared one" if self.shared_width else "")
        return f"{self.active} of {self.experts} experts{shared}"


class LatentDims(StrictModel):
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi): q through a rank-``q_rank`` projection (0: one
    q_proj), K and V from one rank-``kv_rank`` projection (with a shared rotary key of ``rope``), each head's q and k
    ``nope + rope`` wide and its v ``v_head_dim``."""

    q_rank: int = Field(0, ge=0)
    kv_rank: int = Field(gt=0)
    nope: int = Field(ge=0)
    rope: int = Field(ge=0)
    v_head_dim: int = Field(gt=0)

    @property
    def kept(self) -> int:
        """What its low-rank projections add per token to what a layer keeps for backward (elements): the compressed q
        and kv, each before and after their norm."""
        return 2 * self.q_rank + 2 * (self.kv_rank + self.rope)

    def describe(self) -> str:
        return f"MLA (q rank {self.q_rank or 'none'}, kv rank {self.kv_rank})"


def latent_from_fields(text: Mapping[str, Any]) -> LatentDims | None:
    """MLA's ranks and head dims, where the config has ``kv_lora_rank``."""
    if not text.get("kv_lora_rank"):
        return None
    return LatentDims(q_rank=text.get("q_lora_rank") or 0, kv_rank=text["kv_lora_rank"],
                      nope=text.get("qk_nope_head_dim") or 0, rope=text.get("qk_rope_head_dim") or 0,
                      v_head_dim=text["v_head_dim"])


def attention_params(text: Mapping[str, Any], model_type: str, heads: int, kv_heads: int, head_dim: int,
                     v_head_dim: int, latent: LatentDims | None) -> int:
    """One layer's attention parameters: its projections (MLA's by their real shapes: q_a and q_b, or q_proj;
    kv_a_proj_with_mqa, kv_b, o_proj, the two lora norms), their biases, q/k norms, GPT-OSS's sinks."""
    h = text["hidden_size"]
    bias = bool(text.get("attention_bias"))
    if latent is not None:
        q = heads * (latent.nope + latent.rope)
        q_params = h * q if not latent.q_rank else h * latent.q_rank + bias * latent.q_rank + latent.q_rank \
            + latent.q_rank * q
        kv = h * (latent.kv_rank + latent.rope) + bias * (latent.kv_rank + latent.rope) + latent.kv_rank \
            + latent.kv_rank * heads * (latent.nope + latent.v_head_dim)
        return q_params + kv + heads * latent.v_head_dim * h + bias * h
    q, k, v = heads * head_dim, kv_heads * head_dim, kv_heads * v_head_dim
    params = h * (q + k + v) + heads * v_head_dim * h
    qkv_bias = text.get("qkv_bias", model_type in _QKV_BIAS or bias)
    params += (q + k + v) * bool(qkv_bias) + h * (bias and model_type not in _NO_O_BIAS)
    norm = _QK_NORM.get(model_type)
    if norm and (model_type not in ("glm4_moe", "sarvam_moe") or text.get("use_qk_norm")):
        params += 2 * head_dim if norm == "head" else q + k
    if model_type == "gpt_oss":  # a learned sink logit a head
        params += heads
    return params


def moe_layer_flags(text: Mapping[str, Any], experts: int) -> list[bool]:
    """Which of the config's layers are MoE, by its family's rule (the module docstring's list)."""
    n = int(text["num_hidden_layers"])
    if isinstance(text.get("mlp_layer_types"), list):
        return [str(kind).lower() != "dense" for kind in text["mlp_layer_types"]][:n]
    if isinstance(text.get("moe_layers"), list):
        return [i in text["moe_layers"] for i in range(n)]
    if text.get("interleave_moe_layer_step"):
        step = int(text["interleave_moe_layer_step"])
        return [(i + 1) % step == 0 for i in range(n)]
    if "mlp_only_layers" in text or "decoder_sparse_step" in text:
        only, step = text.get("mlp_only_layers") or [], int(text.get("decoder_sparse_step") or 1)
        return [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(n)]
    if text.get("first_k_dense_replace") is not None:
        k, freq = int(text["first_k_dense_replace"]), int(text.get("moe_layer_freq") or 1)
        return [i >= k and i % freq == 0 for i in range(n)]
    if text.get("num_dense_layers") is not None:
        return [i >= int(text["num_dense_layers"]) for i in range(n)]
    if text.get("expert_layer_period"):
        period, offset = int(text["expert_layer_period"]), int(text.get("expert_layer_offset") or 0)
        return [i % period == offset for i in range(n)]
    if text.get("moe_layer_interval"):
        start, interval = int(text.get("moe_layer_start_index") or 0), int(text["moe_layer_interval"])
        end = text.get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else int(end)
        return [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]
    return [True] * n


def dense_width(text: Mapping[str, Any]) -> int:
    """The dense layers' MLP width (Llama 4's ``intermediate_size_mlp``, else ``intermediate_size``)."""
    return int(text.get("intermediate_size_mlp") or text.get("intermediate_size") or 4 * text["hidden_size"])


def experts_from_fields(text: Mapping[str, Any], model_type: str) -> ExpertDims | None:
    """The mixture of experts a config states (None: a dense MLP in every layer)."""
    experts = first(text, _EXPERTS)
    if isinstance(experts, list):  # a count a layer (Hunyuan's form): priced at the largest
        experts = max(experts)
    if not experts or int(experts) < 2:
        return None
    experts = int(experts)
    active = first(text, _PER_TOKEN)
    active = max(active) if isinstance(active, list) else int(active or 1)
    flags = moe_layer_flags(text, experts)
    if not any(flags):
        return None
    h = text["hidden_size"]
    width = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 4 * h)
    shared = int(first(text, _SHARED_COUNT) or 0)
    shared_width = shared * width
    gate = 0
    if text.get("shared_expert_intermediate_size"):
        shared_width, gate = int(text["shared_expert_intermediate_size"]), h * (model_type in _GATED_SHARED)
    elif text.get("shared_intermediate_size"):
        shared_width = int(text["shared_intermediate_size"])
    elif model_type in ("llama4_text", "llama4"):  # one shared expert as wide as the routed ones
        shared_width = width
    if model_type == "hunyuan_v1_moe":  # its shared MLP: intermediate_size x num_shared_expert
        shared_width = int(text.get("intermediate_size") or 0) * int(text.get("num_shared_expert") or 1)
    biased = model_type in _EXPERT_BIAS
    expert = 3 * h * width + biased * (2 * width + h)
    router = h * experts + biased * experts + experts * (model_type == "ernie4_5_moe")  # ERNIE's score bias
    common = router + 3 * h * shared_width + gate
    return ExpertDims(experts=experts, active=min(active, experts), width=width, shared=shared,
                      shared_width=shared_width, layers=sum(flags), params=experts * expert + common,
                      active_params=min(active, experts) * expert + common, routed=experts * expert)


@dataclass(frozen=True)
class EpTerms:
    """Expert parallelism over ``ep`` ranks (:attr:`cptune.CPConfig.ep_degree`) as the step model prices it: the
    routed experts' parameters a rank does not gather per MoE layer unit (FSDP2 gathers its E / ep experts over their
    replicas, none where each group of experts has one rank), the routed experts' parameters per layer (the mean over
    the layers) that the layer's FSDP traffic no longer moves, this rank's experts per layer that their replicas' own
    FSDP traffic moves (over ``replicas`` ranks), and each all-to-all's bytes and messages on one rank (the tokens'
    routed copies out to their experts' ranks, or back), four per MoE layer a step and two more when full AC
    recomputes the forward."""

    unit_less: float
    layer_less: float
    own_layer: float
    replicas: int
    trade_bytes: float
    messages: int
    passes: int


def ep_terms(experts: ExpertDims | None, ep: int, layers: int, tokens: int, hidden: int, itemsize: int,
             ac: str, replicas: int) -> EpTerms | None:
    """:class:`EpTerms` of ``experts`` over ``ep`` ranks, ``tokens`` on this rank, each expert on ``replicas`` ranks
    (dp_shard x cp / ep; None: no expert parallelism)."""
    if experts is None or ep <= 1:
        return None
    own = experts.routed / ep
    share = experts.layers / layers
    return EpTerms(unit_less=experts.routed - (own if replicas > 1 else 0), layer_less=experts.routed * share,
                   own_layer=own * share, replicas=replicas,
                   trade_bytes=tokens * experts.active * hidden * itemsize * (ep - 1) / ep, messages=ep - 1,
                   passes=experts.layers * (4 + 2 * (ac == "full")))


@dataclass(frozen=True)
class MlpTerms:
    """The layers' MLPs on one rank, per token: the elementwise traffic (elements, the mean over the layers) and what
    autograd keeps for backward (bytes): the mean over the layers without AC and under selective AC, and the largest
    layer's (what backward holds again while it recomputes or takes the gradient of one layer)."""

    elementwise: float
    full: float
    selective: float
    largest: float


def mlp_terms(experts: ExpertDims | None, ffn: int, hidden: int, layers: int, tp: int, itemsize: int) -> MlpTerms:
    """:class:`MlpTerms` of ``layers`` layers, ``experts.layers`` of them MoE (the rest a dense MLP ``ffn`` wide), over
    ``tp`` ranks. A dense layer keeps its four MLP tensors (gate, up, their product, the activation's: 4 x ffn; under
    selective AC its matmuls' outputs, 2 x ffn) and moves 6 x ffn elements. An MoE layer (transformers' grouped experts:
    each expert's tokens gathered, its gated MLP, the output weighted and added back) keeps the same of its active
    width (the top-k experts' and the shared ones') besides each routed copy of the token (the expert's input, its
    down projection's output and the weighted one: 3 x k x hidden; selective: the down projection's) and the router's
    logits and float32 probabilities; it moves 6 x its active width, 6 x k x hidden for the gathers, products and
    index-adds, and 3 x experts for the router's softmax and top-k."""
    e, f = itemsize, ffn / tp
    dense = (6 * f, 4 * f * e, 2 * f * e)
    if experts is None:
        return MlpTerms(*dense, largest=dense[1])
    width, k, n = experts.active_width / tp, experts.active, experts.experts
    moe = (6 * width + 6 * k * hidden + 3 * n, (4 * width + 3 * k * hidden) * e + n * (e + 4),
           (2 * width + k * hidden) * e + n * e)
    m, d = experts.layers, layers - experts.layers
    mean = [(d * a + m * b) / layers for a, b in zip(dense, moe)]
    return MlpTerms(*mean, largest=max(moe[1], dense[1] if d else 0.0))
