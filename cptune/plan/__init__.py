"""Predict a training step under CP on clusters not at hand, and calibrate the prediction on what was measured.

::

    dims = cptune.plan.dims_from_config("path/to/model")                  # or ModelDims(layers=..., ...)
    hw = cptune.plan.load_hardware("h100")                                # shipped: profile_names()
    result = cptune.plan.plan(dims, cptune.plan.plan_workload(dims, 131072), hw, gpus=64, gpus_per_node=8)
    print(result.table())

The step model (:func:`predict`) imports nothing from the search; the search imports it to order its
trials and skip those the calibrated model rules out (:mod:`cptune.search.guide`).
"""

from ._calibrate import Calibration, calibrate, from_gpu_benchmark
from ._dims import MixerDims, ModelDims, dims_from_config, dims_from_values, dims_from_workload
from ._experts import ExpertDims, LatentDims, fewer_experts
from ._hardware import Hardware, for_device, load_hardware, profile_names
from ._planner import Plan, plan, plan_workload, predicted_recipe, with_more_gpus
from ._probe import probe
from ._space import AC_MODES, ROTATE_METHODS, config_from, config_key, configurations, expert_degrees, \
    invalid_reason, mesh_shapes, meshes, mixer_choices, model_limits, strategies, tp_degrees, transformers_missing, \
    usable_backends
from ._ring import busiest_pairs, kept_attention_layer, ring_blocks, ring_buffer_bytes
from ._step import Point, Prediction, predict

__all__ = [
    "AC_MODES", "ROTATE_METHODS", "busiest_pairs", "calibrate", "Calibration", "config_from", "config_key",
    "configurations", "dims_from_config", "expert_degrees", "dims_from_values", "dims_from_workload", "ExpertDims",
    "fewer_experts", "for_device", "from_gpu_benchmark", "Hardware", "invalid_reason", "kept_attention_layer",
    "LatentDims", "load_hardware", "mesh_shapes", "meshes", "mixer_choices", "MixerDims", "model_limits",
    "ModelDims", "plan", "Plan", "plan_workload", "Point", "predict", "predicted_recipe", "Prediction", "probe",
    "profile_names", "ring_blocks", "ring_buffer_bytes", "strategies", "tp_degrees", "transformers_missing",
    "usable_backends", "with_more_gpus",
]
