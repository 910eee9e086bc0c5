"""What cptune does for a family whose own code reads where a shard's tokens are: each fix made from outside the
model, at :func:`cptune.hf.enable`, where the family's code would read this rank's shard as the whole sequence.

* Llama 4's NoPE layers (``attn_temperature_tuning``, the layers without rotary embeddings) scale each query by a
  temperature of its position, which the modeling code takes from ``torch.arange(hidden_states.shape[1])``: under CP
  the shard's own index, from 0 on every rank. A hook on the layer's ``q_proj`` rescales each query by the
  temperature of the token's position in its document over that of its index in the shard, so the model's own
  scaling lands on the right one. Packed documents restart it, as each document run alone does. (Its chunked
  layers are the attention's: :func:`cptune.hf._enable.layer_chunk`.)
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .._session import active
from .._torch_cp import not_compiled


def _temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query temperature of 0-based positions (its modeling code's formula)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


@not_compiled
def _nope_ratio(attention: nn.Module, local: int, device: torch.device) -> torch.Tensor | None:
    """(B or 1, local, 1): the temperature each of this rank's queries needs over the one the model gives it, or
    None when they agree (every position below the first step of the temperature, the common case)."""
    session = active()
    if session is None or session.cp == 1 and session.documents is None:
        return None
    positions = session.local_positions()
    if positions.shape[-1] != local:  # not the block's tokens (a call of another length): left to the model
        return None
    index = torch.arange(local)
    if int(positions.max()) + 1 < attention.floor_scale and local < attention.floor_scale:
        return None
    want = _temperature(positions, attention.floor_scale, attention.attn_scale)
    given = _temperature(index, attention.floor_scale, attention.attn_scale)
    return (want / given).unsqueeze(-1).to(device)


def _rescale(attention: nn.Module, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    ratio = _nope_ratio(attention, out.shape[1], out.device)
    return None if ratio is None else (out * ratio).to(out.dtype)


def _is_nope_temperature(module: nn.Module) -> bool:
    return (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
            and isinstance(getattr(module, "q_proj", None), nn.Module)
            and all(isinstance(getattr(module, a, None), (int, float)) for a in ("floor_scale", "attn_scale"))
            and not math.isnan(float(module.floor_scale)))


def adapt(model: nn.Module) -> list[str]:
    """Install each family fix ``model`` needs (idempotent); the paths of the modules fixed."""
    fixed = []
    for path, module in model.named_modules():
        if _is_nope_temperature(module) and not getattr(module, "_cptune_temperature", None):
            module._cptune_temperature = module.q_proj.register_forward_hook(
                lambda m, a, o, attention=module: _rescale(attention, m, a, o))
            fixed.append(path)
    return fixed
