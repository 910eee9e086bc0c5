"""Which path each layer that mixes tokens outside attention takes under cp ranks: one rule for the model's forward
(:func:`prepare`), the search's space, the plan and ``cptune show`` (:func:`path`): the first split path of
:data:`cptune.mixers._contract.PATHS` that knows the layer and fits the cp, else ``generic`` (:mod:`._generic`: the layer
whole over the gathered sequence), and ``generic`` for every layer under ``CPConfig(mixers="whole")``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .._session import active
from ._contract import PATHS
from ._generic import _arg_names, _whole_forward, run_whole
from .._torch_cp import not_compiled


def path(module: nn.Module, cp: int, mixers: str = "split") -> str:
    """The path ``module`` (a layer :func:`cptune.mixers.covered` found) takes under ``cp`` ranks and ``mixers``
    (:attr:`cptune.CPConfig.mixers`)."""
    if mixers == "split":
        for kind in PATHS:
            if kind.splittable(module) and kind.fits(module, cp):
                return kind.NAME
    return "generic"


def splits(module: nn.Module) -> bool:
    """Whether some cp can run ``module`` split (a path other than the generic one exists for it)."""
    return any(kind.splittable(module) for kind in PATHS)


@not_compiled
def _forward(module: nn.Module, forward, hidden_states: torch.Tensor, *args, **kwargs):
    session = active()
    if session is None:
        return forward(hidden_states, *args, **kwargs)
    if session.cp == 1:  # packed documents restart the layer as on cp ranks (the generic path does it at cp = 1)
        return _whole_forward(module, forward, hidden_states, *args, **kwargs)
    module._cptune_path = path(module, session.cp, session.config.mixers)
    if module._cptune_path == "generic":
        return _whole_forward(module, forward, hidden_states, *args, **kwargs)
    split = next(kind.split_forward for kind in PATHS if kind.NAME == module._cptune_path)
    return split(module, hidden_states, session, *args, **kwargs)


def prepare(module: nn.Module) -> None:
    """Make ``module`` take its path inside every block of cp > 1 (chosen at each call, by :func:`path`: the
    block's cp and ``mixers``); idempotent."""
    if not splits(module):
        return run_whole(module)
    if getattr(module, "_cptune_split", False):
        return
    module._cptune_arg_names = _arg_names(module.forward)
    module.forward = functools.partial(_forward, module, module.forward)
    module._cptune_split = True
