"""The named mesh (dp_replicate x dp_shard x cp x tp): its rules, (dp, cp) configurations read as before, and the
block on a mesh with a tp dim: buffers sharded over cp only, attention on each tp rank's heads exact, replicas and
token counts over the data-parallel dims only, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cptune
from cptune.attention import _documents
from cptune.errors import ValidationError
from cptune.mesh import ParallelDims
from cptune.recipe import load_recipe
from tests._helpers import max_err, write_recipe
from tests.test_numerics import FP32_TOL


# -- the type -----------------------------------------------------------------------------------


def test_a_dp_cp_shape_is_the_named_mesh_without_tp():
    assert ParallelDims.from_shape((2, 4), 8) == ParallelDims(1, 2, 4, 1)
    assert ParallelDims.from_shape((-1, 2), 8) == ParallelDims(1, 4, 2, 1)
    assert ParallelDims.from_shape(None, 8) == ParallelDims(cp=8)
    assert ParallelDims.from_shape((2, 1, -1, 2), 16) == ParallelDims(2, 1, 4, 2)
    dims = ParallelDims(2, 2, 2, 2)
    assert (dims.world, dims.dp, dims.label()) == (16, 4, "dpr2·dp2·cp2·tp2")
    assert [dims.replica(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]  # the cp x tp ranks of a replica: neighbours
    assert cptune.CPConfig(mesh_shape=(2, 2)).label() == "dp2·cp2 allgather lb-auto default"  # as before
    assert cptune.CPConfig(mesh_shape=(1, 1, 2, 2)).label().startswith("dp1·cp2·tp2 ")
    assert cptune.CPConfig(mesh_shape=(1, -1, 2, 2)).resolve_mesh_shape(8) == (2, 2)


def test_ep_folds_over_dp_shard_x_cp_and_multiplies_nothing(monkeypatch):
    """ep (torchtitan's and Megatron-Core's fold): the world is dp_replicate x dp_shard x cp x tp alone; ep must
    divide dp_shard x cp, and beside tp or dp_replicate it is refused by name (not built); recipes without it read
    as ep 1, keyed and labelled as before."""
    config = cptune.CPConfig(mesh_shape=(2, 2), ep_degree=4)
    dims = config.parallel_dims(4)
    assert (dims.world, dims.ep, dims.label(), config.label()) == (4, 4, "dp2·cp2 ep4",
                                                                  "dp2·cp2 allgather lb-auto default ep4")
    assert cptune.CPConfig(mesh_shape=(2, 2)).parallel_dims().ep == 1
    for shape, ep, said in (((2, 2), 3, "config.ep_degree: is 3, which does not divide the 4 ranks of dp_shard x cp"),
                            ((1, 1, 2, 2), 2, "config.ep_degree: is 2 on dp1·cp2·tp2"),
                            ((2, 1, 2, 1), 2, "config.ep_degree: is 2 on dpr2·dp1·cp2")):
        with pytest.raises(ValidationError, match=said.replace("·", ".")):
            cptune.CPConfig(mesh_shape=shape, ep_degree=ep).parallel_dims()
    with pytest.raises(ValidationError, match="ep_degree: Input should be greater than or equal to 1"):
        cptune.CPConfig(ep_degree=0)
    from cptune.plan import config_from, config_key

    assert config_key(config_from({"mesh": "2x2", "rotate_method": "alltoall", "sdpa_backend": "flash",
                                   "load_balance": True})) == "dp2-cp2-alltoall-lb-flash"  # as before ep
    assert config_key(config.model_copy(update={"sdpa_backend": ("flash",)})).startswith("dp2-cp2-ep4-")
    from cptune.examples import _options as options

    monkeypatch.setenv("WORLD_SIZE", "4")  # a script whose model has no experts refuses ep before any rank starts
    assert options.mesh_and_batch(config, None, None, ep=True)[0].ep == 4
    with pytest.raises(ValidationError, match="config.ep_degree: is 4, and this script's model has no mixture"):
        options.mesh_and_batch(config, None, None, tp=True)


@pytest.mark.parametrize("shape,world,match", [
    ((1, 2, 2, 2), 4, r"config.mesh_shape: \(1, 2, 2, 2\) does not multiply to the world size 4.*dp_replicate"),
    ((3, 2), 4, r"config.mesh_shape: \(3, 2\) does not multiply.*dp \* cp == 4"),
])
def test_a_mesh_that_is_not_the_world_is_named(shape, world, match):
    with pytest.raises(ValidationError, match=match):
        cptune.CPConfig(mesh_shape=shape).parallel_dims(world)


@pytest.mark.parametrize("shape,match", [((1, 2, 3), "has 3 degrees: give 2"), ((1, -1, 1, -1), "at most one -1"),
                                         ((1, 0, 1, 1), "must be positive")])
def test_a_malformed_mesh_shape_is_named(shape, match):
    with pytest.raises(ValidationError, match=f"mesh_shape: .*{match}"):
        cptune.CPConfig(mesh_shape=shape)
    # inside a recipe: named by its path in the recipe, once, not as the config's whole repr
    data = load_recipe("recipes/cpu-2r-s1024-noncausal.yaml").model_dump(mode="json")
    data["config"]["mesh_shape"] = list(shape)
    from cptune.recipe import Recipe

    with pytest.raises(ValidationError) as raised:
        Recipe(**data)
    assert [p.argument for p in raised.value.problems] == ["config.mesh_shape"]
    assert match in raised.value.problems[0].message and "rotate_method" not in str(raised.value)


def test_tp_that_does_not_split_the_model_is_named_all_at_once():
    problems = ParallelDims(tp=4).model_problems(heads=10, kv_heads=2, intermediate=30, ulysses=1)
    assert [p.argument for p in problems] == ["mesh.tp"] * 3
    assert ["2 key/value heads" in p.message for p in problems] == [False, True, False]
    assert ParallelDims(tp=2).model_problems(heads=8, kv_heads=2, intermediate=64) == []
    ulysses = ParallelDims(cp=4, tp=2).model_problems(heads=12, ulysses=4)
    assert [p.argument for p in ulysses] == ["config.ulysses_degree"] and "6 query heads each" in ulysses[0].message
    assert ParallelDims(cp=4, tp=2).model_problems(heads=16, ulysses=4) == []
    with pytest.raises(ValidationError, match="mesh.tp: is 0"):
        ParallelDims(tp=0)


def test_tp_across_nodes_is_allowed_with_a_warning():
    assert ParallelDims(cp=2, tp=8).node_warning(8) is None
    assert "spans more than one node of 4 ranks" in ParallelDims(cp=2, tp=8).node_warning(4)
    assert ParallelDims(tp=8).node_warning(None) is None


def test_recipes_written_before_the_named_mesh_load_and_verify_as_before():
    recipe = load_recipe("recipes/cpu-2r-s1024-noncausal.yaml")
    assert recipe.config.mesh_shape == (2, 1) and recipe.config.parallel_dims(2) == ParallelDims(dp_shard=2)
    assert recipe.figures_apply  # its digest still matches: the mesh's new dims are not written at their defaults


def test_what_runs_or_prices_dp_x_cp_only_refuses_tp_by_name(monkeypatch):
    """The Llama example, the Trainer and the proxy's memory model split no layer by tp: a tp recipe is refused,
    not run (or priced) as if it were dp x cp; train_hf takes it."""
    from cptune.examples._options import mesh_and_batch

    monkeypatch.setenv("WORLD_SIZE", "4")
    tp = cptune.CPConfig(mesh_shape=(1, 1, 2, 2))
    with pytest.raises(ValidationError, match=r"config.mesh_shape: is dp1·cp2·tp2: this script splits no model .* "
                       r"\(dp, cp\) meshes only. Fix: give a \(dp, cp\) mesh"):
        mesh_and_batch(tp, None, None)
    assert mesh_and_batch(tp, None, None, tp=True) == (ParallelDims(1, 1, 2, 2), 2)  # train_hf splits by the plan
    assert mesh_and_batch(cptune.CPConfig(mesh_shape=(1, 2, 2, 1)), None, None) == (ParallelDims(1, 2, 2, 1), 2)
    with pytest.raises(ValidationError, match="the attention proxy's memory model prices"):
        tp.dp_cp()


def test_check_names_a_tp_the_heads_cannot_take_and_notes_one_across_nodes(tmp_path):
    from cptune.cli._recipe_check import check_recipe, recipe_notes
    from cptune.recipe import Recipe

    data = load_recipe("recipes/cpu-2r-s1024-noncausal.yaml").model_dump(mode="json")  # 8 heads
    data["config"]["mesh_shape"], data["launch"]["nnodes"], data["launch"]["nproc_per_node"] = [1, 1, 1, 16], 2, 8
    recipe = Recipe(**data)
    assert [p.message for p in check_recipe(recipe) if p.argument == "config.mesh_shape"] == [
        "16 does not divide the 8 query heads", "16 does not divide the 8 key/value heads"]
    assert recipe_notes(recipe) == ["tp=16 spans more than one node of 8 ranks: every layer's reductions cross the "
                                    "inter-node link; use a tp that divides the ranks per node"]
    data["config"]["mesh_shape"] = [2, 1, 1, 8]  # HSDP across the two nodes, tp inside each
    assert recipe_notes(Recipe(**data)) == [] and Recipe(**data).config.label().startswith("dpr2·dp1·cp1·tp8 ")
    from click.testing import CliRunner

    from cptune.cli import main
    from cptune.recipe import save_recipe

    data["workload"]["model"] = "tests/models/tiny-llama"
    shown = CliRunner().invoke(main, ["show", str(save_recipe(Recipe(**data), tmp_path / "tp.yaml"))]).output
    assert "config   : dpr2·dp1·cp1·tp8 " in shown and "FSDP2 over dp x cp, tp by the model's own plan" in shown


# -- on ranks -------------------------------------------------------------------------------------


def _mesh_case(source, strategy="ring", rotate="allgather", lb="auto", documents=None, window=None, heads=8,
               kv_heads=4):
    """One attention call on a mesh with tp: each tp rank gives the block its own heads (as a column-parallel
    q/k/v projection makes them), the same tokens on every tp rank. Output and q/k/v grads against one process,
    and what the block says about replicas and token counts."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    config = {"strategy": strategy, "rotate_method": rotate, "load_balance": lb}
    if source == "config":  # cptune builds the mesh: (dp_replicate, dp_shard, cp, tp)
        dims, mesh = ParallelDims(1, 1, 2, 2), None
        config["mesh_shape"] = dims.shape
    else:  # the user's mesh, named as torchtitan names it
        names, shape = {"cp-tp": (("cp", "tp"), (2, 2)), "dp-tp": (("dp_shard", "cp", "tp"), (2, 1, 2)),
                        "tp-only": (("cp", "tp"), (1, 4))}[source]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dims = ParallelDims.of_mesh(mesh)[0]
    tp_rank, replica = rank % dims.tp, dims.replica(rank)
    seq_len, batch = 32, 2
    gen = torch.Generator().manual_seed(11 + replica)  # each replica its own data; the tp ranks of one the same
    qkv = [torch.randn(batch, h, seq_len, 8, generator=gen) for h in (heads, kv_heads, kv_heads)]
    grad = torch.randn(batch, heads, seq_len, 8, generator=gen)
    docs = cptune.documents_from_lengths(documents) if documents else None
    mask = _documents.dense_mask(docs, window, True, seq_len) if docs is not None or window else None
    ref = [t.clone().requires_grad_() for t in qkv]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    (ref_out * grad).sum().backward()
    q_heads, kv = heads // dims.tp, kv_heads // dims.tp
    mine = [slice(tp_rank * q_heads, (tp_rank + 1) * q_heads)] + [slice(tp_rank * kv, (tp_rank + 1) * kv)] * 2
    leaves = [t[:, s].clone().requires_grad_() for t, s in zip(qkv, mine)]
    g = grad[:, mine[0]].clone()
    labels = torch.arange(batch * seq_len).reshape(batch, seq_len) % 3 - 1  # -1: ignored, unevenly over ranks
    labels[:, : 4 * replica] = -1
    with cptune.context_parallel(buffers=[*leaves, g, labels], seq_dims=[2, 2, 2, 2, 1], mesh=mesh,
                                 config=cptune.CPConfig(**config), causal=True, documents=docs, window=window,
                                 no_restore=[g]) as cp:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (cp.cp_size * (out * g).sum()).backward()
        full = cp.unshard(out, 2)
        items = cp.num_items_in_batch(labels, ignore_index=-1).item()
        local_len = out.shape[2]
    every = torch.tensor(float((labels != -1).sum()))  # this replica's valid tokens, whole sequence
    dist.all_reduce(every)  # over the world: each replica counted cp x tp times (the labels are whole here)
    rows = cptune.replica_rows(4 * dims.dp, mesh=mesh) if mesh is not None else \
        cptune.replica_rows(4 * dims.dp, config=config)
    return {"out": max_err(full, ref_out[:, mine[0]]),
            "grads": [max_err(a.grad, b.grad[:, s]) for a, b, s in zip(leaves, ref, mine)],
            "local_len": local_len, "cp": cp.cp_size, "dp": cp.dp_size, "dp_rank": cp.dp_rank, "replica": replica,
            "items": items, "want_items": every.item() / (dims.cp * dims.tp) / (dims.dp * dims.cp), "world": world,
            "rows": (rows.start, rows.stop)}


