"""Train a transformers causal LM with context parallelism, configured by a cptune recipe.

    python examples/train_hf.py --model tests/models/tiny-llama --steps 5          # one process, the reference
    cptune launch recipes/MODEL.yaml -- --steps 20 --data tokens.jsonl             # the recipe's model and data
    CPTUNE_RECIPE=recipes/MODEL.yaml torchrun --standalone --nproc-per-node=2 examples/train_hf.py --steps 20

A recipe from ``cptune search --model PATH`` carries the model (path and overrides), sequence
length, batch per replica, packed documents, activation checkpointing, compile and the loss
(``--loss``: chunked, never the whole logits and vocabulary-parallel under tp, or the model's own
from the whole logits); flags here override them. The model is built from its ``config.json`` on the meta device and made one
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

import functools
import json
import os
import resource
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import click
import torch
import torch.distributed as dist

import cptune
import cptune.hf
import cptune.experts
from cptune import models
from cptune.cli import script_check
from cptune.errors import Problem, ValidationError, raise_if
from cptune.examples import _options as options
from cptune.hf import causal_lm_loss
from cptune.workload import LOSS_MODES


def read_documents(path: str, eos_id: int | None, vocab: int) -> list[torch.Tensor]:
    """Token-id documents from a .jsonl (one {"input_ids": [...]} per line) or a .npy file, each checked: ids are
    integers in [0, vocab), and there is at least one token. A file that does not read is named with its line."""
    problem = functools.partial(Problem, "data")
    if path.endswith(".jsonl"):
        documents = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ids = json.loads(line)["input_ids"]
                    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in ids)):
                        raise TypeError("input_ids is not a list of integers")
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    what = "not JSON" if isinstance(exc, json.JSONDecodeError) else \
                        "no input_ids" if isinstance(exc, KeyError) else str(exc)
                    raise ValidationError([problem(f"{path}, line {number}: {what}", 'give one {"input_ids": '
                                                   '[1, 2, ...]} per line')]) from None
                documents.append(torch.tensor(ids, dtype=torch.long))
    elif path.endswith(".npy"):
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValidationError([problem(f"{path}: not a .npy array ({str(exc).splitlines()[0][:120]})",
                                           "save the token ids with numpy.save")]) from None
        if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
            raise ValidationError([problem(f"{path}: a {array.ndim}-D array of {array.dtype}", "give a 1-D token "
                                           "stream or a 2-D array of documents, of integer token ids")])
        array = torch.from_numpy(array.astype(np.int64))
        if array.ndim == 2:
            documents = list(array)
        elif eos_id is None:
            documents = [array]
        else:
            ends = (array == eos_id).nonzero().flatten().tolist()
            documents = [d for d in torch.tensor_split(array, [e + 1 for e in ends]) if len(d)]
    else:
        raise ValidationError([problem(f"{path}: neither .jsonl nor .npy", "give a .jsonl or .npy file of token "
                                       "ids")])
    if not sum(len(d) for d in documents):
        raise ValidationError([problem(f"{path}: no tokens in it", "give a file with at least one document")])
    low, high = min(int(d.min()) for d in documents if len(d)), max(int(d.max()) for d in documents if len(d))
    if low < 0 or high >= vocab:
        raise ValidationError([problem(f"{path}: token ids from {low} to {high}, the model's vocabulary is [0, "
                                       f"{vocab})", "tokenize with the model's tokenizer, or give a model whose "
                                       "vocab_size holds these ids")])
    return documents


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


def save(folder: Path, step: int, model, optimizer, scheduler, rank: int, ep: int = 1) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    partial, final = folder / f"step-{step}.partial", folder / f"step-{step}"
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash
    # each ep group's experts under names of their own (one name on two groups' ranks would be one tensor)
    model_state, optim_state = cptune.experts.renamed(*get_state_dict(model, optimizer),
                                                      cptune.experts.saved_names(model))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial))
    if rank == 0:
        (partial / "trainer.json").write_text(json.dumps({"step": step, "scheduler": scheduler.state_dict(),
                                                          "ep": ep}))
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
    names = cptune.experts.saved_names(model)
    model_state, optim_state = cptune.experts.renamed(*get_state_dict(model, optimizer), names)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(found[-1]))
    model_state, optim_state = cptune.experts.renamed(state["model"], state["optim"], {v: k for k, v in names.items()})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    trainer = json.loads((found[-1] / "trainer.json").read_text())
    scheduler.load_state_dict(trainer["scheduler"])
    return trainer["step"]


@click.command(cls=options.Script, help=__doc__.split("\n")[0])
@options.recipe
@options.model
@options.model_override
@click.option("--weights", is_flag=True, help="Load weights from the --model directory (its safetensors).")
@click.option("--data", type=options.InputFile(fix="give a .jsonl or .npy file of token ids"), default=None,
              help=".jsonl or .npy of token ids (default: synthetic).")
@click.option("--eos-id", type=options.Whole(0), default=None, help="Token ending a document in a 1-D .npy.")
@options.documents
@options.video
@options.seq_len
@options.batch
@options.steps(5)
@options.lr(1e-3)
@click.option("--warmup", type=options.Whole(0), default=2, show_default=True, help="Steps of linear LR warm-up.")
@options.ac
@options.compile_
@click.option("--loss", type=options.OneOf(list(LOSS_MODES)), default=None,
              help="The loss in chunks, never the whole logits (vocabulary-parallel under tp), or the model's own "
                   "from the whole logits [default: the recipe's, else chunked].")
@click.option("--check", type=options.OneOf(["auto", "always", "never"]), default="auto", show_default=True,
              help="cptune's first-step check, up front: the model run as one process and split over cp, outputs and "
                   "gradients compared (auto: a family the support matrix has not proven).")
@click.option("--check-tokens", type=options.COUNT, default=None,
              help="The check's sequence length [default: twice the longest reach the config states, within 4096].")
@click.option("--fsdp/--no-fsdp", default=True, show_default=True,
              help="FSDP2 over every rank when launched on several (else gradients averaged by hand).")
@click.option("--checkpoint-dir", type=options.FOLDER, default=None, help="Save checkpoints here (DCP).")
@click.option("--save-every", type=options.Whole(0), default=0, show_default=True,
              help="Save every N steps (0: at the end).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --checkpoint-dir.")
@options.losses_out
@click.option("--export", type=options.FOLDER, default=None, metavar="DIR",
              help="After training, write the model as a Hugging Face folder (safetensors + config.json) that "
                   "from_pretrained loads; DIR must not exist.")
@click.option("--export-dtype", type=options.OneOf(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True,
              help="dtype of the exported weights.")
def main(**given) -> None:
    train(checked(**given))
    cptune.close_rank()  # after training: its model and meshes dropped, the groups are freed now, not at teardown


def checked(recipe_path, model, model_overrides, weights, data, eos_id, documents, video, seq_len, batch, ac, compile_,
            loss, checkpoint_dir, resume, save_every, export, **rest) -> SimpleNamespace:
    """Every option read and checked together, before any rank starts or a model is built."""
    recipe = options.read_recipe(recipe_path)
    w = recipe.workload if recipe else cptune.Workload(seq_len=256, batch=2)
    config = recipe.config if recipe else cptune.CPConfig()
    dims, batch = options.mesh_and_batch(config, recipe, batch, tp=True, ep=True)
    path = model or w.model
    if path is None:
        raise ValidationError([Problem("model", "no model given", "give --model PATH (a model directory or "
                                       "config.json), or a recipe from cptune search --model")])
    overrides = models.parse_overrides(model_overrides) if model_overrides else dict(w.model_overrides or {})
    hf_config = models.load_config(path, overrides)
    # cp over token mixers, tp by the plan, Ulysses over each tp rank's heads
    raise_if(models.mesh_problems(hf_config, dims, "config.mesh_shape", ulysses=config.degrees(dims.cp)[0]))
    if not dims.is_dp_cp and not rest["fsdp"]:
        raise ValidationError([Problem("fsdp", f"is off with {dims.label()}: tensor parallelism and HSDP train the "
                                       "model as FSDP2 shards it", "drop --no-fsdp, or use a (dp, cp) recipe")])
    seq_len, ac = seq_len or w.seq_len, ac or w.ac
    compile_ = w.compile if compile_ is None else compile_
    spec, video = documents or w.documents, video or w.video
    # a documents spec that does not fit the length, a video without a model or with documents: named
    video = cptune.Workload(seq_len=seq_len, documents=spec, model=str(path), video=video).video_grid
    raise_if([Problem("data", "is given with --video", "train a video model on its synthetic rows (no --data)")]
             if video and data else [])
    raise_if(dims.sequence_problems(seq_len, "seq_len") + models.training_problems(ac, compile_, hf_config,
                                                                                    dims.ep if rest["fsdp"] else 1))
    options.check_checkpointing(checkpoint_dir, resume, save_every)
    newest = checkpoints(Path(checkpoint_dir))[-1:] if resume and checkpoint_dir else []
    saved = json.loads((newest[0] / "trainer.json").read_text()).get("ep", 1) if newest else dims.ep
    raise_if([Problem("resume", f"the newest checkpoint in {checkpoint_dir} ({newest[0].name}) keeps its experts "
                      f"split over ep {saved}, and this run's ep is {dims.ep}", f"resume with config.ep_degree={saved} "
                      "(a checkpoint names each ep group's experts)")] if saved != dims.ep else [])
    if eos_id is not None and not (data or "").endswith(".npy"):
        raise ValidationError([Problem("eos_id", "is read only from a 1-D .npy --data", "drop --eos-id, or give "
                                       "--data as a .npy token stream")])
    if weights:
        models.check_weights(hf_config, path)
    vocab = hf_config.get_text_config().vocab_size
    return SimpleNamespace(
        **rest, recipe=recipe, config=config, dims=dims, dp=dims.dp, cp=dims.cp, batch=batch, path=path,
        hf_config=hf_config,
        weights=weights, seq_len=seq_len, video=video, ac=ac, compile=compile_, loss=loss or w.loss, spec=spec, vocab=vocab, data=data,
        documents=read_documents(data, eos_id, vocab) if data else None, resume=resume, save_every=save_every,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
        export=models.check_export(export, "export") if export else None)


preflight = script_check(main, checked)  # cptune launch runs these checks once, before torchrun starts any rank


def step_rows(args: SimpleNamespace, model, tokens, doc_ids, step: int, rows: slice):
    """This replica's rows of a step's global batch: (ids, shifted labels, positions, document ids or None, the
    model's video arguments); a video model's rows made for the step (seeded by it, the same at any world size)."""
    batch = args.batch
    if args.video:
        ids, labels, positions, video = cptune.hf.video_batch(model, args.seq_len, batch, args.video, seed=step)
        per = video["pixel_values_videos"].shape[0] // batch
        video = {"pixel_values_videos": video["pixel_values_videos"][rows.start * per:rows.stop * per],
                 "video_grid_thw": video["video_grid_thw"][rows]}
        return ids[rows], labels[rows], positions[:, rows], None, video
    ids, docs = tokens[step * batch:(step + 1) * batch][rows], doc_ids[step * batch:(step + 1) * batch][rows]
    labels, positions = cptune.packed_labels_and_positions(ids, docs)
    return ids, labels, positions, docs, {}


def train(args: SimpleNamespace) -> None:
    distributed = "RANK" in os.environ
    device, world, rank = cptune.init_rank()  # under torchrun: the process group joined
    config, dp, cp, batch, seq_len = args.config, args.dp, args.cp, args.batch, args.seq_len
    # tp by the model's own plan, FSDP2 over every dp_shard x cp rank, HSDP over dp_replicate
    fsdp_mesh = args.dims.model_mesh(device.type) if distributed and args.fsdp else None
    # on the meta device, then one sharded layer at a time: no rank holds the whole model; the same weights at
    # any world size (seeded per layer), or the --model folder's safetensors read into each rank's shards
    model = models.build_model(args.hf_config, device, weights=args.path if args.weights else None,
                               fsdp_mesh=fsdp_mesh, ac=args.ac, compile=args.compile, cp=cp, ep=args.dims.ep)
    cptune.hf.enable(model, check=args.check, check_tokens=args.check_tokens)
    report = cptune.hf.check(model, config=config, packed=bool(args.spec or args.data), seq_len=seq_len)
    if report is not None and rank == 0:  # else a family the matrix has proven (or --check never)
        print(report.line(), flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))

    documents = args.documents
    if args.video:  # one video a row: the step's rows made at each step (below)
        documents = []
    elif documents is None:
        packed = cptune.Workload(seq_len=seq_len, documents=args.spec).document_ids()  # (1, S), or None: unpacked
        sizes = torch.unique_consecutive(packed[0], return_counts=True)[1].tolist() if args.spec else [seq_len]
        documents = synthetic_documents(len(sizes) * batch * args.steps, sizes, args.vocab)
    tokens, doc_ids = pack(documents, seq_len, batch * args.steps) if documents else (None, None)
    rows = cptune.replica_rows(batch, config=config)
    folder = args.checkpoint_dir
    start = resume(folder, model, optimizer, scheduler) if folder and args.resume else 0
    if args.resume and not start and rank == 0:
        print(f"--resume: no step-N checkpoint in {folder}: starting at step 0", flush=True)

    losses = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        ids, labels, positions, docs, video = step_rows(args, model, tokens, doc_ids, step, rows)
        ids, labels, positions, docs = (t.to(device) if t is not None else None for t in (ids, labels, positions, docs))
        video = {k: v.to(device) for k, v in video.items()}
        packed = world > 1 and docs is not None and bool((docs[:, -1] != docs[:, 0]).any())  # else: plain causal
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, positions.ndim - 1],
                                     config=config, documents=docs if packed else None):
            loss = causal_lm_loss(model, ids, labels, position_ids=positions, whole=args.loss == "whole", **video)
            loss.backward()  # inside the block: checkpointed layers recompute with CP attention
        loss = loss.detach()
        if distributed:  # each rank's loss is scaled so that its average over ranks is the global mean
            dist.all_reduce(loss)
            if fsdp_mesh is None:  # FSDP averages gradients itself; by hand: sum, then divide (gloo has no AVG)
                split = cptune.experts.ep_parameters(model)  # each rank's own experts: over their replicas
                for name, p in model.named_parameters():
                    if name not in split and p.grad is not None:  # (a tower without images: no gradient anywhere)
                        dist.all_reduce(p.grad)
                        p.grad /= world
                cptune.experts.average_gradients(model)
            loss /= world
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} tokens/s {batch * seq_len / seconds:,.0f}", flush=True)
        if folder and (step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
            save(folder, step + 1, model, optimizer, scheduler, rank, args.dims.ep)
    peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]  # this rank's peak RSS (Linux: KiB)
    if distributed:
        peaks = [None] * world
        dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        print(f"world {world} ({args.dims.label()}), seq_len {seq_len}, batch {batch}, config: {config.label()}, "
              f"ac={args.ac} compile={args.compile} fsdp={fsdp_mesh is not None} loss={model._cptune_loss_path} "
              f"documents={args.spec or args.data or 'none'}")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses, "start": start, "world": world, "dp": dp, "cp": cp, "peaks": peaks,
                           "loss": model._cptune_loss_path}, f)
    if args.export is not None:
        models.export_model(model, args.export, dtype=getattr(torch, args.export_dtype))
        if rank == 0:
            print(f"exported to {args.export}", flush=True)


if __name__ == "__main__":
    main()
