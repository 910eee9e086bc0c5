"""``cptune.hf.Trainer``: transformers' Trainer with each training step inside a cptune block.

::

    trainer = cptune.hf.Trainer(model=model, args=args, train_dataset=dataset, recipe="recipes/x.yaml")
    trainer.train()        # torchrun --nproc-per-node=N train.py, or cptune launch recipes/x.yaml

What it changes, and why (each a way CP training is silently wrong otherwise):

* the model is prepared with :func:`cptune.hf.enable`;
* **data**: each dp replica reads its own batches and every CP rank of a replica the same ones
  (a sampler over the dp replicas, ``rank // cp``, that accelerate does not shard again);
* **labels** are shifted over the whole sequence before sharding (``shift_labels`` from the batch
  if the collator made them), ``position_ids`` are the whole sequence's (made if the batch has
  none), and packed batches (``DataCollatorWithFlattening``: positions restarting at each
  document) keep attention inside each document, balanced by work;
* **the loss divisor** (``num_items_in_batch``) counts each valid target once over every replica
  and gradient-accumulation step, so the loss and gradients are the one-process run's;
* refused with the fix: a padding ``attention_mask`` (pack instead), ``labels`` longer than the
  tokens.

The config comes from ``config=`` / ``recipe=``, else ``$CPTUNE_RECIPE``, else cptune's default
(all ranks CP).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler

from ._enable import enable
from ._lm_loss import causal_lm_loss
from ..attention import packed_documents
from ..losses import IGNORE_INDEX, shift_labels
from ..config import ConfigLike
from ..context import config_for, context_parallel, replica
from ..mixers import cp_problems
from ..errors import Problem, raise_if


class _ReplicaLoader(DataLoader):
    def set_epoch(self, epoch: int) -> None:  # the Trainer calls it each epoch: a new shuffle, the same on a replica
        self.sampler.set_epoch(epoch)


def _targets(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's next-token targets over whole sequences (what the loss counts)."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    return shift_labels(batch["labels"] if batch.get("labels") is not None else batch["input_ids"])


def _adopt_sharded(model: Any) -> None:
    """A model FSDP2 sharded as cptune built it (``cptune.models.build_model(..., fsdp_mesh=...)``) goes through the
    Trainer's path for models sharded at load time: no DDP around it, not sharded again, its gradients reduced
    by FSDP2 (deferred to the last micro-batch of an accumulation), the optimizer made over the shards."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    raise_if([] if takes_sharded_models() else [
        Problem("model", f"is sharded by FSDP2, which the Trainer of transformers {transformers.__version__} "
                "would wrap in DDP", "pip install -U 'transformers>=5' (verified: 5.25), or build the model whole "
                "(cptune.models.build_model without fsdp_mesh)")])
    model._is_distributed_loading_by_transformers = True


def takes_sharded_models() -> bool:
    """Whether this transformers' Trainer trains a model sharded at load time as it is (5.x: found by the
    attribute it reads, not by version); before, it wraps any model in DDP."""
    return hasattr(transformers.PreTrainedModel, "is_distributed_loading_by_transformers")


def trainer_problems(config: Any) -> list[Problem]:
    """What :class:`Trainer` cannot run of a configuration (a :class:`cptune.CPConfig`): expert parallelism."""
    if config is not None and config.ep_degree > 1:
        return [Problem("config.ep_degree", f"is {config.ep_degree} with cptune.hf.Trainer, which does not split "
                        "experts yet", "train with expert parallelism through cptune.examples.train_hf, or use "
                        "config.ep_degree=1")]
    return []


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training steps run under context parallelism (see the module)."""

    def __init__(self, *args: Any, config: ConfigLike = None, recipe: Any = None, shuffle: bool | None = None,
                 **kwargs: Any) -> None:
        """``shuffle``: whether each epoch's order is shuffled (the same on a replica's CP ranks); None: unless
        ``args.train_sampling_strategy`` is "sequential"."""
        _adopt_sharded(kwargs.get("model", args[0] if args else None))
        raise_if(trainer_problems(config_for(config, recipe)))
        config_for(config, recipe).dp_cp(dist.get_world_size() if dist.is_initialized() else 1,
                                         where="cptune.hf.Trainer splits no model by tensor parallelism; it runs")
        super().__init__(*args, **kwargs)
        self.cp_config, self.cp_recipe, self.cp_shuffle = config, recipe, shuffle
        self.dp, self.cp, self.replica = replica(config=config, recipe=recipe)
        self.cp_steps = 0  # micro-batches run sharded over more than one CP rank
        enable(self.model)
        # layers that mix tokens outside attention: refused here, before any step (the block would at the first)
        raise_if(cp_problems(type(self.model).__name__, self.model._cptune_mixers, self.cp, "config.mesh_shape"))

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """A micro-batch before the last of an accumulation: FSDP2 keeps its gradients to reduce with the last."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def get_train_dataloader(self) -> DataLoader:
        """This replica's batches: the same on each of its CP ranks, other rows on other replicas."""
        raise_if([] if self.train_dataset is not None else [Problem("train_dataset", "is None", "give one")])
        sampler = DistributedSampler(self.train_dataset, num_replicas=self.dp, rank=self.replica,
                                     shuffle=self.cp_shuffle if self.cp_shuffle is not None else
                                     getattr(self.args, "train_sampling_strategy", "random") != "sequential",
                                     seed=self.args.seed, drop_last=self.args.dataloader_drop_last)
        return _ReplicaLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                              collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last,
                              num_workers=self.args.dataloader_num_workers)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The batches of one optimizer step and their valid targets over every replica (each counted once)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        count = torch.tensor(float(sum(int(_targets(b).ne(IGNORE_INDEX).sum()) for b in batches)))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
            count /= self.cp  # a replica's CP ranks hold the same batch
        return batches, count.to(device)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = dict(self._prepare_inputs(inputs))
        ids = inputs.pop("input_ids")
        labels = _targets({**inputs, "input_ids": ids})
        inputs.pop("labels", None), inputs.pop("shift_labels", None)
        mask = inputs.pop("attention_mask", None)
        raise_if([Problem("attention_mask", "masks some tokens (a padding collator), which CP training does not "
                          "apply", "pack instead: transformers.DataCollatorWithFlattening (position_ids restart at "
                          "each document, no attention_mask)")] if mask is not None and not bool(mask.all()) else [])
        positions = inputs.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        positions = positions.contiguous()  # a buffer is sharded in place: the model gets this very tensor
        documents = packed_documents(positions)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if num_items_in_batch is None:  # a caller other than the training loop: this batch alone
            num_items_in_batch = self.get_batch_samples(iter([{"input_ids": ids, "shift_labels": labels}]), 1,
                                                        ids.device)[1]
        with context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1],
                              config=self.cp_config, recipe=self.cp_recipe, documents=documents) as block:
            self.cp_steps += block.cp_size > 1
            loss = causal_lm_loss(model, ids, labels, num_items_in_batch=num_items_in_batch / world,
                                  position_ids=positions, **inputs)  # without the whole logits
            self.accelerator.backward(loss)  # inside the block: checkpointed layers recompute with CP attention
        return loss.detach()
