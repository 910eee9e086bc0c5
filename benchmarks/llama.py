"""The memory-bound benchmark's step: the Llama example's model (attention and MLP), ``workload.layers`` deep.

In the attention-only proxy, PyTorch's ring keeps every rank's K/V for the backward, so dp-only's
peak was within 0-7 % of the CP configs' (the CPU peak's run-to-run spread). In a transformer the
MLP and projections hold activations for this rank's tokens only, so a whole sequence per rank
(dp only) needs clearly more than half of one: at S=2048, dim 512, 8 layers, 1474 MiB against
978-1054 MiB (a probe on 2 CPU ranks). The benchmark sets the budget between the two.
"""

from __future__ import annotations

from examples.train_llama_cp import search_step


def deep_step(workload, device):
    """``cptune search --workload benchmarks.llama:deep_step``: the example's step, ``workload.layers`` deep."""
    return search_step(workload, device, layers=workload.layers)
