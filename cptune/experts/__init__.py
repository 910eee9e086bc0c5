"""Mixtures of experts under cptune: expert parallelism (``_parallel``), each MoE layer's experts split over an ep
group of ranks and its tokens traded for them by all-to-all, beside context parallelism.

::

    model = cptune.models.build_model(config, device, ac="none", cp=cp)   # every rank alike
    cptune.experts.expert_parallel(model, ep)      # groups of ep ranks; each keeps E/ep experts of each layer
    with cptune.context_parallel(...):              # tokens of every rank reach their experts' ranks and return
        loss = cptune.hf.causal_lm_loss(model, ...)
        loss.backward()
    cptune.experts.average_gradients(model)         # the experts' as the world's average; the rest as under CP

The first-step check (:mod:`cptune.hf`) compares each rank's experts' gradients with one process's. A distributed
checkpoint keeps each group's experts under names of their own (:func:`saved_names`, :func:`renamed`).
"""

from ._parallel import average_gradients, averaged, ep_groups, ep_parameters, ep_problems, expert_parallel, \
    experts_modules, local_experts, renamed, saved_names, split, world_problems

__all__ = ["average_gradients", "averaged", "ep_groups", "ep_parameters", "ep_problems", "expert_parallel",
           "experts_modules", "local_experts", "renamed", "saved_names", "split", "world_problems"]
