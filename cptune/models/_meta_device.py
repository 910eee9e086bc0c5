"""The meta-device build's two halves, for :func:`cptune.models.build_model`: a model made with every parameter on the
meta device and its buffers real (:func:`parameters_on_meta`), then materialized one unit at a time
(:func:`materialize`); :func:`empty_model`, a config's model made so, for the rules that read its modules."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..errors import Problem, ValidationError
from ._config import _transformers

_KEPT_PARAMETER = 4096
"""Parameters this small keep the value their module's ``__init__`` gave them through the meta-device build (a
learned activation's scalars, Apertus' xIELU): ``_init_weights`` does not set every parameter, and one it leaves
would be uninitialized memory after ``to_empty``, different on every rank."""


@contextlib.contextmanager
def parameters_on_meta():
    """Inside: every parameter a module registers goes to the meta device (nothing allocated, initializers run on
    meta), every buffer is made where its module makes it, with its value (accelerate's ``init_empty_weights``
    without buffers, the rule ``from_pretrained`` loads by). A model's buffers are what its ``__init__``
    computes (rotary frequencies, embedding scales): built on meta they would have no value, and not every
    transformers release's ``_init_weights`` computes them again (4.56 and 4.57 leave ``inv_freq`` as
    uninitialized memory after ``to_empty``). Small parameters keep their value likewise (:data:`_KEPT_PARAMETER`).
    Every floating parameter is float32, also one a module makes in another dtype whatever the model's (transformers
    4.56's xIELU makes its scalars bfloat16): FSDP2 takes one dtype a unit, and the build promises float32."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and not held.is_meta:
            if held.numel() <= _KEPT_PARAMETER:  # the value __init__ gave it, in case _init_weights sets none
                module.__dict__.setdefault("_cptune_made", {})[name] = held.detach().clone()
            kind = type(held)
            extra = dict(held.__dict__)
            dtype = torch.float32 if held.is_floating_point() else held.dtype  # xIELU's bf16 scalars on 4.56 too
            module._parameters[name] = kind(held.to("meta", dtype), requires_grad=held.requires_grad)
            module._parameters[name].__dict__.update(extra)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@torch.no_grad()
def materialize(model: nn.Module, modules: list[nn.Module], device: torch.device, seed: int, unit: int) -> None:
    """``modules``' own parameters and buffers on ``device``: parameters initialized by the model's
    ``_init_weights`` from a generator state that depends on (seed, unit) only, buffers holding the values the
    modules computed when made (then ``_init_weights``', where it sets them); tied weights tied again."""
    for m in modules:
        made = {name: b for name, b in m._buffers.items() if b is not None and not b.is_meta}
        m.to_empty(device=device, recurse=False)
        for name, value in made.items():
            m._buffers[name].copy_(value)
        for name, value in m.__dict__.get("_cptune_made", {}).items():
            if m._parameters.get(name) is not None:
                m._parameters[name].copy_(value)
    if unit == 0 and hasattr(model, "tie_weights"):  # the root's: lm_head shares the embedding when tied
        model.tie_weights()
    torch.manual_seed(seed * 1_000_003 + unit)
    for m in modules:
        model._init_weights(m)


def empty_model(config, structure_only: bool = False) -> nn.Module:
    """``config``'s causal LM, its parameters on the meta device, its buffers made. ``structure_only``: every tensor
    made on the meta device, buffers too (nothing allocated, whatever the model's size: a DeepSeek-V3's experts), for
    the rules that read only its modules (:func:`cptune.plan._space.model_limits`)."""
    transformers = _transformers("model")
    with torch.device("meta") if structure_only else parameters_on_meta():
        try:
            return _from_config(transformers, config)
        except RuntimeError as exc:  # an _init_weights that assigns .data (Bamba's on 4.56) fails on the meta device
            from .._deps import version_tuple  # the fix never names the release already installed

            fix = "pip install -U transformers (verified: 5.25)" if version_tuple(transformers.__version__) < \
                (5, 25, 0) else "report the config to cptune (this is the release it verified); cptune plan " \
                "--model plans it from the config's fields without building it"
            raise ValidationError([Problem("model", f"{type(config).__name__}: transformers {transformers.__version__}"
                                           f" cannot build it on the meta device ({str(exc).splitlines()[0][:160]})",
                                           fix)]) from None


def _from_config(transformers, config) -> nn.Module:
    """The model with SDPA attention outside a block, or its own eager attention where transformers has no SDPA
    for the family (GPT-OSS's sinks, Gemma 2's softcapping); inside a block cptune's attention runs either way, and
    refuses by name what it cannot run (softcapping)."""
    build = transformers.AutoModelForCausalLM.from_config
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and \
            type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:  # a vision-language model
        build = transformers.AutoModelForImageTextToText.from_config
    try:
        return build(config, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError as exc:  # e.g. 'GptOssForCausalLM does not support an attention implementation through SDPA'
        if "attention implementation" not in str(exc):
            raise
    return build(config, attn_implementation="eager", dtype=torch.float32)
