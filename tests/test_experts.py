"""Expert parallelism (cptune.experts) beside context parallelism, on real ranks: each MoE layer's experts split over
an ep group, tokens traded for them by all-to-all, against one process (float32: the loss within 1e-5, every
gradient within 1e-4 of its tensor's largest), for the grouped experts of Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA) and
GPT-OSS (its sinks, biases and clamped gate); the first-step check reads a rank's experts right."""

import tempfile

import pytest
import torch
import torch.distributed as dist

import cptune
from benchmarks import matrix as M

transformers = pytest.importorskip("transformers")
GROUPED = int(transformers.__version__.split(".", 1)[0]) >= 5
"""transformers 5 stacks a layer's experts in one module (what cptune.experts splits); 4.x keeps a list of modules,
refused by name (the last test)."""
needs_grouped = pytest.mark.skipif(not GROUPED, reason="transformers 4.x keeps experts as lists of modules")

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
SEQ = 32


def _batch(packed: bool):
    """Two unpadded rows, or one row of three packed documents (positions restarting at each)."""
    gen = torch.Generator().manual_seed(3)
    if packed:
        ids = torch.randint(3, 128, (1, SEQ), generator=gen)
        positions = torch.cat([torch.arange(n) for n in (11, 5, 16)]).view(1, SEQ)
        labels = ids.clone()
        labels[positions == 0] = -100  # no label across a document's start
        return ids, cptune.shift_labels(labels), positions
    ids = torch.randint(3, 128, (2, SEQ), generator=gen)
    return ids, cptune.shift_labels(ids), torch.arange(SEQ).expand(2, SEQ).contiguous()


def _loss(model, ids, shifted, positions):
    return cptune.hf.causal_lm_loss(model, ids, shifted, position_ids=positions)


def _one_process(family, packed):
    """One process's loss and gradients: each packed document alone (what packing means)."""
    model = cptune.models.build_model(M.tiny_config(family), "cpu")
    model.train()
    ids, shifted, positions = _batch(packed)
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [SEQ]
    total = shifted.ne(-100).sum()
    loss = 0.0
    for a, b in zip(starts, starts[1:]):
        part = cptune.hf.causal_lm_loss(model, ids[:, a:b], shifted[:, a:b], position_ids=positions[:, a:b],
                                        num_items_in_batch=total)
        part.backward()
        loss += part.item()
    return loss, {name: p.grad for name, p in model.named_parameters()}


def _relative(got, want):
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def _case(family, strategy, packed, ep, check):
    """cp over every rank, ep over groups of ``ep`` consecutive ranks: the loss and every gradient's error."""
    want_loss, want = _one_process(family, packed)
    world = dist.get_world_size()
    model = cptune.models.build_model(M.tiny_config(family), "cpu", ac="none", cp=world)
    cptune.hf.enable(model, check=check)
    cptune.experts.expert_parallel(model, ep)
    split = cptune.experts.ep_parameters(model)
    ids, shifted, positions = _batch(packed)
    buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
    with cptune.context_parallel(buffers=buffers, seq_dims=dict.fromkeys(buffers, 1),
                                 config=cptune.CPConfig(strategy=strategy, rotate_method="alltoall")):
        loss = _loss(model, ids, shifted, positions)
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)  # each rank's loss is cp x its share
    cptune.experts.average_gradients(model)  # this rank's experts: summed over their replicas, / world
    modules = dict(model.named_modules())
    errors = {}
    for name, p in model.named_parameters():
        if name in split:
            first = cptune.experts.local_experts(modules[name.rsplit(".", 1)[0]])[1]
            errors[name] = _relative(p.grad, want[name][first:first + p.shape[0]])
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            errors[name] = _relative(g / world, want[name])
    return abs(loss.item() / world - want_loss), errors, len(split)


def _assert_exact(results, case):
    for loss_err, errors, split in results:
        worst = max(errors, key=errors.get)
        assert split > 0 and loss_err <= LOSS_TOL and errors[worst] <= GRAD_TOL, (case, loss_err, worst, errors[worst])


@needs_grouped
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_experts_split_over_the_cp_ranks_train_as_one_process(ranks, family):
    """cp2 x ep2 on the same two ranks: the ring unpacked, Ulysses on packed documents."""
    for strategy, packed in (("ring", False), ("ulysses", True)):
        _assert_exact(ranks(2).run(_case, family, strategy, packed, 2, "never"), (family, strategy, packed))


@needs_grouped
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_groups_inside_and_across_four_cp_ranks(ranks, ep):
    """cp4 with ep2 (two groups inside the cp group) and ep4 (every rank), Qwen3-MoE's 4 experts."""
    _assert_exact(ranks(4).run(_case, "qwen3_moe", "ring", False, ep, "never"), ("qwen3_moe", ep))


