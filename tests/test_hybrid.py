"""Hybrid models under CP by the generic path (cptune/mixers/_generic.py): each layer that mixes tokens outside attention
(Gated DeltaNet, LFM2's short convolution, Mamba2) runs whole over the sequence gathered over cp, and each rank keeps
its positions. On 2 real ranks, one such layer fed the same input as one process gives the same output, input
gradient and parameter gradients (float32, 1e-5 of each tensor's largest), under the ring with and without load
balancing and under Ulysses, and with packed documents restarting the layer at each document. Whole models of every
hybrid family are in the support matrix (tests/test_matrix.py)."""

import pytest
import torch
import torch.distributed as dist

import cptune
from benchmarks import matrix as M
from cptune import models
from cptune.mixers import _generic as _gathered
from cptune.mixers import _halo
from cptune.mixers import _heads
from cptune.mixers import _choice as _paths

transformers = pytest.importorskip("transformers")

LAYERS = {"qwen3_next": "linear_attn", "qwen3_5_text": "linear_attn", "lfm2": "conv", "bamba": "mamba",
          "granitemoehybrid": "mamba"}
SEQ = 32
LENGTHS = (11, 5, 16)


def _layer(family: str) -> torch.nn.Module:
    model = models.build_model(M.tiny_config(family), "cpu")
    index = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer, LAYERS[family]))
    return getattr(model.model.layers[index], LAYERS[family])


