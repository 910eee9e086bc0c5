"""``cptune.models.build_model`` makes the model transformers makes, on every transformers release pyproject admits:
every parameter and every buffer (the non-persistent ones too: rotary frequencies, embedding scales), with and
without a checkpoint, with and without a mesh; its logits and a training step are transformers' own.

The buffers are the check that matters: they are not in a state dict, so a build that leaves them as
uninitialized memory (as building on the meta device did on transformers 4.56 and 4.57) trains garbage positions
without a word, and only a comparison of the buffers themselves, or of logits, sees it."""

import pytest
import torch
import torch.distributed as dist

from cptune import models

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {  # each with what makes its buffers its own
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2": dict(rope_theta=1e6),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=None),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),  # embed_scale, local rotary
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
CASES = [(family, tied) for family in FAMILIES for tied in (False, True)]
IDS = (torch.arange(48).view(2, 24) * 7) % 256


def _config(family: str, tied: bool):
    config = transformers.AutoConfig.for_model(family, **SMALL, **FAMILIES[family], tie_word_embeddings=tied)
    config.use_cache = False
    return config


def _transformers_build(config):
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _buffer_errors(model, reference) -> dict[str, float]:
    got, want = dict(model.named_buffers()), dict(reference.named_buffers())
    assert got.keys() == want.keys()
    return {name: (got[name].double() - want[name].double()).abs().max().item() for name in want}


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _train_step(model) -> list[float]:
    """Two losses: before and after one AdamW step on the same batch."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("family,tied", CASES)
def test_a_built_model_holds_transformers_own_buffers_and_initialization(family, tied):
    config = _config(family, tied)
    built, reference = models.build_model(config, "cpu"), _transformers_build(config)
    errors = _buffer_errors(built, reference)
    assert errors and max(errors.values()) == 0.0, errors
    params, want = dict(built.named_parameters()), dict(reference.named_parameters())
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in want.items()}
    for name, p in want.items():  # the model's own initialization: the constants equal, the random ones alike
        got = params[name]
        if torch.all(p == p.flatten()[0]):
            assert torch.equal(got, p), name
        else:
            assert abs(got.std().item() / p.std().item() - 1) < 0.1 and abs(got.mean().item()) < 0.01, name
    assert (built.lm_head.weight is built.get_input_embeddings().weight) == tied
    reference.load_state_dict(built.state_dict())  # the same parameters: the logits then differ only by buffers
    assert (_logits(built) - _logits(reference)).abs().max().item() <= 1e-6


def _save(config, folder, dtype=torch.bfloat16):
    torch.manual_seed(3)
    model = _transformers_build(config).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(folder, max_shard_size="60KB")
    return folder


@pytest.mark.parametrize("family,tied", CASES)
def test_a_checkpoint_builds_what_from_pretrained_loads_and_trains_as_it_does(tmp_path, family, tied):
    """A bf16 save_pretrained checkpoint in several files: every parameter and buffer, the logits and the losses
    of a training step equal from_pretrained's (float32)."""
    folder = _save(_config(family, tied), tmp_path / family)
    built = models.build_model(models.load_config(folder), "cpu", weights=folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    errors = _buffer_errors(built, reference)
    assert max(errors.values()) == 0.0, errors
    want = dict(reference.named_parameters())
    assert max((p - want[name]).abs().max().item() for name, p in built.named_parameters()) == 0.0
    assert (_logits(built) - _logits(reference)).abs().max().item() <= 1e-6
    got, expected = _train_step(built), _train_step(reference)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (got, expected)
    assert abs(got[1] - got[0]) > 1e-3  # the step moved the model


def _sharded_builds(folders: dict[str, str]) -> dict[str, tuple[float, float]]:
    """On every rank: each family built sharded over all ranks, without weights and from its checkpoint: the
    largest buffer error against transformers' build, and the logits' error against from_pretrained's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for family, folder in folders.items():
        config = models.load_config(folder)
        plain = models.build_model(config, "cpu", fsdp_mesh=mesh)
        buffers = max(_buffer_errors(plain, _transformers_build(config)).values())
        loaded = models.build_model(config, "cpu", weights=folder, fsdp_mesh=mesh)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                      attn_implementation="sdpa")
        out[family] = buffers, (_logits(loaded) - _logits(reference)).abs().max().item()
    return out


def test_sharded_builds_hold_transformers_own_buffers_and_logits(ranks, tmp_path):
    folders = {family: str(_save(_config(family, family == "qwen3"), tmp_path / family)) for family in FAMILIES}
    for per_rank in ranks(2).run(_sharded_builds, folders):
        for family, (buffers, logits) in per_rank.items():
            assert buffers == 0.0 and logits <= 1e-6, (family, buffers, logits)
