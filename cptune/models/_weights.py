"""Hugging Face safetensors folders in and out of a (sharded) model: checked before any tensor is read, loaded
straight into each rank's shards, exported through a temporary folder renamed at the end.

Load: :class:`torch.distributed.checkpoint.HuggingFaceStorageReader` reads, for each rank, the slices of
each tensor that its FSDP2 shards hold (safetensors slices: no rank reads what it does not keep), and
copies them into the float32 parameters (a bf16/fp16 checkpoint becomes float32 master weights).
Export: :class:`~torch.distributed.checkpoint.HuggingFaceStorageWriter`, every rank writing its shards and
rank 0 consolidating them into whole tensors, as ``save_pretrained`` lays them out (``model-0000i-of-
0000n.safetensors`` and ``model.safetensors.index.json``), with ``config.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..experts import ep_parameters
from ..errors import Problem, ValidationError, raise_if

INDEX = "model.safetensors.index.json"
SHARD_SIZE = 5 * 2**30
"""Largest export file, as save_pretrained's default max_shard_size (5 GB)."""

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
LOADABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Stored:
    file: str
    dtype: torch.dtype | str
    shape: tuple[int, ...]


def _header(path: Path, argument: str) -> dict:
    """A safetensors file's header (its JSON table of tensors), read without reading any tensor, and checked
    against the file: every tensor's bytes where the header says, of the size its dtype and shape take, inside
    the file (a file cut short, or a header that lies about its offsets, is refused here by name, not by the
    reader in the middle of a load)."""
    fix = "copy the file again from its source, or save the model again with save_pretrained (safetensors)"
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > path.stat().st_size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a table")
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ValidationError([Problem(argument, f"{path}: not a safetensors file ({exc})",
                                       "save the model again with save_pretrained (safetensors)")]) from None
    header.pop("__metadata__", None)
    data = path.stat().st_size - 8 - size
    end = 0
    for key, entry in header.items():
        shape, offsets = entry.get("shape"), entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValidationError([Problem(argument, f"{path}: the header's entry for {key} is not a safetensors "
                                           "tensor (dtype, shape, data_offsets)", fix)])
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is not None and offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ValidationError([Problem(argument, f"{path}: the header gives {key} ({entry['dtype']} "
                                           f"{shape}) {offsets[1] - offsets[0]} bytes, its shape takes "
                                           f"{math.prod(shape) * dtype.itemsize}", fix)])
        end = max(end, offsets[1])
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in header.items())
    for (_, first_end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < first_end:
            raise ValidationError([Problem(argument, f"{path}: the header places {second} inside the bytes of "
                                           f"{first}", fix)])
    if end > data:
        raise ValidationError([Problem(argument, f"{path}: cut short: its header places tensors up to byte {end} of "
                                       f"the data, the file holds {max(data, 0)} (an interrupted copy or download)",
                                       fix)])
    return header


def stored_tensors(folder: str | Path, argument: str = "weights") -> dict[str, Stored]:
    """Every tensor of the safetensors checkpoint in ``folder``: name -> file, dtype, shape. Refuses, naming
    the file: a folder without safetensors weights, an index naming files that are not there, a sharded set
    (``model-0000i-of-0000n``) with a file missing, a file that is not safetensors."""
    root = Path(folder).expanduser()
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file()) if root.is_dir() else []
    if not files:
        found = sorted(p.name for p in root.glob("*.bin"))[:3] if root.is_dir() else []
        raise ValidationError([Problem(argument, f"{folder}: no *.safetensors weights there" + (
            f" ({', '.join(found)}: PyTorch pickles)" if found else ""), "give the folder save_pretrained wrote "
            "(model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json); convert a "
            ".bin checkpoint with from_pretrained then save_pretrained")])
    problems, names = [], {p.name for p in files}
    index = root / INDEX
    if index.is_file():
        from .._files import read_json_object

        weight_map = read_json_object(index, argument, "save the model again with save_pretrained").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValidationError([Problem(argument, f"{index}: no weight_map", "save the model again with "
                                           "save_pretrained")])
        missing = sorted(set(weight_map.values()) - names)
        if missing:
            problems.append(Problem(argument, f"{index} names {len(missing)} file(s) not in the folder: "
                                    f"{', '.join(missing[:4])}", "copy every file the index names into the folder "
                                    "(an interrupted download or copy leaves some out)"))
    for name in names:
        shard = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", name)
        if shard:
            count = int(shard.group(3))
            width = len(shard.group(2))
            absent = [f"{shard.group(1)}-{str(i).zfill(width)}-of-{shard.group(3)}.safetensors"
                      for i in range(1, count + 1)]
            absent = [a for a in absent if a not in names]
            if absent:
                problems.append(Problem(argument, f"{folder}: a checkpoint in {count} files, {len(absent)} of them "
                                        f"missing: {', '.join(absent[:4])}", "copy the missing shard(s) into the "
                                        "folder"))
                break
    raise_if(problems)
    tensors: dict[str, Stored] = {}
    for path in files:
        for key, entry in _header(path, argument).items():
            if key in tensors:
                problems.append(Problem(argument, f"{key} is stored twice, in {tensors[key].file} and {path.name}",
                                        "keep one checkpoint per folder: remove the files of another save (an "
                                        "older model.safetensors beside model-0000i-of-0000n files, say)"))
            tensors[key] = Stored(path.name, _DTYPES.get(entry.get("dtype"), entry.get("dtype")),
                                  tuple(entry.get("shape", ())))
    if index.is_file():
        wrong = [f"{key} (in {tensors[key].file if key in tensors else 'no file'})"
                 for key, file in weight_map.items() if key not in tensors or tensors[key].file != file]
        if wrong:
            problems.append(Problem(argument, f"{index} places {len(wrong)} tensor(s) in a file that does not hold "
                                    f"them: {', '.join(wrong[:4])}", "save the model again with save_pretrained "
                                    "(the index and the files it names come from one save)"))
    raise_if(problems[:8])
    return tensors


