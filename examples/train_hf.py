"""Train a transformers causal LM with context parallelism, configured by a cptune recipe.

The script is :mod:`cptune.examples.train_hf` (installed with cptune, so recipes launch it from a wheel as
``python -m cptune.examples.train_hf``); this file runs it from a checkout, with the same arguments::

    python examples/train_hf.py --help
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("cptune.examples.train_hf", run_name="__main__", alter_sys=True)
else:  # imported: its functions (``--workload examples.train_hf:search_step``, the preflight cptune launch runs)
    from cptune.examples.train_hf import *  # noqa: F401,F403
