"""transformers models built for the whole mesh: each decoder layer split by the model's own TP plan, then sharded by
FSDP2 over dp_shard x cp, on 4 real ranks (tp2·cp2, dp2·tp2, tp4). A bf16 checkpoint in several files loads straight
into the shards, each rank holding its share of every split weight; logits and every parameter gradient under the CP
block equal one process's, eager and under activation checkpointing and compile, with the residual stream split by
token over tp (sequence parallelism), each block's input kept for backward as that shard without AC, and the loss
vocabulary-parallel over tp (cptune.hf.causal_lm_loss); the export is what from_pretrained loads. Models whose plan cptune does not apply, and a tp the heads cannot take, are refused by name before anything
is built."""

import re

import pytest
import torch
import torch.distributed as dist

import cptune
from cptune import models
from cptune.models import _tp_shards
from cptune.models._parallelize import PER_HEAD
from cptune.hf import causal_lm_loss
from cptune.mesh import ParallelDims
from benchmarks import matrix as M
from tests.test_build import FAMILIES, _config, _save

transformers = pytest.importorskip("transformers")

TP_CP, DP_TP, TP4 = ParallelDims(1, 1, 2, 2), ParallelDims(1, 2, 1, 2), ParallelDims(1, 1, 1, 4)
IDS = (torch.arange(64).view(2, 32) * 7) % 256


def _loss_and_logits(model, ids, labels, positions):
    logits = model(input_ids=ids, position_ids=positions).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return loss, logits