def _tied(model: nn.Module) -> set[str]:
    """Names under which a parameter already listed appears again (tied embeddings): stored once."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


def weight_problems(model: nn.Module, tensors: dict[str, Stored], argument: str = "weights") -> list[Problem]:
    """What in the checkpoint does not fit ``model`` (built from the config, on any device, meta included): a
    parameter it lacks, a shape other than the model's, a dtype that is not a float of 16 bits or more. (A
    float dtype other than the config's ``dtype`` is loaded: the parameters are float32 whatever the files hold,
    as ``from_pretrained(dtype=torch.float32)`` does.)"""
    problems, tied = [], _tied(model)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in tied}
    absent = [k for k in expected if k not in tensors]
    if absent:
        problems.append(Problem(argument, f"{len(absent)} tensor(s) of the model are not in the checkpoint: "
                                f"{', '.join(absent[:4])}", "give the checkpoint of this very model (its config.json "
                                "and weights from one save_pretrained)"))
    for key, target in expected.items():
        stored = tensors.get(key)
        if stored is None:
            continue
        if stored.shape != tuple(target.shape):
            problems.append(Problem(argument, f"{key} is {list(stored.shape)} in {stored.file}, the config makes it "
                                    f"{list(target.shape)}", "give the config.json saved with these weights "
                                    "(or drop the --model-override that changes this shape)"))
        elif stored.dtype not in LOADABLE:
            problems.append(Problem(argument, f"{key} is {stored.dtype} in {stored.file}, not float32, bfloat16, "
                                    "float16 or float64 (a quantized or integer tensor)", "give an unquantized "
                                    "checkpoint (save_pretrained of the model in float32, bfloat16 or float16)"))
    return problems[:8]


def load_weights(model: nn.Module, folder: str | Path, tensors: dict[str, Stored],
                 argument: str = "weights") -> None:
    """Read ``folder``'s tensors into ``model``'s parameters and buffers (its shards, under FSDP2), each rank
    the slices it keeps. Collective under a process group: call on every rank."""
    import torch.distributed.checkpoint as dcp

    tied = _tied(model)
    state = {k: v for k, v in model.state_dict().items() if k not in tied and k in tensors}
    quiet = _QuietCheckpointLog()  # DCP logs each reader failure's traceback to the root logger, then raises
    logging.getLogger().addFilter(quiet)
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(Path(folder).expanduser())),
                 no_dist=not _distributed())
    except dcp.api.CheckpointException as exc:  # a BaseException: named here, the one place DCP reads weights
        raise ValidationError([Problem(argument, f"{folder}: reading the tensors failed on rank(s) "
                                       f"{sorted(exc.failures)}: {_first_failure(exc)}", "copy the checkpoint "
                                       "again from its source, or save the model again with save_pretrained")]) \
            from None
    finally:
        logging.getLogger().removeFilter(quiet)


class _QuietCheckpointLog(logging.Filter):
    """Drops DCP's own warnings (with their tracebacks) while cptune loads: a failure is said once, as cptune's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "distributed/checkpoint" not in record.pathname.replace("\\", "/") or record.levelno > logging.WARNING


