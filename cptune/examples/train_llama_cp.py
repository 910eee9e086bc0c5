"""Train a small Llama-style decoder with context parallelism, configured by a cptune recipe.

    python examples/train_llama_cp.py                                   # one process, the reference
    cptune launch recipes/cpu-2r-s4096-causal.yaml -- --compile --ac selective --fsdp
    CPTUNE_RECIPE=recipes/cpu-2r-s4096-causal.yaml torchrun --standalone --nnodes=1 --nproc-per-node=2 \
        examples/train_llama_cp.py --compile --ac selective --fsdp
    cptune launch r.yaml "config.mesh_shape=[1,1,2,2]" -- examples/train_llama_cp.py --fsdp   # tp2 x cp2, 4 ranks

The model below is plain PyTorch (RMSNorm, rotary positions, causal SDPA with grouped-query
attention, SwiGLU) and knows nothing of distribution. ``parallelize`` applies, in
torchtitan's order (``cptune.parallelize``, the step ``cptune.models.build_model`` takes for
transformers models): context parallelism (nothing to do to the model: the training step runs
inside ``cptune.context_parallel``), tensor parallelism by ``TP_PLAN`` when the recipe's mesh
has a tp dim (sequence parallel on the residual stream), activation checkpointing per block
(``--ac full`` or ``selective``, which keeps the ring attention's output instead of recomputing
it), then ``torch.compile`` per block (``--compile``), then FSDP2 over dp x cp (``--fsdp``;
without it gradients are averaged by hand; tensor parallelism needs it). Labels are shifted over the whole
sequence before sharding (``cptune.shift_labels``) and the loss is normalized over every
rank's tokens (``cptune.num_items_in_batch``), so with the same seed and global batch every
step's loss equals the single-process run's (float32: within 1e-5; ``--losses-out`` writes
them to compare).

Packed documents (``--documents 8``, or the recipe's): each sequence holds several documents,
positions restart at each, no target crosses a boundary, and attention keeps to each document
(``documents=`` in the block). To tune on this model instead of the attention proxy:
    cptune search --workload examples.train_llama_cp:search_step --seq-len 1024 --nproc 2 [--documents 8]
"""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import click
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import cptune
from cptune.cli import script_check
from cptune.errors import Problem, ValidationError, raise_if
from cptune.examples import _options as options


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x: torch.Tensor, position_ids: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x (B, H, S, D) at the given positions (B, S)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = position_ids[:, None, :, None].float() * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.grouped, self.head_dim = kv_heads != heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        return self.wo(att.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w_gate, self.w_up = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w_down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), FeedForward(dim)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))


TP_PLAN = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
           "mlp.w_gate": "colwise", "mlp.w_up": "colwise", "mlp.w_down": "rowwise"}
"""How a block splits over tp ranks (torchtitan's Llama plan): each rank its heads and its share of the MLP."""


