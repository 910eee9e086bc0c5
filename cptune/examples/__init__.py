"""The training scripts the shipped recipes run, installed with cptune so a recipe launches from a wheel:
``cptune launch RECIPE`` runs ``python -m cptune.examples.<name>`` on each rank.

* ``train_llama_cp``: a small Llama trained under a recipe (random tokens; --compile, --ac, --fsdp, --documents);
* ``train_hf``: a transformers model from its config or checkpoint (``cptune search --model``'s recipes);
* ``vit_noncausal``: non-causal attention over image patches.

Each runs under ``python`` (one process, the reference) or ``torchrun``; the files in the repository's
``examples/`` folder run the same code.
"""

from . import _options as options  # the options the scripts share (the repository's own example scripts take them too)

__all__ = ["options"]
