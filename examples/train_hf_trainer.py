"""Train a transformers causal LM with the HF Trainer under context parallelism (cptune.hf.Trainer).

    python examples/train_hf_trainer.py --model tests/models/tiny-llama --plain      # one process, transformers.Trainer
    torchrun --standalone --nproc-per-node=2 examples/train_hf_trainer.py --model tests/models/tiny-llama
    cptune launch RECIPE -- examples/train_hf_trainer.py                             # the recipe's config and model

The only change from a plain Trainer script is the class: ``cptune.hf.Trainer(..., recipe=...)``
(or ``config=cptune.CPConfig(...)``; default ``$CPTUNE_RECIPE``). Documents are packed the way
transformers packs them, ``DataCollatorWithFlattening`` (one row per batch, position ids restarting
at each document, no attention mask, no padding); ``--unpacked`` uses fixed-length rows instead.
Each data-parallel replica reads ``--per-device-batch`` documents (or rows) per micro-batch; with
``--plain`` one process reads all replicas' at once, so the global batch is the same and the
losses and parameters after the steps agree (``--out`` writes both, and each rank's peak RSS).
Under torchrun the model is built sharded by FSDP2 (``cptune.models.build_model(...,
fsdp_mesh=...)``: no rank holds it whole) and the Trainer trains the shards as they are;
``--no-fsdp`` builds it whole on every rank and trains it with DDP. ``cptune.models.export_model``
writes the trained model as a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import resource
from types import SimpleNamespace

import click
import torch

import cptune
import cptune.hf
from cptune import models
from cptune.cli import script_check
from cptune.errors import Problem, ValidationError, raise_if
from cptune.examples import options


class Documents(torch.utils.data.Dataset):
    """Synthetic tokenized documents (lengths multiples of 16, so a packed row splits evenly over CP ranks)."""

    def __init__(self, count: int, vocab: int, unpacked_len: int | None = None) -> None:
        gen, self.items = torch.Generator().manual_seed(0), []
        for i in range(count):
            n = unpacked_len or 16 * (1 + i % 4)
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            # unpacked rows: the first label masked, as a BOS token's is; transformers 4.56's own Trainer counts
            # num_items_in_batch over unshifted labels (one target per row too many otherwise; 5.24 does not)
            self.items.append({"input_ids": ids, "labels": [-100] + ids[1:]} if unpacked_len else {"input_ids": ids})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _sequential_trainer():
    import transformers

    class Sequential(transformers.Trainer):
        """transformers' Trainer reading the dataset in order (train_sampling_strategy="sequential" where it exists)."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return Sequential


@click.command(cls=options.Script, help=__doc__.split("\n")[0])
@options.model
@options.model_override
@options.recipe
@click.option("--plain", is_flag=True, help="transformers.Trainer, one process (the reference).")
@click.option("--replicas", type=options.COUNT, default=None,
              help="With --plain: the dp replicas to stand in for [default: 1].")
@click.option("--unpacked", type=options.COUNT, default=None, metavar="SEQ_LEN", help="Fixed-length rows, no packing.")
@click.option("--per-device-batch", type=options.COUNT, default=4, show_default=True,
              help="Documents (or rows) per step.")
@click.option("--grad-accum", type=options.COUNT, default=1, show_default=True, help="Gradient accumulation steps.")
@options.steps(3)
@click.option("--output-dir", type=options.FOLDER, default="trainer-out", show_default=True,
              help="The Trainer's folder.")
@click.option("--fsdp/--no-fsdp", default=True, show_default=True,
              help="Under torchrun: the model built sharded by FSDP2 (cptune.models.build_model), trained through "
                   "the Trainer's fsdp arguments (else whole on every rank, DDP).")
@click.option("--out", type=options.OutputFile(), default=None,
              help="Write the losses and final parameters here (torch.save).")
def main(**given) -> None:
    train(checked(**given))
    cptune.close_rank()  # after training: its model and meshes dropped, the groups are freed now, not at teardown


