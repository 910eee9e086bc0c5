"""Small models the training-step tests share. Plain PyTorch: no CP code, as users write them."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import cptune


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out, self.mlp = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, d))
        return x + torch.tanh(self.mlp(x))


def _sac_policy(save_ring: bool):
    save = {torch.ops.aten.mm.default, *(cptune.RING_ATTENTION_OPS + cptune.ULYSSES_OPS if save_ring else ())}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class TwoBlocks(nn.Module):
    """An input projection and two attention blocks; ``ac`` says how the blocks are checkpointed."""

    AC = ("none", "full", "reentrant", "wrapper", "selective", "selective-ring")

    def __init__(self, ac: str = "none", dim: int = 32) -> None:
        super().__init__()
        self.ac = ac
        self.inp = nn.Linear(dim, dim)
        blocks = [Block(dim) for _ in range(2)]
        if ac == "wrapper":
            blocks = [checkpoint_wrapper(b) for b in blocks]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.ac == "full":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.ac == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif self.ac.startswith("selective"):
                x = checkpoint(block, x, use_reentrant=False, context_fn=_sac_policy(self.ac == "selective-ring"))
            else:
                x = block(x)
        return x