def _split_by_heads(family: str) -> bool:
    """Whether this transformers has ``family`` and builds it here, its mixer in a form the heads path splits."""
    try:
        return M.tiny_config(family) is not None and _heads.splittable(_layer(family))
    except cptune.ValidationError:  # Bamba and Granite 4 on 4.56: cannot be built on the meta device (named)
        return False


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _one_layer(family: str, config: dict, packed: bool, path: str = "generic") -> dict[str, float]:
    """The layer's output, input gradient and parameter gradients on this rank's positions under the block, summed
    over ranks, against one process on the whole sequence (each document alone when packed), whose loss is summed
    the same way: each rank's positions' share, backward, then the next (a Gated DeltaNet's A_log and dt_bias
    gradients are sums that nearly cancel, which move by 5e-5 of their largest from how they are grouped); on the
    heads path, which sums each head's over the whole sequence on one rank, in one backward."""
    from cptune import attention as A
    from cptune._session import active

    module = _layer(family)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, SEQ, M.BASE["hidden_size"], generator=gen, requires_grad=True)
    weight = torch.randn(2, SEQ, M.BASE["hidden_size"], generator=gen)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]).view(1, SEQ) if packed else None

    if path != "generic":
        assert {"halo": _halo, "heads": _heads}[path].splittable(module)
        _paths.prepare(module)
    else:
        _gathered.run_whole(module)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with cptune.context_parallel(buffers=[ids], seq_dims=[1], config=cptune.CPConfig(**config),
                                 documents=documents) as block:
        session = active()
        layout, world = session.layout, session.cp
        out = module(A.shard(x, 1, layout, session.cp_rank))
        (out * A.shard(weight, 1, layout, session.cp_rank)).sum().backward()
        got = block.unshard(out.detach(), 1)
        taken = getattr(module, "_cptune_path", "generic")
        assert taken == path, (path, taken)
    dist.all_reduce(x.grad)
    got_x, got_grads = x.grad.clone(), {n: p.grad.clone() for n, p in module.named_parameters()}
    for p in got_grads:
        dist.all_reduce(got_grads[p])
    module.zero_grad()
    x.grad = None

    if packed:
        bounds = torch.tensor((0, *LENGTHS)).cumsum(0).tolist()
        want = torch.cat([module(x[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    else:
        want = module(x)
    shares = range(world) if path != "heads" else [None]  # the heads path sums each head's in one place
    for rank in shares:  # one process, its loss in each rank's share
        positions = A.shard(torch.arange(SEQ).view(1, SEQ), 1, layout, rank).flatten() if rank is not None \
            else torch.arange(SEQ)
        (want[:, positions] * weight[:, positions]).sum().backward(retain_graph=True)
    errors = {"output": _relative(got, want.detach()), "input grad": _relative(got_x, x.grad)}
    errors.update({name: _relative(got_grads[name], p.grad) for name, p in module.named_parameters()})
    return errors


CONFIGS = {"ring, load balanced": {"load_balance": True}, "ring, in order": {"load_balance": False},
           "ulysses": {"strategy": "ulysses"}}
HYBRID_4 = {"mesh_shape": (1, 4), "strategy": "hybrid", "ulysses_degree": 2, "load_balance": True}


@pytest.mark.parametrize("family", list(LAYERS))
def test_a_token_mixing_layer_is_exact_by_the_generic_path(ranks, family):
    if M.tiny_config(family) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    try:
        models.empty_model(M.tiny_config(family))
    except cptune.ValidationError as exc:  # Bamba on 4.56: this transformers cannot build it (named)
        assert "cannot build it on the meta device" in str(exc), exc
        pytest.skip(str(exc))
    group = ranks(2)
    for label, config in CONFIGS.items():
        for packed in (False, True):
            for errors in group.run(_one_layer, family, config, packed):
                assert max(errors.values()) <= 1e-5, (family, label, packed, errors)


def test_a_short_convolution_is_exact_split_by_the_halo_exchange(ranks):
    """LFM2's ShortConv on each rank's own tokens, the k - 1 before each of its runs received from the ranks holding
    them: on 2 ranks under every layout above, packed and not, and on 4 ranks as a hybrid (2 ring shards of 2
    Ulysses pieces, load balanced: runs of 4 tokens whose halo comes from other ranks)."""
    cases = [(2, config) for config in CONFIGS.values()] + [(4, HYBRID_4)]
    for world, config in cases:
        for packed in (False, True):
            for errors in ranks(world).run(_one_layer, "lfm2", config, packed, "halo"):
                assert max(errors.values()) <= 1e-5, (config, packed, errors)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "bamba", "granitemoehybrid"])
def test_gated_deltanet_and_mamba2_are_exact_split_over_their_heads(ranks, family):
    """Gated DeltaNet and Mamba2 on each rank's tokens for their projections and norm, the recurrence on cp-th of the
    heads over the whole sequence (an all-to-all each way; Mamba2's convolution by the halo exchange, its B and C
    gathered): on 2 ranks under every layout above, packed and not, and on 4 ranks as a hybrid (2 ring shards of 2
    Ulysses pieces, load balanced)."""
    if not _split_by_heads(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}, or not in a form split by heads")
    cases = [(2, config) for config in CONFIGS.values()] + [(4, HYBRID_4)]
    for world, config in cases:
        for packed in (False, True):
            for errors in ranks(world).run(_one_layer, family, config, packed, "heads"):
                assert max(errors.values()) <= 1e-5, (config, packed, errors)


@pytest.mark.parametrize("family,ac,compile", [("qwen3_5_text", "full", True), ("bamba", "selective", False)])
def test_split_mixers_are_exact_in_whole_models_under_checkpointing_and_compile(ranks, family, ac, compile):
    """Whole tiny models as the training paths build them (activation checkpointing, the decoder layers compiled),
    packed documents, under cp 2: loss and every parameter gradient as one process's (the support matrix's
    judgement), the mixers split over heads."""
    if not _split_by_heads(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}, or not in a form split by heads")
    for cell in ranks(2).run(M._cp_cell, family, "ring", True, ac, compile):
        assert cell["status"] == "exact" and cell["paths"] == ["heads"], cell


def test_outside_a_block_and_with_cp_1_the_layer_is_called_as_it_is():
    module = _layer("lfm2")
    x = torch.randn(1, 8, M.BASE["hidden_size"])
    want = module(x)
    _gathered.run_whole(module)
    _gathered.run_whole(module)  # idempotent
    assert torch.equal(module(x), want)
    with cptune.context_parallel(buffers=[torch.zeros(1, 8)], seq_dims=[1], config=cptune.CPConfig(mesh_shape=(1, 1))):
        assert torch.equal(module(x), want)


def test_search_a_hybrid_then_train_it_under_cp_from_a_bf16_checkpoint(tmp_path):
    """Qwen3.5 (Gated DeltaNet) from a bf16 checkpoint in several files: ``cptune search --model`` measures it on 2
    ranks, its mixers split over heads and whole, and writes a recipe; ``cptune show`` says which path its layers
    take; ``cptune launch`` trains it under cp 2 (the recipe's mesh overridden when the search chose dp), packed
    documents, and its losses are one process's."""
    import sys

    from tests.test_build import _save
    from tests.test_train_hf import SCRIPT, losses, run

    config = M.tiny_config("qwen3_5_text")
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    folder = _save(config, tmp_path / "qwen3_5")
    assert len(list(folder.glob("*.safetensors"))) >= 2
    found = run([sys.executable, "-m", "cptune", "search", "--model", str(folder), "--seq-len", "64", "--documents",
                 "2", "--nproc", "2", "--memory-budget", "4GiB", "--min-seconds", "0.1", "--out", "h.yaml"], tmp_path)
    assert "best: " in found.stdout and "mixers-whole" in found.stdout, found.stdout  # both paths measured
    recipe = cptune.load_recipe(tmp_path / "h.yaml")
    cptune.save_recipe(recipe.with_overrides(["config.mesh_shape=[1,2]"]), tmp_path / "cp2.yaml")
    shown = run([sys.executable, "-m", "cptune", "show", "cp2.yaml"], tmp_path).stdout
    way = {"split": "split over heads (all-to-all)", "whole": "whole on every rank (generic path)"}[recipe.config.mixers]
    assert f"mixers   : 3 x Qwen3_5GatedDeltaNet {way}" in shown, shown
    assert recipe.workload.model == str(folder) and recipe.metrics.measured
    run([sys.executable, "-m", "cptune", "launch", "h.yaml", "config.mesh_shape=[1,2]", "--", SCRIPT, "--weights",
         "--steps", "2", "--losses-out", "cp.json"], tmp_path)
    run([sys.executable, SCRIPT, "--model", str(folder), "--weights", "--seq-len", "64", "--batch", "1",
         "--documents", "2", "--steps", "2", "--losses-out", "one.json"], tmp_path)
    one, cp = losses(tmp_path / "one.json"), losses(tmp_path / "cp.json")
    assert cp["cp"] == 2 and max(abs(x - y) for x, y in zip(cp["losses"], one["losses"])) <= 1e-5, (cp, one)
