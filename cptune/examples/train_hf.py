"""Train a transformers causal LM with context parallelism, configured by a cptune recipe.

    python examples/train_hf.py --model tests/models/tiny-llama --steps 5          # one process, the reference
    cptune launch recipes/MODEL.yaml -- --steps 20 --data tokens.jsonl             # the recipe's model and data
    CPTUNE_RECIPE=recipes/MODEL.yaml torchrun --standalone --nproc-per-node=2 examples/train_hf.py --steps 20

A recipe from ``cptune search --model PATH`` carries the model (path and overrides), sequence
length, batch per replica, packed documents, activation checkpointing and compile; flags here
override them. The model is built from its ``config.json`` on the meta device and made one
FSDP2-sharded decoder layer at a time (``cptune.models.build_model``: no rank ever holds the
whole model) with random weights, or with ``--weights`` the model directory's safetensors
(``save_pretrained``'s, bf16/fp16 into float32) read straight into each rank's shards; nothing is
downloaded. cptune.hf.enable, AC and compile per decoder layer are applied; trained with AdamW
and a linear LR warm-up. ``--export DIR`` writes the trained model as a Hugging Face folder
(safetensors + config.json, through a temporary folder renamed once whole) that
``AutoModelForCausalLM.from_pretrained`` loads.

Data (``--data``), already tokenized:
  * ``.jsonl``: one document per line, ``{"input_ids": [1, 2, ...]}``;
  * ``.npy``: a 1-D token stream, cut into documents at ``--eos-id``; or 2-D, one document per row.
Documents are packed: concatenated and cut into sequences of ``--seq-len`` (a document cut at a
sequence's end goes on as a new document in the next); positions restart at each document and no
target crosses a boundary, and attention keeps to each document. Without ``--data``: synthetic
documents (``--documents 8``, ``longtail`` or lengths, else one per sequence). Each data-parallel
replica trains on its own rows of the global batch; the CP ranks of a replica share them.

``--checkpoint-dir DIR`` saves model, optimizer, LR schedule and step with
``torch.distributed.checkpoint`` every ``--save-every`` steps (to ``step-N.partial``, renamed to
``step-N`` once every rank has written it, so a crash never leaves a checkpoint that looks whole);
``--resume`` continues from the newest ``step-N``. With the same seed and global batch every step's
loss equals the one-process run's (float32: within 1e-5; ``--losses-out`` writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cptune
from cptune import models


def read_documents(path: str, eos_id: int | None) -> list[torch.Tensor]:
    """Token-id documents from a .jsonl (one {"input_ids": [...]} per line) or a .npy file."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [torch.tensor(json.loads(line)["input_ids"], dtype=torch.long) for line in f if line.strip()]
    if path.endswith(".npy"):
        import numpy as np

        array = torch.from_numpy(np.load(path)).long()
        if array.ndim == 2:
            return list(array)
        if eos_id is None:
            return [array]
        ends = (array == eos_id).nonzero().flatten().tolist()
        return [d for d in torch.tensor_split(array, [e + 1 for e in ends]) if len(d)]
    raise SystemExit(f"--data {path}: give a .jsonl or .npy file of token ids")


def synthetic_documents(count: int, lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Documents with structure to learn: token t+1 = (3 * token t + 1) % vocab, 10 % noise."""
    gen, docs = torch.Generator().manual_seed(seed), []
    for i in range(count):
        n = lengths[i % len(lengths)]
        seq = [int(torch.randint(0, vocab, (1,), generator=gen))]
        for _ in range(n - 1):
            seq.append((seq[-1] * 3 + 1) % vocab)
        noise = torch.rand(n, generator=gen) < 0.1
        docs.append(torch.where(noise, torch.randint(0, vocab, (n,), generator=gen), torch.tensor(seq)))
    return docs


def pack(documents: list[torch.Tensor], seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` sequences of ``seq_len`` tokens and their document ids, cycling over the documents."""
    if not documents or not sum(len(d) for d in documents):
        raise SystemExit("no tokens to train on")
    tokens, ids, doc, i = [], [], 0, 0
    while len(tokens) < count * seq_len:
        d = documents[i % len(documents)]
        tokens += d.tolist()
        ids += [doc] * len(d)
        doc, i = doc + 1, i + 1
    tokens, ids = torch.tensor(tokens[: count * seq_len]), torch.tensor(ids[: count * seq_len])
    return tokens.view(count, seq_len), ids.view(count, seq_len)


def checkpoints(folder: Path) -> list[Path]:
    return sorted((p for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))


def save(folder: Path, step: int, model, optimizer, scheduler, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    partial, final = folder / f"step-{step}.partial", folder / f"step-{step}"
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial))
    if rank == 0:
        (partial / "trainer.json").write_text(json.dumps({"step": step, "scheduler": scheduler.state_dict()}))
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are written
    if rank == 0:
        os.replace(partial, final)


