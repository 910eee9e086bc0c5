"""transformers models from their config, built sharded and trained as transformers trains them: one loader for
``cptune search --model``, ``examples/train_hf.py`` and ``cptune.hf.Trainer``.

::

    config = cptune.models.load_config("path/to/model", {"num_hidden_layers": 4})  # dir or config.json
    model = cptune.models.build_model(config, device, fsdp_mesh=mesh, ac="selective")  # random weights, sharded
    model = cptune.models.build_model(config, device, weights="path/to/model", fsdp_mesh=mesh)  # its safetensors
    cptune.models.export_model(model, "out/")   # a folder from_pretrained loads (every rank calls it)

Nothing is downloaded: a model is a local directory (or its ``config.json``). The model is made
on the meta device and materialized one unit at a time (each decoder layer, then the root), each
sharded by FSDP2 before the next is made, so no rank ever holds the whole model; weights come
from the model's own initialization, seeded per unit (the same at any world size), or from a
safetensors checkpoint read into each rank's shards (:mod:`cptune.models._weights`). Training as
transformers does means ``model.train()``, ``use_cache=False``, :func:`cptune.hf.enable`,
activation checkpointing through transformers' own switch (``selective`` keeps matmuls and the
CP attention's output, recomputing the rest), ``torch.compile`` per decoder layer, and FSDP2 per
decoder layer then the root (torchtitan's order). transformers is optional; without it these
functions say which extra to install.
"""

from ..mixers import decoder_layers
from ._build import build_model, check_weights, prepare_for_training
from ._config import attention_shape, config_path, load_config, model_workload, parse_overrides
from ._meta_device import empty_model
from ._parallelize import parallelize
from ._rules import cp_problems, mesh_problems, mixer_paths, tp_problems, training_problems, whole_layers
from ._tp_shards import applies as keeps_tp_shards, stats as tp_shard_stats
from ._weights import check_export, export_model

__all__ = ["attention_shape", "build_model", "check_export", "check_weights", "config_path", "cp_problems",
           "decoder_layers", "empty_model", "export_model", "keeps_tp_shards", "load_config", "mesh_problems",
           "mixer_paths", "model_workload", "parallelize", "parse_overrides", "prepare_for_training", "tp_problems",
           "tp_shard_stats", "training_problems", "whole_layers"]
