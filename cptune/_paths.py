"""Which path each layer that mixes tokens outside attention takes under cp ranks: one rule for the model's forward
(:func:`prepare`), the search's space, the plan and ``cptune show`` (:func:`path`).

* ``halo``: short convolutions (LFM2's ShortConv) on each rank's own tokens by a halo exchange (:mod:`._halo`);
* ``heads``: Gated DeltaNet and Mamba2 by an all-to-all over their heads, where the heads divide by cp
  (:mod:`._heads`);
* ``generic``: any other such layer, and every one under ``CPConfig(mixers="whole")``, whole over the gathered
  sequence (:mod:`._gathered`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import _halo, _heads
from ._gathered import _arg_names, _whole_forward, run_whole
from ._session import active

def path(module: nn.Module, cp: int, mixers: str = "split") -> str:
    """The path ``module`` (a layer :func:`cptune._mixers.covered` found) takes under ``cp`` ranks and ``mixers``
    (:attr:`cptune.CPConfig.mixers`)."""
    if mixers == "split" and _halo.splittable(module):
        return "halo"
    if mixers == "split" and _heads.splittable(module) and _heads.fits(module, cp):
        return "heads"
    return "generic"


def splits(module: nn.Module) -> bool:
    """Whether some cp can run ``module`` split (a path other than the generic one exists for it)."""
    return _halo.splittable(module) or _heads.splittable(module)


@torch.compiler.disable
def _forward(module: nn.Module, forward, split, hidden_states: torch.Tensor, *args, **kwargs):
    session = active()
    if session is None:
        return forward(hidden_states, *args, **kwargs)
    if session.cp == 1:  # packed documents restart the layer as on cp ranks (the generic path does it at cp = 1)
        return _whole_forward(module, forward, hidden_states, *args, **kwargs)
    module._cptune_path = path(module, session.cp, session.config.mixers)
    if module._cptune_path == "generic":
        return _whole_forward(module, forward, hidden_states, *args, **kwargs)
    return split(module, hidden_states, session, *args, **kwargs)


def prepare(module: nn.Module) -> None:
    """Make ``module`` take its path inside every block of cp > 1 (chosen at each call, by :func:`path`: the
    block's cp and ``mixers``); idempotent."""
    split = next((kind.split_forward for kind in (_halo, _heads) if kind.splittable(module)), None)
    if split is None:
        return run_whole(module)
    if getattr(module, "_cptune_split", False):
        return
    module._cptune_arg_names = _arg_names(module.forward)
    module.forward = functools.partial(_forward, module, module.forward, split)
    module._cptune_split = True
