"""The four ways families trained wrong or crashed under CP before cptune's fixes, undone on purpose in this process
(cptune's own internals, as only tests reach them): what the first-step check must refuse (tests/test_check.py,
``python -m benchmarks.check --margins``)."""

from __future__ import annotations

import contextlib

BROKEN = {"llama4_text": ("shard positions", ()), "zamba2": ("cut gradient", ()),
          "deepseek_v32": ("", ("DeepseekV32Indexer",)), "qwen4_exp_text": ("", ("Qwen4ExpTextQSAIndexer",))}
"""The families that failed, how (what of cptune's is undone), and the indexers vouched for past the rule."""


@contextlib.contextmanager
def broken(how: str):
    """cptune's fix undone in this process, the way a family failed before it: ``shard positions`` (Llama 4's chunks
    and NoPE temperature read from the rank's shard) or ``cut gradient`` (Zamba2's shared block reaching its Mamba
    layer detached); ``""`` undoes nothing."""
    from cptune.hf import _families
    from cptune.mixers import _generic as _gathered
    from cptune.hf import _enable as _hf
    from cptune import attention as A

    saved = (_families.adapt, _hf.layer_chunk, _gathered.gather_inputs)
    if how == "shard positions":
        _families.adapt, _hf.layer_chunk = (lambda model: []), (lambda module: None)
    elif how == "cut gradient":
        _gathered.gather_inputs = lambda kwargs, local, group, layout, rank: _gathered._map_sequence(
            kwargs, local, lambda t: A.gather(t.detach(), 1, group, layout))
    try:
        yield
    finally:
        _families.adapt, _hf.layer_chunk, _gathered.gather_inputs = saved
