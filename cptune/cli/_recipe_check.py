"""``cptune check``: what differs between a recipe and the environment it is about to run in, each with a fix."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._env import environment, total_device_memory
from ..errors import Problem
from ..recipe import Recipe, world_size_problems
from ..sizes import format_size
from ..attention import backend_problem


def _memory_problems(recipe: Recipe) -> list[Problem]:
    """The recipe's measured peak per rank against what one rank has here (a GPU, or RAM over the local ranks)."""
    device, peak = recipe.provenance.device_type, max(recipe.metrics.peak_bytes_per_rank or [0])
    if not recipe.metrics.measured or not peak or (device == "cuda" and not torch.cuda.is_available()):
        return []
    have = total_device_memory(device) // (1 if device == "cuda" else recipe.launch.nproc_per_node)
    if peak <= have:
        return []
    return [Problem("metrics.peak_bytes_per_rank", f"the recipe's measured peak, {format_size(peak)} per rank, is "
                    f"more than a rank has here ({format_size(have)}: "
                    + ("one GPU" if device == "cuda" else f"RAM over {recipe.launch.nproc_per_node} ranks") + ")",
                    "run it where a rank has that much memory, or re-run cptune search here with --memory-budget")]


def check_recipe(recipe: Recipe, world_size: int | None = None) -> list[Problem]:
    """Differences between ``recipe`` and this environment that matter, each with a fix."""
    env, prov, problems = environment().provenance(), recipe.provenance, []
    rerun = "re-run cptune search here and use its recipe"
    predicted = recipe.metrics.predicted_by is not None  # cptune plan's: nothing was measured anywhere
    if predicted:
        problems.append(Problem("metrics.predicted_by", f"the figures are predicted ({recipe.metrics.predicted_by}), "
                                "not measured", "measure the configuration here with cptune search (same model "
                                "and length) before relying on its figures"))
    elif env["torch_version"].split("+")[0].rsplit(".", 1)[0] != prov.torch_version.split("+")[0].rsplit(".", 1)[0]:
        problems.append(Problem("provenance.torch_version", f"measured with torch {prov.torch_version}, this is "
                                f"{env['torch_version']}", f"install torch=={prov.torch_version.split('+')[0]} or {rerun}"))
    if prov.device_type == "cuda" and not torch.cuda.is_available():
        problems.append(Problem("provenance.device_type", "the recipe is for CUDA GPUs and none is visible here",
                                "run it on a GPU machine, or generate a CPU recipe with cptune search --device cpu"))
    elif prov.device_type == "cuda":
        if env["device"] != prov.device and not predicted:
            problems.append(Problem("provenance.device", f"measured on {prov.device}, this is {env['device']}", rerun))
        if torch.cuda.device_count() < recipe.launch.nproc_per_node:
            problems.append(Problem("launch.nproc_per_node", f"wants {recipe.launch.nproc_per_node} GPUs per node, "
                                    f"{torch.cuda.device_count()} visible", "lower nproc_per_node or use a bigger node"))
        if not dist.is_nccl_available():
            problems.append(Problem("provenance.backend", "nccl is not available in this torch", "install a CUDA torch"))
    elif not dist.is_gloo_available():
        problems.append(Problem("provenance.backend", "gloo is not available in this torch", "install torch with gloo"))
    if recipe.edited:
        problems.append(Problem("metrics", "the recipe was edited after it was measured (its workload, config, "
                                "ranks, provenance or figures differ from what the search wrote)",
                                "re-run cptune search for this configuration, or set metrics.measured: false"))
    elif recipe.metrics.measured and not recipe.verifiable:
        problems.append(Problem("metrics.digest", "is missing, so the figures cannot be verified (cptune search "
                                "writes one; it was deleted, or the recipe was written by hand)",
                                "re-run cptune search for this configuration, or set metrics.measured: false"))
    problems += _memory_problems(recipe)
    if world_size is not None:
        problems += world_size_problems(recipe, world_size, "world_size")
    dims = recipe.config.parallel_dims(recipe.launch.world_size)  # the recipe's own ranks (checked at load)
    cp, w = dims.cp, recipe.workload
    problems += recipe.config.degree_problems(cp)
    ulysses, ring = recipe.config.degrees(cp)
    problems += dims.model_problems(heads=w.heads, kv_heads=w.kv_heads or w.heads, ulysses=ulysses,
                                    argument="config.mesh_shape")
    problems += dims.sequence_problems(w.seq_len, "workload.seq_len")
    for backend in recipe.config.sdpa_backend or ():
        why = backend_problem(prov.device_type, backend, recipe.workload.torch_dtype, ring=ring > 1)
        if why and (prov.device_type == "cpu" or torch.cuda.is_available()):
            problems.append(Problem("config.sdpa_backend", f"'{backend}' cannot run here: {why}", rerun))
    return problems


def recipe_notes(recipe: Recipe) -> list[str]:
    """What is allowed but costly in the recipe's layout of ranks: a tp that crosses nodes."""
    crossing = recipe.config.parallel_dims(recipe.launch.world_size).node_warning(recipe.launch.nproc_per_node)
    return [crossing] if crossing else []
