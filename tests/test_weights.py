"""Real models at real scale: built sharded (no rank holds the whole model), loaded from the safetensors folder
``save_pretrained`` writes, exported back to one that ``from_pretrained`` loads; bad checkpoints refused by name."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cptune
from cptune import models
from cptune.models import _weights
from tests import _warm as warm

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests/models/tiny-llama"
IDS = (torch.arange(48).view(2, 24) * 7) % 256


def _checkpoint(folder: Path, dtype=torch.bfloat16, seed=1) -> Path:
    """tiny-llama with random weights, saved in ``dtype`` by save_pretrained in at least 3 files."""
    config = transformers.AutoConfig.from_pretrained(MODEL)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(folder, max_shard_size="60KB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


def _reference_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _sharded_logits(folder: str) -> torch.Tensor:
    """On every rank: the model built sharded over all ranks from ``folder``'s weights, its logits."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = models.build_model(models.load_config(folder), "cpu", weights=folder, fsdp_mesh=mesh)
    held = sum(p.to_local().numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        return model(input_ids=IDS).logits, held, whole


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = _checkpoint(tmp_path_factory.mktemp("ckpt") / "bf16")
    return folder, _reference_logits(folder)


@pytest.mark.parametrize("world", [2, 4])
def test_a_bf16_checkpoint_in_several_files_loads_into_each_ranks_shards_like_from_pretrained(ranks, checkpoint,
                                                                                             world):
    folder, expected = checkpoint
    for logits, held, whole in ranks(world).run(_sharded_logits, str(folder)):
        assert (logits - expected).abs().max().item() <= 1e-5
        assert held <= whole / world + 256  # each rank keeps its shard only (FSDP2 pads a dim by under world rows)


def test_one_process_builds_what_the_sharded_ranks_hold_and_the_same_every_time():
    config = models.load_config(MODEL)
    a, b = models.build_model(config, "cpu"), models.build_model(config, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = models.build_model(config, "cpu", seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    # the model's own initialization: normal(0, initializer_range) weights, ones for the norms, rotary frequencies
    assert abs(a.model.layers[0].mlp.up_proj.weight.std().item() - config.initializer_range) < 2e-3
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    reference = transformers.AutoModelForCausalLM.from_config(config)
    assert torch.allclose(a.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    tied = models.build_model(models.load_config(MODEL, {"tie_word_embeddings": True}), "cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_an_export_after_three_steps_of_sharded_training_loads_with_from_pretrained(tmp_path, checkpoint):
    """examples/train_hf.py on 2 ranks (FSDP2, CP) from the bf16 checkpoint, 3 steps, --export: the folder loads
    in one process with from_pretrained and gives the trained model's logits; a second export to it is refused."""
    folder, _ = checkpoint
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in folder.iterdir():
        (model_dir / f.name).symlink_to(f)
    script = str(ROOT / "examples/train_hf.py")
    common = [script, "--model", str(model_dir), "--weights", "--seq-len", "64", "--batch", "2", "--steps", "3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run([*torchrun, *common, "--export", "out", "--checkpoint-dir", "ck"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no .out.partial left
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    # the trained model, as its DCP checkpoint after step 3 holds it
    import torch.distributed.checkpoint as dcp

    trained = models.build_model(models.load_config(model_dir), "cpu")
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck/step-3"), no_dist=True)
    trained.load_state_dict(state["model"])
    loaded = models.build_model(models.load_config(model_dir), "cpu", weights=model_dir)
    with torch.no_grad():
        got, want, before = (m(input_ids=IDS).logits for m in (exported, trained, loaded))
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - before).abs().max().item() > 1e-3  # three steps changed the model
    again = warm.run([sys.executable, script, "--model", str(model_dir), "--steps", "1", "--export", "out"], tmp_path,
                     300)
    assert again.returncode == 1 and "--export: out already exists" in again.stderr and "Fix:" in again.stderr
    assert "step 0" not in again.stdout  # refused before training


def _problem(folder, match):
    with pytest.raises(cptune.ValidationError, match=match) as caught:
        models.build_model(models.load_config(MODEL), "cpu", weights=folder)
    assert "Fix:" in str(caught.value)


def test_bad_checkpoints_are_refused_by_name_before_any_tensor_is_read(tmp_path, checkpoint):
    folder, _ = checkpoint
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"x")
    _problem(empty, r"weights: .*empty: no \*.safetensors weights there \(pytorch_model.bin: PyTorch pickles\)")

    def copy(name, skip=()):
        dest = tmp_path / name
        dest.mkdir()
        for f in folder.iterdir():
            if f.name not in skip:
                (dest / f.name).write_bytes(f.read_bytes())
        return dest

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    _problem(copy("missing", {shard}), rf"weights: .*model.safetensors.index.json names 1 file\(s\) not in the "
             rf"folder: {shard}.*Fix: copy every file")
    no_index = copy("no-index", {shard, "model.safetensors.index.json"})
    _problem(no_index, rf"weights: .*a checkpoint in \d+ files, 1 of them missing: {shard}")
    # shapes from a config other than the weights'
    with pytest.raises(cptune.ValidationError, match=r"weights: model.embed_tokens.weight is \[256, 64\] in "
                       r"model-00001-of-0000\d.safetensors, the config makes it \[512, 64\].*--model-override"):
        models.build_model(models.load_config(MODEL, {"vocab_size": 512}), "cpu", weights=folder)
    # a quantized (integer) tensor, written as safetensors does
    from safetensors.torch import save_file

    ints = tmp_path / "ints"
    ints.mkdir()
    state = transformers.AutoModelForCausalLM.from_config(models.load_config(MODEL)).state_dict()
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(state, str(ints / "model.safetensors"))
    _problem(ints, r"weights: model.norm.weight is torch.int8 in model.safetensors, not float32, bfloat16, float16 "
             r"or float64")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    _problem(broken, r"weights: .*model.safetensors: not a safetensors file")
    partial = tmp_path / "partial"
    partial.mkdir()
    del state["model.norm.weight"]
    save_file(state, str(partial / "model.safetensors"))
    _problem(partial, r"weights: 1 tensor\(s\) of the model are not in the checkpoint: model.norm.weight")


def _rewrite_header(path: Path, change) -> None:
    """``path``'s safetensors header changed by ``change(header)``, its tensor bytes kept."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


def test_every_kind_of_damaged_checkpoint_is_named_with_its_file_before_any_tensor_is_read(tmp_path, checkpoint):
    """A file cut short, headers that lie about offsets, an index that places tensors in the wrong file, a tensor
    in two shards, a config without weights, weights without a config; and what still fails only while DCP reads
    (a file cut after the check) is cptune's named error, not DCP's CheckpointException (a BaseException)."""
    folder, _ = checkpoint
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))

    def copy(name):
        dest = tmp_path / name
        shutil.copytree(folder, dest)
        return dest

    cut = copy("cut")
    data = (cut / shards[0]).read_bytes()
    (cut / shards[0]).write_bytes(data[: len(data) - 100])
    _problem(cut, rf"weights: .*{shards[0]}: cut short: its header places tensors up to byte \d+ of the data, the "
             r"file holds \d+.*Fix: copy the file again")

    def first_key(header):
        return next(k for k in header if k != "__metadata__")

    wrong_size = copy("wrong-size")
    _rewrite_header(wrong_size / shards[0],
                    lambda h: h[first_key(h)]["data_offsets"].__setitem__(1, h[first_key(h)]["data_offsets"][1] - 2))
    _problem(wrong_size, rf"weights: .*{shards[0]}: the header gives .* bytes, its shape takes \d+")

    def overlap(header):
        spans = sorted((e["data_offsets"], k) for k, e in header.items() if k != "__metadata__")
        (a, _), (b, key) = spans[0], spans[1]
        length = b[1] - b[0]
        header[key]["data_offsets"] = [a[0], a[0] + length] if length <= a[1] - a[0] else [b[0] - 2, b[1] - 2]

    overlapping = copy("overlap")
    _rewrite_header(overlapping / shards[0], overlap)
    _problem(overlapping, rf"weights: .*{shards[0]}: the header places .* inside the bytes of ")

    misplaced = copy("misplaced")
    moved = next(k for k, f in index["weight_map"].items() if f == shards[0])
    (misplaced / "model.safetensors.index.json").write_text(json.dumps(
        {**index, "weight_map": {**index["weight_map"], moved: shards[1]}}))
    _problem(misplaced, rf"weights: .*index.json places 1 tensor\(s\) in a file that does not hold them: "
             rf"{re.escape(moved)} \(in {shards[0]}\)")

    from safetensors.torch import save_file

    twice = copy("twice")
    save_file({moved: torch.zeros(1)}, str(twice / "model.safetensors"))
    _problem(twice, rf"weights: {re.escape(moved)} is stored twice, in .* and .*Fix: keep one checkpoint per folder")

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only)
    _problem(config_only, r"weights: .*config-only: no \*.safetensors weights there")
    weights_only = copy("weights-only")
    (weights_only / "config.json").unlink()
    with pytest.raises(cptune.ValidationError, match=r"model: .*weights-only: no config.json there.*Fix:"):
        models.load_config(weights_only)

    late = copy("late")  # checked whole, then cut before DCP reads it
    model = transformers.AutoModelForCausalLM.from_config(models.load_config(MODEL))
    tensors = _weights.stored_tensors(late)
    (late / shards[0]).write_bytes((late / shards[0]).read_bytes()[:200])
    with pytest.raises(cptune.ValidationError, match=r"weights: .*late: reading the tensors failed on rank\(s\) "
                       r"\[0\]: .*Fix: copy the checkpoint again"):
        _weights.load_weights(model, late, tensors)


def test_an_unknown_model_type_and_an_existing_export_folder_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    with pytest.raises(cptune.ValidationError, match=r"model: .*model_type 'no-such-model' is not one transformers"):
        models.load_config(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(cptune.ValidationError, match=r"export: .*out already exists.*Fix: give a new folder"):
        models.export_model(models.build_model(models.load_config(MODEL), "cpu"), tmp_path / "out")
    with pytest.raises(cptune.ValidationError, match=r"export: .*is not a folder"):
        models.check_export(tmp_path / "none" / "out")


def test_a_model_no_rank_can_hold_even_sharded_is_refused_before_any_rank_starts(tmp_path):
    """The 8B config cut to 2 layers under a 4 GiB budget on 2 ranks: the plan's smallest predicted peak says no,
    by name, in seconds (it used to run every configuration into torch's allocator failure)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = warm.run([sys.executable, "-m", "cptune", "search", "--model", str(tmp_path), "--model-override",
                     "num_hidden_layers=2", "--seq-len", "1024", "--nproc", "2", "--memory-budget", "4GiB",
                     "--storage", f"sqlite:///{tmp_path}/s.db"], tmp_path, 120)
    assert done.returncode == 1, done.stderr
    assert "--memory-budget: 4.00GiB per rank cannot hold" in done.stderr and "even sharded over 2 ranks" in done.stderr
    assert "Fix: run on more ranks" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "s.db").exists()  # refused before the study was opened