def _fsdp_case(family, ep, check, ac="none", compile=False, strategy="ring"):
    """``build_model(ep=)`` under FSDP2 over every rank (cp over every rank): the experts a unit of their own sharded
    over their replicas, checkpointed (``ac``) and compiled as asked. The loss and every gradient's error against one
    process."""
    from torch.distributed.device_mesh import init_device_mesh

    want_loss, want = _one_process(family, False)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = cptune.models.build_model(M.tiny_config(family), "cpu", fsdp_mesh=mesh, ac=ac, cp=world, ep=ep,
                                      compile=compile)
    cptune.hf.enable(model, check=check)
    split = cptune.experts.ep_parameters(model)
    ids, shifted, positions = _batch(False)
    buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
    with cptune.context_parallel(buffers=buffers, seq_dims=dict.fromkeys(buffers, 1),
                                 config=cptune.CPConfig(strategy=strategy)):
        loss = _loss(model, ids, shifted, positions)
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    modules = dict(model.named_modules())
    errors = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()  # FSDP2 averaged it (the experts: over their replicas, / the world)
        if name in split:
            first = cptune.experts.local_experts(modules[name.rsplit(".", 1)[0]])[1]
            errors[name] = _relative(grad, want[name][first:first + grad.shape[0]])
        else:
            errors[name] = _relative(grad, want[name])
    return abs(loss.item() / world - want_loss), errors, len(split)


@needs_grouped
@pytest.mark.parametrize("world,ep,check", [(2, 2, "never"), (4, 2, "always")])
def test_a_sharded_build_splits_the_experts_and_fsdp_shards_them_over_their_replicas(ranks, world, ep, check):
    """FSDP2 over 2 ranks with ep2 (each expert on one rank), and over 4 with ep2 (each expert's rows sharded over
    its two replicas), the first-step check forced there: GPT-OSS's experts and sinks, Qwen3-MoE's."""
    family = "gpt_oss" if world == 2 else "qwen3_moe"
    _assert_exact(ranks(world).run(_fsdp_case, family, ep, check), (family, world, ep))


@needs_grouped
@pytest.mark.parametrize("family,ac,compiled,strategy", [("deepseek_v3", "full", False, "ulysses"),
                                                          ("mixtral", "none", True, "ring")])
def test_experts_under_checkpointing_and_compile_train_as_one_process(ranks, family, ac, compiled, strategy):
    """ep2 under FSDP2 with full activation checkpointing (the recompute trades the tokens again) or each decoder
    layer compiled (the all-to-all a graph break): exact. Selective checkpointing is refused (the last test)."""
    _assert_exact(ranks(2).run(_fsdp_case, family, 2, "never", ac, compiled, strategy), (family, ac, compiled))


def _checked(family):
    _, errors, _ = _case(family, "ring", True, 2, "always")
    return max(errors.values())


@needs_grouped
def test_the_first_step_check_passes_an_expert_parallel_model(ranks):
    """Forced on an expert-parallel model, the check compares each rank's experts with one process's slice of them
    (run whole, every rank of the ep group sends each expert every token once; split, each its share)."""
    for err in ranks(2).run(_checked, "qwen3_moe"):
        assert err <= GRAD_TOL


def _refusals():
    model = cptune.models.build_model(M.tiny_config("qwen3_moe"), "cpu")  # 4 experts a layer
    found = [str(p) for p in cptune.experts.ep_problems(model, 3)]
    dense = cptune.models.build_model(M.tiny_config("llama"), "cpu")
    found += [str(p) for p in cptune.experts.ep_problems(dense, 2)]
    try:
        cptune.experts.expert_parallel(model, 2)
        found.append(_raised(cptune.models.export_model, model, tempfile.mkdtemp() + "/export"))
        cptune.experts.expert_parallel(model, 2)
    except cptune.ValidationError as exc:
        found.append(str(exc))
    if GROUPED:  # under FSDP2 the experts' own unit and selective checkpointing's op cache disagree: refused
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        found.append(_raised(cptune.models.build_model, M.tiny_config("deepseek_v3"), "cpu", fsdp_mesh=mesh,
                             ac="selective", cp=2, ep=2))
    return found


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except cptune.ValidationError as exc:
        return str(exc)
    return "nothing raised"


