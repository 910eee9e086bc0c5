"""Non-causal context parallelism over image-patch tokens: a small ViT-style denoiser.

The script is :mod:`cptune.examples.vit_noncausal` (installed with cptune, so recipes launch it from a wheel as
``python -m cptune.examples.vit_noncausal``); this file runs it from a checkout, with the same arguments::

    python examples/vit_noncausal.py --help
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("cptune.examples.vit_noncausal", run_name="__main__", alter_sys=True)
else:  # imported: its functions (``--workload examples.vit_noncausal:search_step``)
    from cptune.examples.vit_noncausal import *  # noqa: F401,F403
