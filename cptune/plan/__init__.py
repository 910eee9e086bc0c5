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
from ._dims import MixerDims, ModelDims, dims_from_config, dims_from_values
from ._experts import ExpertDims, LatentDims
from ._hardware import Hardware, load_hardware, profile_names
from ._planner import Plan, plan, plan_workload, predicted_recipe, with_more_gpus
from ._probe import probe
from ._step import Point, Prediction, predict

__all__ = ["Calibration", "ExpertDims", "Hardware", "LatentDims", "MixerDims", "ModelDims", "Plan", "Point",
           "Prediction", "calibrate", "dims_from_config", "dims_from_values", "from_gpu_benchmark", "load_hardware",
           "plan", "plan_workload", "predict", "predicted_recipe", "probe", "profile_names", "with_more_gpus"]