def resume(folder: Path, model, optimizer, scheduler) -> int:
    """Load the newest whole checkpoint; the step to start from (0 without one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = checkpoints(folder)
    if not found:
        return 0
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(found[-1]))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = json.loads((found[-1] / "trainer.json").read_text())
    scheduler.load_state_dict(trainer["scheduler"])
    return trainer["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=None, help="Recipe file (default: $CPTUNE_RECIPE, else no CP)")
    parser.add_argument("--model", default=None, help="Model directory or config.json (default: the recipe's)")
    parser.add_argument("--model-override", action="append", default=None, metavar="KEY=VALUE",
                        help="Change the model's config (repeatable; default: the recipe's)")
    parser.add_argument("--weights", action="store_true", help="Load weights from the --model directory")
    parser.add_argument("--data", default=None, help=".jsonl or .npy of token ids (default: synthetic)")
    parser.add_argument("--eos-id", type=int, default=None, help="Token ending a document in a 1-D .npy")
    parser.add_argument("--documents", default=None, metavar="SPEC",
                        help="Synthetic documents per sequence: 8 (equal), longtail, or lengths (default: the "
                             "recipe's, else one per sequence)")
    parser.add_argument("--seq-len", type=int, default=None, help="Default: the recipe's, else 256")
    parser.add_argument("--batch", type=int, default=None,
                        help="Global batch, split over dp replicas (default: as the recipe was measured, else 2)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2, help="Steps of linear LR warm-up")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default=None,
                        help="Activation checkpointing (default: as the recipe was measured, else none)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each decoder layer (default: as the recipe was measured)")
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                        help="FSDP2 over every rank when launched on several (else gradients averaged by hand)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--save-every", type=int, default=0, help="Save every N steps (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint")
    parser.add_argument("--losses-out", default=None, help="Write the per-step losses here (JSON)")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="After training, write the model as a Hugging Face folder (safetensors + config.json) "
                             "that from_pretrained loads; DIR must not exist")
    parser.add_argument("--export-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the exported weights (default: float32, the master weights)")
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    device, world, rank = cptune.init_rank()  # under torchrun: the process group joined

    recipe_path = args.recipe or os.environ.get("CPTUNE_RECIPE")
    recipe = cptune.load_recipe(recipe_path) if recipe_path else None
    w = recipe.workload if recipe else cptune.Workload(seq_len=256, batch=2)
    config = recipe.config if recipe else cptune.CPConfig()
    dp, cp = config.resolve_mesh_shape(world)
    path = args.model or w.model
    if path is None:
        raise SystemExit("give --model PATH (a model directory or config.json), or a recipe from cptune search --model")
    overrides = models.parse_overrides(args.model_override) if args.model_override is not None \
        else dict(w.model_overrides or {})
    seq_len = args.seq_len or w.seq_len
    batch = args.batch or (dp * w.batch if recipe else 2)
    ac = args.ac or w.ac
    compile_ = w.compile if args.compile is None else args.compile
    spec = args.documents or w.documents

    hf_config = models.load_config(path, overrides)
    export = models.check_export(args.export, "--export") if args.export else None  # refused before any training
    fsdp_mesh = None
    if distributed and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
    # on the meta device, then one sharded layer at a time: no rank holds the whole model; the same weights at
    # any world size (seeded per layer), or the --model folder's safetensors read into each rank's shards
    model = models.build_model(hf_config, device, weights=path if args.weights else None, fsdp_mesh=fsdp_mesh,
                               ac=ac, compile=compile_)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))

    vocab = hf_config.get_text_config().vocab_size
    if args.data:
        documents = read_documents(args.data, args.eos_id)
    else:
        packed = cptune.Workload(seq_len=seq_len, documents=spec).document_ids()  # (1, S), or None: unpacked
        sizes = torch.unique_consecutive(packed[0], return_counts=True)[1].tolist() if spec else [seq_len]
        documents = synthetic_documents(len(sizes) * batch * args.steps, sizes, vocab)
    tokens, doc_ids = pack(documents, seq_len, batch * args.steps)
    rows = cptune.replica_rows(batch, config=config)
    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    start = resume(folder, model, optimizer, scheduler) if folder and args.resume else 0

    losses = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        ids, docs = tokens[step * batch:(step + 1) * batch][rows], doc_ids[step * batch:(step + 1) * batch][rows]
        labels, positions = cptune.packed_labels_and_positions(ids, docs)
        ids, labels, positions, docs = (t.to(device) for t in (ids, labels, positions, docs))
        packed = world > 1 and bool((docs[:, -1] != docs[:, 0]).any())  # else: one document per row, plain causal
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=config,
                                     documents=docs if packed else None):
            loss = model(input_ids=ids, position_ids=positions, shift_labels=labels, use_cache=False).loss
            loss.backward()  # inside the block: checkpointed layers recompute with CP attention
        loss = loss.detach()
        if distributed:  # each rank's loss is scaled so that its average over ranks is the global mean
            dist.all_reduce(loss)
            if fsdp_mesh is None:  # FSDP averages gradients itself; by hand: sum, then divide (gloo has no AVG)
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            loss /= world
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} tokens/s {batch * seq_len / seconds:,.0f}", flush=True)
        if folder and (step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
            save(folder, step + 1, model, optimizer, scheduler, rank)
    peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]  # this rank's peak RSS (Linux: KiB)
    if distributed:
        peaks = [None] * world
        dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        print(f"world {world} (dp {dp} x cp {cp}), seq_len {seq_len}, batch {batch}, config: {config.label()}, "
              f"ac={ac} compile={compile_} fsdp={fsdp_mesh is not None} documents={spec or args.data or 'none'}")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses, "start": start, "world": world, "dp": dp, "cp": cp, "peaks": peaks}, f)
    if export is not None:
        models.export_model(model, export, dtype=getattr(torch, args.export_dtype))
        if rank == 0:
            print(f"exported to {export}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except cptune.CPTuneError as exc:  # what the user gave (a model, weights, an export folder): the named error
        raise SystemExit(str(exc)) from None
    cptune.close_rank()  # after main: its model and meshes dropped, the groups are freed now, not at teardown
