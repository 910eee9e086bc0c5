"""The contract a split path meets: how a layer that mixes tokens outside softmax attention crosses the CP ranks
without the whole sequence on every rank.

A split path is one module of this package that defines:

* ``NAME``: what the choice (:func:`cptune.mixers.path`), the matrix and ``cptune show`` call it ('halo', 'heads');
* ``splittable(module) -> bool``: whether it knows this layer (a module :func:`cptune.mixers.covered` found), read
  from the module's own structure, never from a list of families;
* ``fits(module, cp) -> bool``: whether it runs this layer under ``cp`` ranks (the heads path needs the heads
  divisible by cp); where it does not, the layer takes the generic path;
* ``split_forward(module, hidden_states, session, *args, **kwargs)``: the layer's forward on this rank's tokens
  (``hidden_states``: this rank's shard, in the block's layout; ``session``: the open block, its group, layout,
  documents), returning what the module's own forward returns for those tokens, exact against one process (its
  gradients too), packed documents restarting the layer as one process running each document alone.

A new path is one file here and one line in :data:`PATHS`. The generic path (:mod:`._generic`) is not one of them: it
is what every layer takes that no path splits, and every layer under ``CPConfig(mixers="whole")``.
"""

from __future__ import annotations

from types import ModuleType

from . import _halo, _heads

PATHS: tuple[ModuleType, ...] = (_halo, _heads)
"""The split paths, tried in this order (the first that knows a layer and fits the cp takes it)."""