def _first_failure(exc) -> str:
    """The first rank's failure of a DCP CheckpointException, as one line (not DCP's traceback)."""
    failure = next(iter(exc.failures.values()), None)
    error = failure[0] if isinstance(failure, tuple) else failure  # (exception, its traceback summary)
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_export(folder: str | Path, argument: str = "export") -> Path:
    """The export folder, refused if it exists (an export never replaces one) or its parent is missing."""
    path = Path(folder).expanduser()
    if path.exists():
        raise ValidationError([Problem(argument, f"{folder} already exists", "give a new folder (an export never "
                                       "replaces one), or move that one away")])
    if not path.parent.is_dir():
        raise ValidationError([Problem(argument, f"{path.parent} is not a folder", "create it, or export elsewhere")])
    return path


def export_model(model: nn.Module, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (sharded by FSDP2 or whole) as a Hugging Face model folder that ``from_pretrained``
    loads: safetensors files of at most 5 GB, their index and ``config.json``; ``dtype``: the files' dtype
    (default: the parameters'). Written to ``.NAME.partial`` beside it and renamed once whole. Collective
    under a process group: call on every rank."""
    import torch.distributed.checkpoint as dcp

    path = check_export(folder)
    if ep_parameters(model):  # each rank holds its own experts under the same names: a file would mix them
        raise ValidationError([Problem("model", "has experts split over expert-parallel ranks (cptune.experts), "
                                       "which an export cannot gather yet", "export the model built with ep=1")])
    distributed = _distributed()
    rank = dist.get_rank() if distributed else 0
    partial = path.parent / f".{path.name}.partial"
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash
    if distributed:
        dist.barrier()
    tied = _tied(model)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
             for k, v in model.state_dict().items() if k not in tied}
    files, size, mapping = 1, 0, {}
    for key, t in state.items():
        nbytes = math.prod(t.shape) * t.element_size()
        if size and size + nbytes > SHARD_SIZE:
            files, size = files + 1, 0
        mapping[key], size = files, size + nbytes
    writer = dcp.HuggingFaceStorageWriter(str(partial), fqn_to_index_mapping=mapping, save_distributed=distributed,
                                          enable_consolidation=distributed)
    dcp.save(state, storage_writer=writer, no_dist=not distributed)
    if rank == 0:
        shutil.rmtree(partial / "sharded", ignore_errors=True)  # each rank's shards, consolidated above
        config = getattr(model, "config", None)
        if config is not None:
            config = type(config).from_dict(config.to_dict())
            if dtype is not None:
                config.dtype = dtype
            config.save_pretrained(partial)
        os.replace(partial, path)
    if distributed:
        dist.barrier()  # the folder is whole before any rank goes on
    return path