class Llama(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with ``labels``, the summed next-token loss instead, in chunks (``cptune.head_loss``):
        the (tokens x vocabulary) logits are never made whole, and under tensor parallelism each tp rank takes its
        share of the vocabulary."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        if labels is None:
            return self.head(self.norm(x))
        return cptune.head_loss(self.norm(x), self.head, labels)

    def get_output_embeddings(self) -> nn.Linear:
        return self.head


def loss_fn(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """This rank's share of the mean next-token loss; ``labels`` come from cptune.shift_labels."""
    return model(input_ids, position_ids, labels) / cptune.num_items_in_batch(labels)


def _keep_matmuls_and_ring(ctx, op, *args, **kwargs):
    keep = op in cptune.RING_ATTENTION_OPS or op == torch.ops.aten.mm.default
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def parallelize(model: Llama, ac: str, compile_blocks: bool, mesh=None) -> Llama:
    """Tensor parallelism by TP_PLAN (a ``mesh`` with tp), activation checkpointing, torch.compile, then FSDP2 over
    ``mesh``'s data dims, per block: ``cptune.parallelize``, in torchtitan's order."""
    def wrap(block: nn.Module) -> nn.Module:
        if ac == "full":
            block = checkpoint_wrapper(block)
        elif ac == "selective":
            block = checkpoint_wrapper(block, context_fn=functools.partial(
                create_selective_checkpoint_contexts, _keep_matmuls_and_ring))
        return torch.compile(block) if compile_blocks else block

    return cptune.parallelize(model, model.blocks, mesh, tp_plan=TP_PLAN, wrap=wrap,
                              keep_shards=ac == "none" and not compile_blocks)


def make_batch(step: int, batch: int, seq_len: int, vocab: int, device: torch.device,
               documents: torch.Tensor | None = None):
    """Synthetic sequences with structure to learn: token t+1 = (token t * 3 + 1) % vocab, with noise.

    Returns input ids, next-token labels (shifted over the whole sequence, before any
    sharding) and positions. With ``documents`` (ids per token, (1, S)), several documents are
    packed in each sequence: positions restart at each one and its last token has no target.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = [torch.randint(0, vocab, (batch, 1), generator=gen)]
    for _ in range(seq_len - 1):
        tokens.append((tokens[-1] * 3 + 1) % vocab)
    seq = torch.cat(tokens, dim=1)
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen), seq)
    labels, positions = cptune.packed_labels_and_positions(seq, documents)
    return seq.to(device), labels.to(device), positions.to(device)


def search_step(workload: cptune.Workload, device: torch.device, layers: int = 2):
    """For ``cptune search --workload examples.train_llama_cp:search_step``: this model's step
    (``layers`` deep, as this script trains it), with the trial's activation checkpointing and compile."""
    torch.manual_seed(0)
    model = Llama(heads=workload.heads, kv_heads=workload.kv_heads or workload.heads,
                  dim=workload.heads * workload.head_dim, layers=layers).to(device)
    model = parallelize(model, workload.ac, workload.compile)  # as the search measures this trial
    input_ids, labels, positions = make_batch(0, workload.batch, workload.seq_len, 256, device,
                                              workload.document_ids())  # the search passes the block the same

    def step(input_ids, labels, position_ids):
        model.zero_grad(set_to_none=True)
        loss_fn(model, input_ids, labels, position_ids).backward()

    return step, [input_ids, labels, positions], [1, 1, 1]


@click.command(cls=options.Script, help=__doc__.split("\n")[0])
@options.recipe
@options.steps(5)
@options.seq_len
@options.batch
@options.lr(3e-3)
@options.losses_out
@options.compile_
@options.ac
@click.option("--fsdp", is_flag=True, help="FSDP2 over dp x cp (a recipe with tensor parallelism needs it).")
@options.documents
def main(**given) -> None:
    train(checked(**given))
    cptune.close_rank()  # after training: its model and meshes dropped, the groups are freed now, not at teardown


def checked(recipe_path, seq_len, batch, compile_, ac, documents, fsdp, **rest) -> SimpleNamespace:
    """Every option read and checked together, before any rank starts or a model is built."""
    recipe = options.read_recipe(recipe_path)
    config = recipe.config if recipe else cptune.CPConfig()
    seq_len = seq_len or (recipe.workload.seq_len if recipe else 1024)
    compile_ = bool(recipe and recipe.workload.compile) if compile_ is None else compile_  # as measured
    ac = ac or (recipe.workload.ac if recipe else "none")
    documents = documents or (recipe.workload.documents if recipe else None)
    ids = cptune.Workload(seq_len=seq_len, documents=documents).document_ids()  # a spec that does not fit: named
    dims, batch = options.mesh_and_batch(config, recipe, batch, tp=True)
    block = Llama().blocks[0]
    raise_if(dims.model_problems(heads=4, kv_heads=2, intermediate=block.mlp.w_up.out_features,
                                 argument="config.mesh_shape") + dims.sequence_problems(seq_len))
    if not dims.is_dp_cp and not fsdp:
        raise ValidationError([Problem("fsdp", f"is off with {dims.label()}: tensor parallelism and HSDP train the "
                                       "model as FSDP2 shards it", "add --fsdp, or use a (dp, cp) recipe")])
    return SimpleNamespace(**rest, recipe=recipe, config=config, seq_len=seq_len, compile=compile_, ac=ac, fsdp=fsdp,
                           documents=documents, document_ids=ids, dims=dims, dp=dims.dp, cp=dims.cp, batch=batch)


preflight = script_check(main, checked)  # cptune launch runs these checks once, before torchrun starts any rank


def train(args: SimpleNamespace) -> None:
    distributed = "RANK" in os.environ
    device, world, rank = cptune.init_rank()  # under torchrun: the process group joined
    recipe, config, seq_len, dp, cp, documents = args.recipe, args.config, args.seq_len, args.dp, args.cp, \
        args.document_ids
    rows = cptune.replica_rows(args.batch, config=config)  # this replica's share of the global batch

    mesh = model_mesh = None
    if distributed:
        mesh = args.dims.device_mesh(device.type)  # ('dp', 'cp'), or the four named dims with tp or HSDP
        if args.fsdp:
            model_mesh = args.dims.model_mesh(device.type)  # tp, and FSDP2 over every dp x cp rank
    torch.manual_seed(0)  # the same initial weights everywhere
    model = parallelize(Llama().to(device), args.ac, args.compile, model_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    @cptune.context_parallel(seq_dims={"input_ids": 1, "labels": 1, "position_ids": 1}, recipe=recipe,
                             mesh=mesh if cp > 1 or not args.dims.is_dp_cp else None, documents="documents")
    def train_step(input_ids, labels, position_ids, documents=None):
        loss = loss_fn(model, input_ids, labels, position_ids)
        loss.backward()  # inside the CP step: checkpointed blocks recompute with the ring
        return loss.detach()

    losses = []
    for step in range(args.steps):
        input_ids, labels, positions = make_batch(step, args.batch, seq_len, 256, device, documents)
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(input_ids[rows], labels[rows], positions[rows], documents)
        if distributed:  # each rank's loss is scaled so that its average over ranks is the global mean
            dist.all_reduce(loss)
            if not args.fsdp:  # FSDP averages gradients itself; by hand: sum, then divide (gloo has no AVG)
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            loss /= world
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if rank == 0:
        extras = f"compile={args.compile} ac={args.ac} fsdp={args.fsdp} documents={args.documents}"
        print(f"world {world} ({args.dims.label()}), seq_len {seq_len}, config: {config.label()}, {extras}")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses, "world": world, "dp": dp, "cp": cp, "tp": args.dims.tp,
                           "config": config.label(),
                           "compile": args.compile, "ac": args.ac, "fsdp": args.fsdp}, f)


if __name__ == "__main__":
    main()
