"""``cptune.mixers``: the layers that mix tokens outside softmax attention, and how each crosses the CP ranks.

* the rule (:mod:`._rule`): which modules of a model mix tokens (convolutions over the sequence, recurrences,
  ``layer_types`` that are not attention, sparse-attention indexers, leaves no rule knows), which module of a decoder
  layer covers each (:func:`model_coverage`), and the refusal of what none covers (:func:`cp_problems`);
* the choice (:mod:`._choice`): the path each covered layer takes under a block's cp and ``CPConfig.mixers``
  (:func:`path`), installed on the model by :func:`prepare`;
* the paths: the split ones, each meeting the contract written in :mod:`._contract` (``halo``, :mod:`._halo`: short
  convolutions by a halo exchange; ``heads``, :mod:`._heads`: Gated DeltaNet and Mamba2 by an all-to-all over their
  heads), and ``generic`` (:mod:`._generic`): the layer whole over the gathered sequence.

Megatron-Core keeps a mixer's CP beside the mixer the same way (its Mamba mixer and the CP module beside it); the
model's own modules stay as transformers wrote them, and cptune wraps their forward.
"""

from ._contract import PATHS
from ._choice import path, prepare, splits
from ._generic import by_document, gather_inputs, segments
from ._rule import Mixer, covered, cp_problems, decoder_layers, describe, is_attention_kind, layer_kinds, \
    model_coverage, model_mixers, per_image_parts, token_mixers

__all__ = ["Mixer", "PATHS", "by_document", "covered", "cp_problems", "decoder_layers", "describe", "gather_inputs",
           "is_attention_kind", "layer_kinds", "model_coverage", "model_mixers", "path", "per_image_parts", "prepare",
           "segments", "splits", "token_mixers"]