MESH_CASES = [
    ("cp-tp", {}), ("cp-tp", {"rotate": "alltoall", "lb": True}), ("cp-tp", {"strategy": "ulysses"}),
    ("cp-tp", {"documents": [5, 19, 8]}), ("cp-tp", {"window": (6, 0)}),
    ("cp-tp", {"documents": [12, 20], "lb": False}),
    ("config", {}), ("config", {"strategy": "ulysses", "documents": [16, 16]}),
    ("dp-tp", {}), ("tp-only", {"heads": 8, "kv_heads": 4}),
]


def _mesh_sweep(cases):
    return [((source, kwargs), _mesh_case(source, **kwargs)) for source, kwargs in cases]


def test_the_block_on_a_mesh_with_tp_is_exact_and_counts_replicas_over_dp_only(ranks):
    """tp2·cp2 (the user's mesh and cptune's), ring both rotations, Ulysses over each tp rank's heads, packed
    documents and a window; dp2·tp2 and tp4: each tp rank's output and gradients equal one process's on its heads;
    the tp ranks of a replica hold the same rows and the block counts tokens over cp x dp, never tp."""
    for per_rank in zip(*ranks(4).run(_mesh_sweep, MESH_CASES)):
        for (source, kwargs), r in per_rank:
            assert r["out"] <= FP32_TOL and max(r["grads"]) <= FP32_TOL, (source, kwargs, r)
            cp, dp = {"dp-tp": (1, 2), "tp-only": (1, 1)}.get(source, (2, 1))
            assert (r["cp"], r["dp"], r["local_len"]) == (cp, dp, 32 // cp), (source, r)
            assert r["dp_rank"] == r["replica"] and r["rows"] == (4 * r["replica"], 4 * r["replica"] + 4), (source, r)
            assert r["items"] == pytest.approx(r["want_items"]), (source, r)


def _trainer_refusal():
    import cptune.hf

    try:
        cptune.hf.Trainer(config=cptune.CPConfig(mesh_shape=(1, 1, 2, 2)))
    except ValidationError as exc:
        return str(exc)
    return None


def test_the_trainer_refuses_a_tp_configuration_by_name_before_it_builds_anything(ranks):
    pytest.importorskip("transformers")
    for said in ranks(4).run(_trainer_refusal):
        assert said == ("cptune: config.mesh_shape: is dp1·cp2·tp2: cptune.hf.Trainer splits no model by tensor "
                        "parallelism; it runs (dp, cp) meshes only. Fix: give a (dp, cp) mesh (dp_replicate and tp 1)")



def test_a_sequence_tp_cannot_split_is_named_before_any_rank_starts(tmp_path, monkeypatch):
    """Sequence parallelism splits each cp rank's tokens over tp: cp x tp must divide the sequence, said by name by
    the mesh, the search's space, a recipe's check and the scripts (a rank would otherwise meet it mid-forward)."""
    from cptune.plan import invalid_reason
    from cptune.examples import train_llama_cp

    dims = ParallelDims(1, 1, 2, 2)
    assert dims.sequence_problems(256) == [] and ParallelDims(1, 2, 2, 1).sequence_problems(6) == []
    (problem,) = dims.sequence_problems(6)
    assert str(problem) == ("seq_len: 6 tokens do not split over cp=2 x tp=2 ranks (sequence parallelism "
                            "splits each cp rank's tokens over tp). Fix: use a sequence length divisible by 4")
    config = cptune.CPConfig(mesh_shape=(1, 1, 2, 2), load_balance=False)
    assert "do not split over cp=2 x tp=2" in invalid_reason(cptune.Workload(seq_len=6, heads=4), config, None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    recipe = write_recipe(tmp_path / "r.yaml", cptune.Workload(seq_len=256, heads=4, kv_heads=2, head_dim=16), config)
    from cptune.cli._recipe_check import check_recipe

    short = load_recipe(recipe).model_copy(update={"workload": cptune.Workload(seq_len=6, heads=4, kv_heads=2)})
    assert [p.argument for p in check_recipe(short)] == ["workload.seq_len"], check_recipe(short)
    with pytest.raises(cptune.ValidationError, match=r"seq_len: 6 tokens do not split over cp=2 x tp=2"):
        train_llama_cp.checked(recipe_path=str(recipe), seq_len=6, batch=None, compile_=None, ac=None,
                               documents=None, fsdp=True)


def _bad_parallelize_calls() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from cptune.examples.train_llama_cp import Llama

    said = []
    for plan, mesh in (({"attn.wq": "bogus"}, None), (None, None), ({"attn.wx": "colwise"}, None),
                       ({"attn.wq": "colwise"}, init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")))):
        model = Llama()
        with pytest.raises(cptune.ValidationError) as caught:
            cptune.parallelize(model, model.blocks, mesh or ParallelDims(tp=2).model_mesh("cpu"), tp_plan=plan)
        said.append(str(caught.value))
    return said


def test_parallelize_names_a_plan_or_mesh_it_cannot_apply(ranks):
    """A style cptune does not apply, no plan with tp, a module the block does not have (torch's parallelize_module
    would only warn, and the block would run half split), a mesh that is not a model mesh: each named."""
    said = ranks(2).run(_bad_parallelize_calls)[0]
    assert said[0].startswith("cptune: tp_plan: is {'attn.wq': 'bogus'} with tp=2. Fix: map each module")
    assert said[1].startswith("cptune: tp_plan: is None with tp=2")
    assert said[2].startswith("cptune: tp_plan: names attn.wx, not modules of a Block")
    assert said[3].startswith("cptune: mesh: has 2 dims named ('a', 'b')"), said
