"""Which layers of a model mix tokens outside softmax attention: one rule, judged on the model's own modules and
config, for every family (one cptune has never seen included), so that nobody trains them silently wrong under CP.

cptune makes two kinds of module exact across CP ranks: softmax attention (through its SDPA hook) and modules that
act on each token alone. A module is taken as per-token when it is one of torch's per-token kinds (linear layers,
embeddings, norms, dropout, identity, activations) or, by transformers' naming, a norm, an activation, a rotary
embedding (it reads the position ids the block shards), an MoE router or experts. Anything else is named:

* a convolution whose kernel spans more than one position (short convolutions, the conv1d inside Mamba and Gated
  DeltaNet), a recurrent layer (``nn.RNNBase``), a padding or shift module (a token shift reads its neighbour);
* a decoder layer whose ``config.layer_types`` entry is not a softmax-attention kind (``linear_attention``,
  ``conv``, ``mamba``, ``hybrid``...; ``mlp`` and ``moe`` layers are per-token), even where every module in it
  looks per-token (a linear attention computes its recurrence inline);
* a leaf module of a kind none of the above recognizes: cptune cannot tell whether it mixes tokens, so it says so
  instead of waving it through (``token_wise=`` vouches for a class that is per-token);
* a sparse-attention indexer (transformers' ``...Indexer``: DeepSeek-V3.2's and GLM-5's DSA, Qwen4-Exp's QSA), which
  scores every key of the sequence outside SDPA to pick each query's keys: no path makes it exact, so it is refused.

Under cp > 1 each rank would run these on its shard alone: the recurrence or convolution restarts at every shard
boundary and the gradients are silently wrong. :func:`covered` finds the module of a decoder layer that holds each
one (Gated DeltaNet's ``linear_attn``, LFM2's ``conv``, Mamba's ``mamba``, MiniMax's lightning ``self_attn``), which
cptune's generic path runs whole over the gathered sequence (:mod:`cptune.mixers._generic`): exact. What no such module
covers is refused by name. This module imports nothing of cptune's but the errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

from ..errors import Problem, ValidationError

_PER_TOKEN_TYPES = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.Dropout, nn.Identity, nn.LayerNorm, nn.RMSNorm,
                    nn.GroupNorm, nn.Flatten, nn.Unflatten)
_PER_TOKEN_MODULES = ("torch.nn.modules.activation", "transformers.activations")
_PER_TOKEN_NAME = re.compile(r"(Norm|NormGated|Activation|Act|RotaryEmbedding|Router|Experts?|Embedding|Embeddings)$")
"""transformers' names for per-token modules: ``LlamaRMSNorm``, ``Qwen3NextRMSNormGated``, ``SiLUActivation``,
``LlamaRotaryEmbedding``, ``MixtralTopKRouter``, ``GptOssExperts``, ``Gemma3TextScaledWordEmbedding``."""
_SELECTS_KEYS = re.compile(r"Indexer$")
"""transformers' names for a sparse-attention indexer: ``DeepseekV32Indexer``, ``GlmMoeDsaIndexer``,
``Qwen4ExpTextQSAIndexer``."""
_PER_TOKEN_KINDS = re.compile(r"^(mlp|moe|ffn|dense|expert|experts)$")
"""``layer_types`` kinds that name a feed-forward layer (Nemotron-H's ``mlp`` and ``moe``)."""


def is_attention_kind(kind: str) -> bool:
    """``full_attention``, ``sliding_attention``, ``chunked_attention``, ``attention``: softmax attention, which
    cptune's SDPA hook makes exact; ``linear_attention`` is not."""
    kind = str(kind).lower()
    return "attention" in kind and "linear" not in kind


def layer_kinds(config) -> list[str] | None:
    """The kind of each decoder layer as the config states it (``layer_types``, or ``layers_block_type`` before
    transformers named it so), or None when it states none."""
    text = getattr(config, "get_text_config", lambda: config)()
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text, field, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [str(k) for k in kinds]
    return None


def _mixing_leaf(module: nn.Module) -> str | None:
    """What makes a leaf module mix tokens, or None when it is per-token; 'unknown' when no rule knows it."""
    if isinstance(module, nn.modules.conv._ConvNd):
        span = max(module.kernel_size)
        if span > 1 or max(module.stride) > 1:
            return f"a {type(module).__name__} over {span} positions"
        return None
    if isinstance(module, nn.RNNBase):
        return f"a recurrent {type(module).__name__}"
    if isinstance(module, (nn.modules.padding._ConstantPadNd, nn.modules.padding._ReflectionPadNd,
                           nn.modules.padding._ReplicationPadNd, nn.ZeroPad2d)):
        return f"a {type(module).__name__} (a shift along the sequence)"
    if isinstance(module, _PER_TOKEN_TYPES) or type(module).__module__ in _PER_TOKEN_MODULES:
        return None
    if _PER_TOKEN_NAME.search(type(module).__name__):
        return None
    return "unknown"


@dataclass(frozen=True)
class Mixer:
    """One module that mixes tokens outside attention: where (its path), what it is, and why."""

    path: str
    kind: str
    why: str
    coverable: bool = True
    """Whether a decoder layer's child holding it can run it whole (:func:`covered`): not for a module cptune cannot
    tell about, nor for a sparse-attention indexer (it selects keys for attention inside the same child)."""


def token_mixers(model: nn.Module, config=None, layers: list[nn.Module] | None = None,
                 token_wise: Iterable[type | str] = ()) -> list[Mixer]:
    """Every module of ``model`` that mixes tokens outside softmax attention (the module docstring's rule).
    ``layers``: its decoder layers in order (for ``config.layer_types``); ``token_wise``: classes (or class names)
    the caller vouches for as per-token."""
    vouched = {t if isinstance(t, str) else t.__name__ for t in token_wise}
    found: list[Mixer] = []
    indexers: list[str] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in vouched or any(path.startswith(f"{i}.") for i in indexers):
            continue
        if _SELECTS_KEYS.search(name):
            indexers.append(path)
            found.append(Mixer(path, name, f"a {name}: a sparse-attention indexer, which scores every key of the "
                               "sequence outside SDPA to choose each query's keys", coverable=False))
            continue
        if any(True for _ in module.children()):
            continue
        why = _mixing_leaf(module)
        if why == "unknown":
            found.append(Mixer(path, name, f"a {type(module).__qualname__} (from {type(module).__module__}), a module "
                               "cptune cannot tell is per-token", coverable=False))
        elif why is not None:
            found.append(Mixer(path, name, why))
    kinds = layer_kinds(config if config is not None else getattr(model, "config", None)) or []
    if layers and kinds:
        paths = {id(m): p for p, m in model.named_modules()}
        for i, (layer, kind) in enumerate(zip(layers, kinds)):
            if not is_attention_kind(kind) and not _PER_TOKEN_KINDS.match(kind.lower()):
                found.append(Mixer(paths.get(id(layer), f"layers.{i}"), type(layer).__name__,
                                   f"config.layer_types {kind!r}, not softmax attention"))
    return found


def decoder_layers(model: nn.Module, required: bool = True) -> list[nn.Module]:
    """The model's repeated blocks (transformers names their class in ``_no_split_modules``; FSDP2's subclass of it
    counts), in order; none found is an error when ``required``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(p, m) for p, m in model.named_modules() if names.intersection(c.__name__ for c in type(m).__mro__)]
    # outermost only: a layer class nested in another (Zamba2's hybrid layer holds a Mamba layer) is part of it
    outer = [p for p, _ in found]
    layers = [m for p, m in found if not any(p.startswith(f"{o}.") for o in outer if o != p)]
    if not layers and required:
        raise ValidationError([Problem("model", f"{type(model).__name__} names no decoder layer class "
                                       "(_no_split_modules)", "use a transformers causal LM")])
    return layers


def per_image_parts(model: nn.Module) -> list[str]:
    """A vision-language model's parts beside its language model (the vision tower, the projector): the other
    children of the module that holds a ``language_model`` (transformers 5's layout; ``text_model`` in Idefics3's and
    SmolVLM's). They run per image or frame, not along the language model's sequence, so this rule does not judge
    them: :mod:`cptune.hf._vision` does."""
    for path, module in model.named_modules():
        names = [n for n, _ in module.named_children()]
        language = next((n for n in ("language_model", "text_model") if n in names), None)
        if language is not None and len(names) > 1:
            return [f"{path}.{n}" if path else n for n in names if n != language]
    return []


def _language_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers along the language model's sequence (a vision tower's blocks are per image)."""
    parts = per_image_parts(model)
    paths = {id(m): p for p, m in model.named_modules()}
    return [layer for layer in decoder_layers(model, required=False)
            if not any(paths.get(id(layer), "") == p or paths.get(id(layer), "").startswith(f"{p}.") for p in parts)]


def model_mixers(model: nn.Module, token_wise: Iterable[type | str] = ()) -> list[Mixer]:
    """:func:`token_mixers` of a transformers model: its config's layer kinds read against its decoder layers; a
    vision-language model's parts beside its language model left out (:func:`per_image_parts`)."""
    parts = per_image_parts(model)
    found = token_mixers(model, getattr(model, "config", None), _language_layers(model), token_wise)
    return [m for m in found if not any(m.path == p or m.path.startswith(f"{p}.") for p in parts)]


def model_coverage(model: nn.Module, token_wise: Iterable[type | str] = ()) -> tuple[dict[str, nn.Module],
                                                                                       list[Mixer]]:
    """:func:`covered` of a transformers model's :func:`model_mixers`: (what the generic path runs whole, what is
    left to refuse)."""
    return covered(model, model_mixers(model, token_wise), _language_layers(model))


_ATTENTION_CHILD = re.compile(r"(attn|attention)$", re.I)


def covered(model: nn.Module, mixers: list[Mixer], layers: list[nn.Module]) -> tuple[dict[str, nn.Module],
                                                                                      list[Mixer]]:
    """(the modules cptune's generic path runs whole over the gathered sequence, path -> module; the mixers none of
    them covers). A mixing leaf inside a decoder layer is covered by the layer's child that holds it (Gated DeltaNet's
    ``linear_attn`` around its conv1d, LFM2's ``conv``, Mamba's ``mamba``); a layer whose ``layer_types`` kind mixes
    is covered by such a child, or else by its one attention child (MiniMax's lightning attention, whose recurrence
    is inline). Left: leaves no rule knows (cptune cannot tell what they do), mixing leaves that are a layer's own
    children or outside the layers."""
    paths = {id(m): p for p, m in model.named_modules()}
    layer_paths = [paths[id(layer)] for layer in layers if id(layer) in paths]
    blocks: dict[str, nn.Module] = {}
    left: list[Mixer] = []
    by_layer = [m for m in mixers if m.path in layer_paths]
    for m in mixers:
        if m in by_layer:
            continue
        owner = next((lp for lp in layer_paths if m.path.startswith(f"{lp}.")), None)
        child = m.path[len(owner) + 1:].split(".", 1)[0] if owner is not None else ""
        if not m.coverable or owner is None or f"{owner}.{child}" == m.path:
            left.append(m)
            continue
        blocks[f"{owner}.{child}"] = model.get_submodule(f"{owner}.{child}")
    for m in by_layer:
        if any(path.startswith(f"{m.path}.") for path in blocks):
            continue
        layer = model.get_submodule(m.path)
        attention = [name for name, _ in layer.named_children() if _ATTENTION_CHILD.search(name)]
        if len(attention) == 1:
            blocks[f"{m.path}.{attention[0]}"] = layer.get_submodule(attention[0])
        else:
            left.append(m)
    return blocks, left


def _layer_of(path: str) -> tuple[str, str]:
    """('layers.3', 'linear_attn.conv1d') of 'model.layers.3.linear_attn.conv1d'; ('', path) outside layers."""
    match = re.search(r"(?:^|\.)(layers|h|blocks)\.(\d+)(?:\.|$)", path)
    if not match:
        return "", path
    return match.group(2), path[match.end():]


def describe(mixers: list[Mixer]) -> str:
    """The mixers grouped by what they are, each group's layers listed once: 'layers 0, 1, 2: linear_attn.conv1d (a
    Conv1d over 4 positions); layer 3: ...'."""
    groups: dict[tuple[str, str], list[str]] = {}
    for m in mixers:
        index, inner = _layer_of(m.path)
        groups.setdefault((inner, m.why), []).append(index)
    parts = []
    for (inner, why), indices in groups.items():
        where = [i for i in indices if i]
        head = (f"layer{'s' if len(where) > 1 else ''} {', '.join(where)}" if where else "")
        name = f"{head}{' ' if head and inner else ''}{inner}" if inner or head else "the model"
        parts.append(f"{name} ({why})")
    return "; ".join(parts)


def cp_problems(model_name: str, mixers: list[Mixer], cp: int, argument: str) -> list[Problem]:
    """The refusal of ``mixers`` (those no path covers: :func:`covered`) under ``cp`` ranks (none when cp is 1 or
    there are none)."""
    if cp <= 1 or not mixers:
        return []
    return [Problem(argument, f"is cp={cp} but {model_name} mixes tokens outside attention where cptune cannot make "
                    f"it exact across CP ranks: {describe(mixers)}. Each rank would run these on its shard alone, "
                    "restarting them at every shard boundary (silently wrong gradients)",
                    "if a module named is in fact per-token, vouch for it with cptune.hf.enable(model, "
                    "token_wise=[its class]); a layer that mixes tokens is exact under CP when it is a module of a "
                    "decoder layer (cptune runs that module whole over the gathered sequence); else train this model "
                    "with cp=1 (data parallelism, FSDP2 or tp)")]
