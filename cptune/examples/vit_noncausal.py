"""Non-causal context parallelism over image-patch tokens: a small ViT-style denoiser.

    python examples/vit_noncausal.py                                          # one process
    torchrun --standalone --nnodes=1 --nproc-per-node=2 examples/vit_noncausal.py

A 256x256 image cut into 8x8 patches is a sequence of 1024 tokens; every patch attends to
every other (non-causal SDPA). The model learns to remove noise from each patch, so the
loss is a per-token mean and each rank can compute it on its own patches. The step is
wrapped by ``cptune.context_parallel(..., causal=False)``, which shards the patches and their
positions over the ranks; a recipe ($CPTUNE_RECIPE or --recipe) can choose the
configuration. With the same seed, each step's loss equals the single-process run's
(float32: within 1e-5; ``--losses-out`` writes them).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import click
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cptune
from cptune.cli import script_check
from cptune.errors import Problem, ValidationError
from cptune.examples import _options as options


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v)  # non-causal: every patch sees every patch
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class PatchDenoiser(nn.Module):
    def __init__(self, patch_dim: int = 192, dim: int = 64, depth: int = 2, heads: int = 4, max_patches: int = 4096):
        super().__init__()
        self.embed, self.pos = nn.Linear(patch_dim, dim), nn.Embedding(max_patches, dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(depth))
        self.out = nn.Linear(dim, patch_dim)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def denoise_loss(model: nn.Module, noisy: torch.Tensor, clean: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(noisy, positions), clean)


def make_images(step: int, batch: int, size: int, patch: int, device: torch.device):
    """Smooth random images (sums of sinusoids), cut into patches: (B, N, 3*patch*patch)."""
    gen = torch.Generator().manual_seed(500 + step)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    freq = torch.rand(batch, 3, 2, generator=gen) * 8
    images = torch.sin(freq[..., 0, None, None] * xx * 6.28 + freq[..., 1, None, None] * yy * 6.28)
    patches = images.unfold(2, patch, patch).unfold(3, patch, patch)  # B, 3, H/p, W/p, p, p
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(batch, -1, 3 * patch * patch)
    noisy = patches + 0.3 * torch.randn(patches.shape, generator=gen)
    positions = torch.arange(patches.shape[1]).expand(batch, -1)
    return noisy.to(device), patches.to(device), positions.to(device)


@click.command(cls=options.Script, help=__doc__.split("\n")[0])
@options.recipe
@options.steps(3)
@click.option("--image-size", type=options.COUNT, default=256, show_default=True, help="Image side in pixels.")
@click.option("--patch", type=options.COUNT, default=8, show_default=True,
              help="Patch side in pixels (divides --image-size).")
@options.losses_out
def main(**given) -> None:
    train(checked(**given))
    cptune.close_rank()  # after training: its model and meshes dropped, the groups are freed now, not at teardown


def checked(recipe_path, image_size, patch, **rest) -> SimpleNamespace:
    """Every option read and checked together, before any rank starts or a model is built."""
    if image_size % patch:
        raise ValidationError([Problem("patch", f"{patch} does not divide --image-size {image_size}",
                                       f"give a patch side that divides {image_size}, e.g. 8")])
    recipe = options.read_recipe(recipe_path)
    options.no_experts(recipe.config if recipe else None)
    return SimpleNamespace(**rest, recipe=recipe, image_size=image_size, patch=patch,
                           config=None if recipe else cptune.CPConfig())  # default: every rank does CP


preflight = script_check(main, checked)  # cptune launch runs these checks once, before torchrun starts any rank


def train(args: SimpleNamespace) -> None:
    distributed = "RANK" in os.environ
    device, world, rank = cptune.init_rank()  # under torchrun: the process group joined
    recipe, config = args.recipe, args.config

    torch.manual_seed(0)
    model = PatchDenoiser(patch_dim=3 * args.patch**2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = cptune.context_parallel(seq_dims={"noisy": 1, "clean": 1, "positions": 1}, causal=False,
                                      config=config, recipe=recipe)(denoise_loss)
    losses = []
    for step in range(args.steps):
        noisy, clean, positions = make_images(step, 1, args.image_size, args.patch, device)
        loss = step_fn(model, noisy, clean, positions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        if distributed:  # equal patches per rank: the mean over ranks is the global mean
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            dist.all_reduce(loss)
            loss /= world
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} ({noisy.shape[1]} patch tokens, {world} rank(s))", flush=True)
    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"losses": losses, "world": world}, f)


if __name__ == "__main__":
    main()