def _tp_case(folder, dims, ac="none", compile=False, export=None):
    """One step of ``folder``'s model under ``dims`` against from_pretrained's in one process on the whole batch
    (each dp replica takes its rows): logits, gradients, the share of each weight a rank holds, and (``export``)
    the exported folder against the checkpoint."""
    config = models.load_config(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    ids, labels = IDS, cptune.shift_labels(IDS)
    positions = torch.arange(32).expand(2, 32).contiguous()
    want_loss, want_logits = _loss_and_logits(reference, ids, labels, positions)
    count = (labels != -100).sum()
    (want_loss / count).backward()
    model = models.build_model(config, "cpu", weights=folder, fsdp_mesh=dims.model_mesh("cpu"), ac=ac,
                               compile=compile)
    stream = []  # the residual stream's tokens between the layers, on this rank
    model.model.layers[0].register_forward_hook(
        lambda module, args, out: stream.append((out[0] if isinstance(out, tuple) else out).shape[1]))
    cp_config = cptune.CPConfig(mesh_shape=dims.shape)
    rows = cptune.replica_rows(len(ids), config=cp_config)
    ids, labels, positions, want_logits = ids[rows], labels[rows], positions[rows], want_logits[rows]
    with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=cp_config) as block:
        with torch.no_grad():  # before the step: FSDP2 drops the root's gradients at a forward after backward
            logits = block.unshard(_loss_and_logits(model, ids, labels, positions)[1], 1)
        kept = _tp_shards.stats["kept_as_shard"]
        loss = causal_lm_loss(model, ids, labels, position_ids=positions)  # vocabulary-parallel over tp
        kept = _tp_shards.stats["kept_as_shard"] - kept
        loss.backward()
    whole = loss.detach().clone()
    dist.all_reduce(whole)  # each rank's loss: its tokens' sum over the count per data rank (FSDP2 averages)
    want = dict(reference.named_parameters())
    grads, shares = 0.0, {}
    for name, p in model.named_parameters():
        grads = max(grads, (p.grad.full_tensor() - want[name].grad).abs().max().item())
        shares[name] = p.to_local().numel() / p.numel()
    out = {"logits": (logits - want_logits).abs().max().item(), "grads": grads, "shares": shares, "stream": stream,
           "loss": abs(whole.item() / dist.get_world_size() - want_loss.item() / count.item()), "path": model._cptune_loss_path,
           "kept": kept}
    if export is not None:
        models.export_model(model, export)
        dist.barrier()
        back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        out["export"] = max((back.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return out


def _plan_split(name: str, config) -> bool:
    """Whether parameter ``name`` belongs to a module the model's TP plan splits (a replicated q/k norm is not)."""
    plan = {key: style for key, style in config.base_model_tp_plan.items() if style != PER_HEAD}
    return any(name.startswith("model.layers.") and name.split(".", 3)[3].startswith(key.split("*.", 1)[1] + ".")
               for key in plan)


def test_a_checkpoint_loads_into_tp_and_fsdp_shards_and_trains_exactly(ranks, tmp_path):
    """tp2·cp2: Llama (colwise / rowwise) from a bf16 checkpoint in several files, with its export; Qwen3 and Gemma3
    (per-head q/k norms replicated over tp, their gradients summed over tp) likewise, Gemma3 under selective AC; Phi3
    (fused q/k/v and gate/up: gathered output, split input); Llama again under selective AC, compiled where this
    transformers can compile it with AC. dp2·tp2 under selective AC (compiled likewise); tp4 (a Llama with 4
    key/value heads) under full AC."""
    kv4 = _config("llama", False)
    kv4.num_key_value_heads = 4
    folders = {f: str(_save(_config(f, False), tmp_path / f)) for f in ("llama", "phi3", "qwen3", "gemma3_text")}
    folders["llama-kv4"] = str(_save(kv4, tmp_path / "llama-kv4"))
    assert all(len(list((tmp_path / f).glob("*.safetensors"))) >= 3 for f in ("llama", "qwen3", "gemma3_text"))
    compiled = not models.training_problems("selective", True)  # compiled where it can
    cases = [("llama", TP_CP, "none", False, str(tmp_path / "export")), ("phi3", TP_CP, "none", False, None),
             ("qwen3", TP_CP, "none", False, str(tmp_path / "export-qwen3")),
             ("gemma3_text", TP_CP, "selective", False, str(tmp_path / "export-gemma3")),
             ("llama", TP_CP, "selective", compiled, None), ("llama", DP_TP, "selective", compiled, None),
             ("llama-kv4", TP4, "full", False, None)]
    group = ranks(4)
    results = [group.run(_tp_case, folders[f], dims, ac, comp, export) for f, dims, ac, comp, export in cases]
    for (family, dims, ac, comp, export), per_rank in zip(cases, results):
        config = models.load_config(folders[family])
        fsdp = dims.dp_shard * dims.cp  # FSDP2's ranks; a tp rank holds 1/tp of a split weight before it
        for r in per_rank:
            assert r["logits"] <= 1e-5 and r["grads"] <= 1e-5, (family, dims, ac, comp, r["logits"], r["grads"])
            assert r["loss"] <= 1e-5 and r["path"] == "vocab-parallel", (family, dims, r["loss"], r["path"])
            # without AC, backward keeps each block's input as the sequence shard (gathered again: the same values)
            assert (r["kept"] > 0) == (ac == "none" and not comp), (family, dims, ac, comp, r["kept"])
            # sequence parallelism: between the layers a rank holds its cp rank's tokens split over tp
            assert set(r["stream"]) == {IDS.shape[1] // (dims.cp * dims.tp)}, (family, dims, r["stream"])
            split = {n: s for n, s in r["shares"].items() if _plan_split(n, config)}
            assert split and set(split.values()) == {1 / (dims.tp * fsdp)}, (family, dims, split)
            whole = set(r["shares"].values()) - {1 / (dims.tp * fsdp)}  # norms, embeddings: FSDP2's share only
            assert whole == {1 / fsdp}, (family, dims, r["shares"])
            if export:
                assert r["export"] <= 1e-6, r["export"]


@pytest.mark.parametrize("family,tp,match", [
    ("qwen3_moe", 2, r"mesh.tp: is 2 but Qwen3MoeConfig's TP plan leaves mlp \(Qwen3MoeSparseMoeBlock\) unsplit"),
    ("llama", 4, r"mesh.tp: 4 does not divide the 2 key/value heads. Fix: use a tp that divides 2"),
])
def test_a_model_the_tp_cannot_split_is_refused_by_name(family, tp, match):
    config = _config(family, False) if family in FAMILIES else M.tiny_config(family)
    problems = models.tp_problems(config, tp)
    assert problems and any(re.search(match, str(p)) for p in problems), problems
    assert models.tp_problems(config, 1) == []


def _layer(family: str, plan: dict[str, str]):
    """A meta-device decoder layer of ``family``'s tiny config, with ``plan`` (the part under layers.*.) as its TP
    plan: the plans other transformers releases write, on this release's modules."""
    config = M.tiny_config(family)
    config.base_model_tp_plan = {f"layers.*.{key}": style for key, style in plan.items()}
    return config, models.decoder_layers(models.empty_model(config))


ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
             "mlp.down_proj": "rowwise"}


def test_the_plans_of_every_release_are_read_by_one_rule():
    """transformers 4.x's Qwen3 plan leaves the per-head q/k norms out: they get 5.x's style, found by their width. A
    norm over every head beside column-parallel projections (OLMo2 under a plan that does not gather them) is
    refused; beside gathered ones it stays whole. A block split column-wise and never joined (4.56's Starcoder2),
    and an MoE block split expert by expert (4.56's Mixtral), are refused by name."""
    from cptune.models import _parallelize as P

    config, layers = _layer("qwen3", ATTENTION)
    assert P.layer_plan(config, layers) == {**ATTENTION, "self_attn.q_norm": PER_HEAD, "self_attn.k_norm": PER_HEAD}
    assert models.tp_problems(config, 2, model=models.empty_model(config)) == []
    config, _ = _layer("olmo2", ATTENTION)
    assert any("leaves self_attn.k_norm, self_attn.q_norm whole beside" in str(p) for p in models.tp_problems(config, 2))
    gathered = {**ATTENTION, **{f"self_attn.{m}_proj": "colwise_gather_output" for m in "qkv"},
                "self_attn.o_proj": "rowwise_split_input"}
    config, layers = _layer("olmo2", gathered)
    assert P.layer_plan(config, layers) == gathered and models.tp_problems(config, 2) == []
    config, _ = _layer("starcoder2", {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                                      "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                                      "mlp.c_fc": "colwise", "mlp.c_proj": "colwise"})
    assert any("splits mlp (mlp.c_fc, mlp.c_proj) column-wise with no row-wise matmul" in str(p)
               for p in models.tp_problems(config, 2))
    config, _ = _layer("mixtral", {**{k: v for k, v in ATTENTION.items() if k.startswith("self_attn")},
                                   "mlp.gate": "colwise_gather_output", "mlp.experts.*.w1": "colwise"})
    assert any(re.search(r"leaves \w+ \(MixtralSparseMoeBlock\) unsplit", str(p)) for p in models.tp_problems(config, 2))
