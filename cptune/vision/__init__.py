"""``cptune.vision``: a vision tower's work split over the CP ranks and its embeddings sent to the ranks that hold their
positions, LongVILA's multi-modal sequence parallelism, for towers that attend within one image or frame.

* the units (:mod:`._units`): one temporal patch of an image or video each, their cost, and how they are dealt;
* the trade (:mod:`._route`): which rank fills which rows, and one all-to-all that sends each there (and each
  gradient back).

The transformers side (which families, their positions, the tower's call) is :mod:`cptune.hf._vision`.
"""

from ._route import Routing, route, routing
from ._units import Unit, deal, loads, units

__all__ = ["Routing", "Unit", "deal", "loads", "route", "routing", "units"]
