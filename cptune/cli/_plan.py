"""``cptune plan`` and ``cptune probe``: thin calls into :mod:`cptune.plan` (registered on the ``cptune`` group)."""

from __future__ import annotations

import json

import click

from ._types import COUNT, DIMS, DOCUMENTS, HARDWARE, KEY_VALUE, SIZE, VIDEO, InputFile, OneOf, OutputFile, Whole
from ..workload import BUDGET_FRACTION
from ..errors import Problem, ValidationError, raise_if
from ..workload import AC_MODES


@click.command("plan")
@click.option("--model", type=InputFile(dir_okay=True), default=None, metavar="PATH",
              help="A transformers model directory or its config.json.")
@click.option("--model-override", "model_overrides", type=KEY_VALUE, multiple=True, metavar="KEY=VALUE",
              help="Change the model's config first (repeatable), e.g. num_hidden_layers=40.")
@click.option("--dims", type=DIMS, default=None, metavar="L,H,HEADS,KV,FFN,VOCAB",
              help="Instead of --model: layers, hidden, heads, kv heads, ffn, vocab (head_dim = hidden / heads).")
@click.option("--seq-len", type=COUNT, required=True, help="Tokens per sequence.")
@click.option("--batch", type=COUNT, default=1, show_default=True, help="Sequences per data-parallel replica.")
@click.option("--gpus", type=COUNT, required=True, help="GPUs in the job.")
@click.option("--gpus-per-node", type=COUNT, default=8, show_default=True)
@click.option("--hardware", type=HARDWARE, default="h100", show_default=True,
              help="A shipped profile (a100, h100, h200, b200, cpu) or a JSON profile file.")
@click.option("--gpu-benchmark", default=None, metavar="JSON", type=InputFile(),
              help="Calibrate the attention rate from `python -m benchmarks.gpu` results on this GPU type.")
@click.option("--memory-budget", type=SIZE, default=None,
              help=f"Per-GPU budget, e.g. 70GiB (default: {BUDGET_FRACTION:.0%} of the GPU's memory).")
@click.option("--dtype", type=OneOf(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--documents", type=DOCUMENTS, default=None, metavar="SPEC",
              help="Packed documents: 16, 'longtail', or lengths.")
@click.option("--window", type=Whole(0), default=None, metavar="N", help="Causal sliding window of N earlier tokens.")
@click.option("--video", type=VIDEO, default=None, metavar="T,H,W",
              help="A vision-language --model's video a sequence: its grid in patches (temporal patches, height, "
                   "width).")
@click.option("--ac", type=OneOf(["auto", *AC_MODES]), default="auto", show_default=True,
              help="Activation checkpointing: auto ranks all three.")
@click.option("--max-tp", type=COUNT, default=None,
              help="Largest tensor-parallel degree to plan (default: a node's GPUs; 1 plans dp x cp only).")
@click.option("--all", "show_all", is_flag=True, help="Print every configuration (default: the best 20).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout.")
@click.option("--out", type=OutputFile(), default=None,
              help="Write the best configuration's recipe here, marked predicted (not measured).")
def plan_command(model, model_overrides, dims, seq_len, batch, gpus, gpus_per_node, hardware, gpu_benchmark,
                 memory_budget,
                 dtype, documents, window, video, ac, max_tp, show_all, as_json, out) -> None:
    """Predict every CP configuration of a cluster not at hand and rank them (no GPU needed).

    \b
    cptune plan --model path/to/llama --seq-len 131072 --gpus 64 --gpus-per-node 8 --hardware h100
    """
    from .. import plan as P
    from ..models import parse_overrides
    from ..recipe import command_line, save_recipe
    from ..sizes import parse_size

    if (model is None) == (dims is None):
        raise ValidationError([Problem("--model", "give either --model or --dims", "e.g. --model path/to/model "
                                       "or --dims 32,4096,32,8,14336,128256")])
    if model_overrides and not model:
        raise ValidationError([Problem("--model-override", "changes a --model's config, and --dims is given",
                                       "give the changed dims with --dims, or use --model with --model-override")])
    if model:
        shape = P.dims_from_config(model, parse_overrides(model_overrides))
    else:
        shape = P.dims_from_values(*dims)
    raise_if([Problem("--video", f"is given, and {shape.name or 'the model'} has no vision tower in its config",
                      "give a vision-language model's config (its vision_config), or leave --video out")]
             if video and shape.tower is None else [])
    workload = P.plan_workload(shape, seq_len, batch, dtype, documents=documents, window=window, model=model,
                               overrides=parse_overrides(model_overrides), video=video)
    profile = P.load_hardware(hardware)
    if gpu_benchmark:
        profile = P.from_gpu_benchmark(profile, gpu_benchmark, argument="gpu_benchmark")
    result = P.plan(shape, workload, profile, gpus, gpus_per_node,
                    parse_size(memory_budget) if memory_budget else None,
                    AC_MODES if ac == "auto" else (ac,), max_tp=max_tp)
    if out:
        path = save_recipe(P.predicted_recipe(result, command_line()), out)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        click.echo(result.header())
        click.echo(result.table(None if show_all else 20))
        if result.invalid:
            click.echo(f"not possible: {len(result.invalid)} configuration(s), e.g. {result.invalid[0][0]}: "
                       f"{result.invalid[0][1]}")
        click.echo(f"\n{result.best_line()}" if result.best else
                   f"\nnothing is predicted to fit. {result.shortfall(P.with_more_gpus(result, max_tp=max_tp))}")
    if out:
        click.echo(f"predicted recipe: {path} (not measured: measure it with cptune search on the cluster)", err=True)


@click.command("probe")
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Ranks to measure at once.")
@click.option("--threads", type=COUNT, default=1, show_default=True, help="Torch threads per rank.")
@click.option("--out", type=OutputFile(), required=True, help="Write the hardware profile here.")
def probe_command(nproc, threads, out) -> None:
    """Measure this machine (GEMM, attention, memory and link rates on real gloo ranks) as a --hardware profile."""
    from .. import plan as P

    hw = P.probe(nproc, threads)
    path = hw.save(out)
    click.echo(json.dumps(hw.model_dump(mode="json"), indent=1))
    click.echo(f"profile: {path}", err=True)