def test_an_ep_that_cannot_split_the_experts_is_refused_by_name(ranks):
    found = ranks(2).run(_refusals)[0]
    if not GROUPED:  # every MoE family of 4.x: a list of expert modules
        assert all("Qwen3MoeForCausalLM has no grouped experts" in f for f in found[:1] + found[-1:]), found
        assert "a mixture of experts needs transformers 5" in found[0]
        return
    assert "ep: is 3, which does not divide model.layers.0.mlp.experts's 4 experts" in found[0]
    assert "ep: is 2 but LlamaForCausalLM has no grouped experts" in found[2]
    assert "model: has experts split over expert-parallel ranks" in found[-3]  # an export would mix ranks' experts
    assert "split over expert-parallel ranks already" in found[-2]
    assert "ac: is 'selective' with ep 2 under FSDP2. Fix: use ac='full' or 'none' with ep" in found[-1], found[-1]


@needs_grouped
def test_a_search_picks_ep_where_it_wins_and_its_recipe_trains_and_resumes_as_one_process(tmp_path):
    """``cptune search --model`` on a mixture of experts whose experts outweigh the rest (16 experts 4,096 wide a
    layer): the search's ep axis, measured; ep2 beats FSDP2 alone there (it gathers no expert) and the recipe carries
    it. ``cptune launch`` trains it at dp1·cp2 ep2, checkpointed at step 2 and resumed for step 3, with the losses
    ``train_hf`` gets in one process (<= 1e-5); resuming under another ep is refused by name."""
    import json
    import subprocess
    import sys

    from click.testing import CliRunner

    from cptune.cli import main
    from tests._helpers import run_ok

    config = M.tiny_config("qwen3_moe")
    config.num_experts, config.moe_intermediate_size = 16, 4096
    config.save_pretrained(tmp_path / "model")
    rows = ["--seq-len", "64", "--batch", "2"]
    run_ok([sys.executable, "-m", "cptune", "search", "--model", "model", *rows, "--nproc", "2", "--min-seconds", "0",
            "--memory-budget", "2GiB", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", "r.yaml"], tmp_path)
    recipe = cptune.load_recipe(tmp_path / "r.yaml")
    assert recipe.config.ep_degree == 2, recipe.config
    assert "experts split over groups of 2 ranks" in CliRunner().invoke(main, ["show", str(tmp_path / "r.yaml")]).output
    run_ok([sys.executable, "-m", "cptune.examples.train_hf", "--model", "model", *rows, "--steps", "3",
            "--losses-out", "one.json"], tmp_path)
    launch = [sys.executable, "-m", "cptune", "launch", "r.yaml", "config.mesh_shape=[1,2]", "--", "--batch", "2",
              "--checkpoint-dir", "ck"]
    run_ok([*launch, "--steps", "2", "--losses-out", "first.json"], tmp_path)
    run_ok([*launch, "--steps", "3", "--resume", "--losses-out", "cp.json"], tmp_path)
    one, first, cp = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("one", "first", "cp"))
    assert (cp["cp"], cp["start"], len(first["losses"] + cp["losses"])) == (2, 2, 3), cp
    assert max(abs(a - b) for a, b in zip(one["losses"], first["losses"] + cp["losses"])) <= 1e-5, (one, first, cp)
    other = subprocess.run([*launch[:5], "config.ep_degree=1", *launch[5:], "--steps", "4", "--resume"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "resume: the newest checkpoint in ck (step-3) keeps its experts split over ep 2" \
        in other.stdout + other.stderr and "Traceback" not in other.stderr, other.stderr


@needs_grouped
def test_a_checkpoint_names_each_groups_experts_apart_through_wrappers():
    """The names a checkpoint keeps each ep group's experts under match the state dict's, whether a layer is wrapped by
    activation checkpointing or compiled as a module (both put a name in the parameters' paths that
    ``get_state_dict`` takes out); a name the state dict lacks is refused by name, never saved as one for all."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from cptune.experts._parallel import keep

    model = cptune.models.build_model(M.tiny_config("qwen3_moe"), "cpu")
    for module in cptune.experts.experts_modules(model).values():
        keep(module, 1, 2)  # as ep rank 1 of 2 keeps them: experts 2 and 3 of 4
    layers = model.model.layers
    layers[0], layers[1] = checkpoint_wrapper(layers[0]), torch.compile(layers[1])
    names = cptune.experts.saved_names(model)
    assert len(names) == 4 and all(v.endswith("@experts2-3of4") for v in names.values()), names
    state, optim = cptune.experts.renamed(*get_state_dict(model, torch.optim.AdamW(model.parameters())), names)
    assert set(names.values()) <= set(state) and not set(names) & set(state)
    with pytest.raises(cptune.ValidationError, match="model: has split experts the state dict does not name"):
        cptune.experts.renamed({}, {}, names)