def checked(model, model_overrides, recipe_path, plain, replicas, fsdp, **rest) -> SimpleNamespace:
    """Every option read and checked together, before any rank starts or a model is built."""
    if replicas is not None and not plain:
        raise ValidationError([Problem("replicas", "is read only with --plain (under torchrun the recipe's dp "
                                       "replicas are the ranks')", "add --plain, or drop --replicas")])
    recipe = options.read_recipe(recipe_path)
    from cptune.hf import trainer_problems

    raise_if(trainer_problems(recipe.config if recipe else None))
    path = model or (recipe.workload.model if recipe else None)
    if path is None:
        raise ValidationError([Problem("model", "no model given", "give --model PATH, or a recipe from cptune "
                                       "search --model")])
    overrides = models.parse_overrides(model_overrides) if model_overrides else (
        recipe.workload.model_overrides if recipe else None)
    config = models.load_config(path, overrides)
    if fsdp and "RANK" in os.environ and not plain:
        import transformers

        from cptune.hf import takes_sharded_models

        if not takes_sharded_models():
            raise ValidationError([Problem("fsdp", f"the Trainer of transformers {transformers.__version__} wraps a "
                                           "model sharded by FSDP2 in DDP", "pip install -U 'transformers>=5' "
                                           "(verified: 5.25), or --no-fsdp (the model whole on every rank, DDP)")])
    return SimpleNamespace(**rest, recipe=recipe, plain=plain, replicas=replicas or 1, fsdp=fsdp, config=config)


preflight = script_check(main, checked)  # cptune launch runs these checks once, before torchrun starts any rank


def train(args: SimpleNamespace) -> None:
    import transformers

    Sequential = _sequential_trainer()
    if "RANK" not in os.environ:
        torch.set_num_threads(1)
    recipe, config = args.recipe, args.config
    fsdp_mesh, device = None, "cpu"
    if "RANK" in os.environ and args.fsdp:  # sharded as it is built: no rank holds the whole model
        from torch.distributed.device_mesh import init_device_mesh

        device, world, _ = cptune.init_rank()
        fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
    model = models.build_model(config, device if fsdp_mesh is not None else "cpu", fsdp_mesh=fsdp_mesh)
    dataset = Documents(64, config.get_text_config().vocab_size, args.unpacked)
    collator = transformers.default_data_collator if args.unpacked else transformers.DataCollatorWithFlattening()
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant",
        per_device_train_batch_size=args.per_device_batch * (args.replicas if args.plain else 1),
        gradient_accumulation_steps=args.grad_accum, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0, dataloader_drop_last=True, remove_unused_columns=False,
        disable_tqdm=True)
    kwargs = dict(model=model, args=training, train_dataset=dataset, data_collator=collator)
    # in order, so that one process reads the batches the replicas read (all of them at once)
    trainer = Sequential(**kwargs) if args.plain else cptune.hf.Trainer(**kwargs, recipe=recipe, shuffle=False)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # whole tensors (gathered from the shards: every rank takes part)
    params = {k: getattr(v, "full_tensor", v.detach)().detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]  # this rank's peak RSS (Linux: KiB)
    if torch.distributed.is_initialized():
        peaks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if trainer.is_world_process_zero():
        print("losses", " ".join(f"{x:.6f}" for x in losses))
        print("peak per rank", " ".join(f"{b / 2**20:.0f}MiB" for b in peaks), "sharded" if fsdp_mesh else "whole")
        if args.out:
            torch.save({"losses": losses, "params": params, "dp": getattr(trainer, "dp", 1),
                        "cp": getattr(trainer, "cp", 1), "cp_steps": getattr(trainer, "cp_steps", 0), "peaks": peaks,
                        "sharded": fsdp_mesh is not None}, args.out)
            print(json.dumps({"written": args.out}))


if __name__ == "__main__":
    main()
