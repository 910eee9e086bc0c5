"""CP inside a real training step: activation checkpointing, torch.compile, FSDP2 and DDP.

Every case compares loss and parameter gradients (averaged over ranks, as FSDP/DDP do) with
one process running the same model on the whole sequence.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import cptune
from tests._helpers import max_err
from tests._models import Block, TwoBlocks

TOL = 1e-5


def _average_grads(model, group=None):
    size = dist.get_world_size(group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def _compare(model, ref, loss, ref_loss):
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    grad_err = max(max_err(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters()))
    return {"loss_err": abs(loss.item() / dist.get_world_size() - ref_loss.item()), "grad_err": grad_err}


def _step_case(ac, rotate="alltoall", lb=True, compiled=False, after=False, no_restore=False, seq_len=32,
               **strategy):
    torch.manual_seed(0)
    model = TwoBlocks(ac)
    ref = copy.deepcopy(model)
    x = torch.randn(2, seq_len, 32)
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    run = torch.compile(model) if compiled else model
    xs = x.clone()
    config = cptune.CPConfig(rotate_method=rotate, load_balance=lb, **strategy)
    try:
        with cptune.context_parallel(buffers=[xs], seq_dims=[1], config=config,
                                     no_restore=[xs] if no_restore else ()):
            loss = run(xs).square().mean()
            if not after:
                loss.backward()
        if after:
            loss.backward()
    except cptune.CPTuneError as exc:
        return {"error": str(exc), "restored": tuple(xs.shape)}
    _average_grads(model)
    return _compare(model, ref, loss, ref_loss)


@pytest.mark.parametrize("ac", TwoBlocks.AC)
def test_activation_checkpointing_matches_one_process(ranks, ac):
    for r in ranks(2).run(_step_case, ac):
        assert r.get("loss_err", 1) <= TOL and r["grad_err"] <= TOL, r


@pytest.mark.parametrize("ac,rotate,lb", [("full", "allgather", False), ("selective", "alltoall", True),
                                          ("reentrant", "allgather", True)])
def test_activation_checkpointing_four_ranks(ranks, ac, rotate, lb):
    for r in ranks(4).run(_step_case, ac, rotate, lb):
        assert r.get("loss_err", 1) <= TOL and r["grad_err"] <= TOL, r


@pytest.mark.parametrize("ac", ["full", "reentrant", "wrapper"])
def test_checkpointed_backward_after_block_is_a_clear_error(ranks, ac):
    for r in ranks(2).run(_step_case, ac, after=True, no_restore=True):
        assert "activation checkpointing" in r["error"] and "backward() inside" in r["error"], r


def _held_buffer_case():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _step_case("none", after=True)
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, cptune.CPTuneWarning)]
    return result


def test_in_place_buffer_held_by_autograd_stays_sharded_and_backward_after_is_exact(ranks):
    for rank, r in enumerate(ranks(2).run(_held_buffer_case)):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r  # the backward after the block is exact
        if rank == 0:
            assert len(r["warnings"]) == 1 and "buffers[0] left sharded" in r["warnings"][0], r
            assert "no_restore" in r["warnings"][0]
    for r in ranks(2).run(_step_case, "none", after=True, no_restore=True):  # on purpose: no warning needed
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r


def _compiled_case(world_configs, ac):
    """One compiled model through every configuration: each must equal eager one process."""
    results = []
    for rotate, lb, *strategy in world_configs:
        extra = strategy[0] if strategy else {}
        results.append({"config": (rotate, lb, extra), **_step_case(ac, rotate, lb, compiled=True, **extra)})
    return results


_CONFIGS = [(rotate, lb) for rotate in ("allgather", "alltoall") for lb in (True, False)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_torch_compile_matches_one_process(ranks, world, ac):
    for per_rank in ranks(world).run(_compiled_case, _CONFIGS, ac):
        for r in per_rank:
            assert r.get("loss_err", 1) <= TOL and r["grad_err"] <= TOL, r


_ULYSSES = {"strategy": "ulysses"}
_HYBRID = {"strategy": "hybrid", "ulysses_degree": 2}


@pytest.mark.parametrize("world,ac,strategy", [
    (2, "full", _ULYSSES), (2, "selective", _ULYSSES), (2, "selective-ring", _ULYSSES), (2, "reentrant", _ULYSSES),
    (4, "full", _HYBRID), (4, "selective-ring", _HYBRID)])
def test_activation_checkpointing_ulysses_and_hybrid(ranks, world, ac, strategy):
    lb = "auto" if strategy is _ULYSSES else True
    for r in ranks(world).run(_step_case, ac, "alltoall", lb, **strategy):
        assert r.get("loss_err", 1) <= TOL and r["grad_err"] <= TOL, r


def test_checkpointed_ulysses_backward_after_block_is_a_clear_error(ranks):
    for r in ranks(2).run(_step_case, "full", "alltoall", "auto", after=True, no_restore=True, **_ULYSSES):
        assert "activation checkpointing" in r["error"], r


@pytest.mark.parametrize("world,configs", [(2, [("alltoall", "auto", _ULYSSES)]),
                                           (4, [("allgather", True, _HYBRID), ("alltoall", False, _HYBRID)])])
def test_torch_compile_ulysses_and_hybrid(ranks, world, configs):
    for ac in ("none", "full"):
        for per_rank in ranks(world).run(_compiled_case, configs, ac):
            for r in per_rank:
                assert r.get("loss_err", 1) <= TOL and r["grad_err"] <= TOL, r


def _fullgraph_case(ac, strategy=None):
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = Block()
    fn = (lambda x: checkpoint(block, x, use_reentrant=False)) if ac else block
    compiled = torch.compile(fn, fullgraph=True)  # any graph break raises
    graphs = []
    for _ in range(2):
        x = torch.randn(2, 32, 32)
        with cptune.context_parallel(buffers=[x], seq_dims=[1], config=cptune.CPConfig(**(strategy or {}))):
            compiled(x).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.parametrize("ac,strategy", [(False, None), (True, None), (True, _ULYSSES)])
def test_attention_block_compiles_fullgraph_without_recompiling(ranks, ac, strategy):
    for graphs in ranks(2).run(_fullgraph_case, ac, strategy):
        assert graphs == [1, 1], graphs


def _compiled_decorated_step_case():
    torch.manual_seed(0)
    model = TwoBlocks("full")
    ref = copy.deepcopy(model)
    x = torch.randn(2, 32, 32)
    ref_loss = ref(x).square().mean()
    ref_loss.backward()

    @torch.compile
    @cptune.context_parallel(seq_dims={"x": 1}, config=cptune.CPConfig(rotate_method="alltoall"))
    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = train_step(x)
    _average_grads(model)
    return {**_compare(model, ref, loss, ref_loss), "x": tuple(x.shape)}


def test_compiled_decorated_step(ranks):
    for r in ranks(2).run(_compiled_decorated_step_case):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["x"] == (2, 32, 32), r


# -- data parallelism around CP: FSDP2 and DDP --------------------------------------------


def _dp_case(wrap, mesh_shape, micro_batches=1, ac="none", strategy=None):
    """``wrap``: "fsdp" over dp x cp (flattened), or "ddp" over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dp, cp = mesh_shape
    torch.manual_seed(0)
    model = TwoBlocks(ac)
    ref = copy.deepcopy(model)
    data = torch.randn(2 * dp, 32, 32)  # the global batch: 2 rows per replica
    ref_loss = ref(data).square().mean()
    ref_loss.backward()

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    if wrap == "fsdp":
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if dp > 1 else mesh["cp"]
        for block in model.blocks:
            fully_shard(block, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
    else:
        model = DistributedDataParallel(model)
    rows = data[mesh["dp"].get_local_rank() * 2:][:2]
    losses = []
    for i, micro in enumerate(rows.chunk(micro_batches)):
        x = micro.clone()
        if wrap == "fsdp":  # reduce gradients once, after the last micro-batch
            model.set_requires_gradient_sync(i == micro_batches - 1)
        with cptune.context_parallel(buffers=[x], seq_dims=[1], mesh=mesh, config=cptune.CPConfig(**(strategy or {}))):
            loss = model(x).square().mean() / micro_batches
            loss.backward()
        losses.append(loss.detach())
    loss = sum(losses)
    dist.all_reduce(loss)
    grad_err = 0.0
    for p, r in zip(model.parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_err = max(grad_err, max_err(grad, r.grad))
    return {"loss_err": abs(loss.item() / dist.get_world_size() - ref_loss.item()), "grad_err": grad_err}


@pytest.mark.parametrize("world,wrap,shape,micro,ac", [
    (2, "fsdp", (1, 2), 1, "full"),
    (2, "fsdp", (1, 2), 2, "none"),  # gradient accumulation over two micro-batches
    (4, "fsdp", (2, 2), 1, "selective"),  # torchtitan's layout: FSDP over the flattened dp x cp mesh
    (4, "ddp", (2, 2), 1, "none"),
])
def test_data_parallel_wrappers_compose(ranks, world, wrap, shape, micro, ac):
    for r in ranks(world).run(_dp_case, wrap, shape, micro, ac):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r


@pytest.mark.parametrize("shape,strategy", [((2, 2), _ULYSSES), ((1, 4), _HYBRID)])
def test_fsdp_with_ulysses_and_hybrid(ranks, shape, strategy):
    for r in ranks(4).run(_dp_case, "fsdp", shape, 1, "full", strategy):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r


def _one_rank_ring_case(device_type, backends, dtype_name):
    """The GPU check's core (benchmarks.gpu.ring_check) on CPU: the ring through a 1-rank group."""
    from benchmarks.gpu import ring_check

    group, _ = dist.new_subgroups(group_size=1)
    return ring_check(torch.device(device_type), backends, getattr(torch, dtype_name), seq_len=256, heads=4,
                      head_dim=32, group=group)


def test_ring_through_one_rank_group_cpu(ranks):
    rows = ranks(2).run(_one_rank_ring_case, "cpu", ["flash"], "float32")[0]
    assert [r["compiled"] for r in rows] == [False, True]
    for r in rows:
        assert r["out_err"] <= TOL and max(r["grad_errs"]) <= 1e-4, r
