"""Bad input gets a cptune.ValidationError naming the argument and the fix, before any collective."""

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cptune
from cptune import _torch_cp
from cptune._validate import check_buffers, transport_problems

# -- no process group needed ----------------------------------------------------------------


def test_config_reports_every_bad_field_with_its_fix():
    with pytest.raises(cptune.ValidationError) as info:
        cptune.CPConfig(rotate_method="ring", mesh_shape=(0, 2), sdpa_backend="fast", colour=1)
    text = str(info.value)
    assert len(info.value.problems) == 4
    assert "rotate_method" in text and "'allgather' or 'alltoall'" in text
    assert "mesh_shape" in text and "dp * cp" not in text and "(dp, cp)" in text
    assert "sdpa_backend" in text and "'flash', 'efficient', 'cudnn', 'math'" in text
    assert "colour" in text and "remove it" in text
    assert isinstance(info.value, ValueError) and isinstance(info.value, cptune.CPTuneError)


def test_config_defaults_follow_pytorch():
    c = cptune.CPConfig()
    assert c.rotate_method == "allgather" and c.load_balance == "auto" and c.sdpa_backend is None
    assert c.resolve_mesh_shape(4) == (1, 4)
    assert cptune.CPConfig(mesh_shape=(2, -1)).resolve_mesh_shape(8) == (2, 4)
    assert c.load_balance_for(True) and not c.load_balance_for(False)
    with pytest.raises(cptune.ValidationError, match=r"dp \* cp == 4"):
        cptune.CPConfig(mesh_shape=(3, 1)).resolve_mesh_shape(4)


def _problems(buffers, seq_dims, cp=2, lb="auto", causal=True, **kw):
    plan, problems = check_buffers(buffers, seq_dims, cp=cp, load_balance=lb, causal=causal, device_type="cpu", **kw)
    return plan, "\n".join(str(p) for p in problems)


def test_buffer_checks_report_all_problems_at_once():
    x = torch.zeros(2, 8)
    _, text = _problems([x, nn.Parameter(torch.zeros(8)), "labels", x], [1, 0, 0, 1])
    assert "nn.Parameter" in text and "remove it from buffers" in text
    assert "is a str, not a tensor" in text
    assert "same tensor as buffers[0]" in text and "list each tensor once" in text


@pytest.mark.parametrize("buffers,seq_dims,expected", [
    ([torch.zeros(4, 8)], [1, 1], "2 seq dims for 1 buffers"),
    ({"a": torch.zeros(4, 8)}, [1], "give seq_dims as a dict"),
    ({"a": torch.zeros(4, 8)}, {"b": 1}, "missing ['a'], extra ['b']"),
    ([torch.zeros(4, 8)], [2], "use a dim in [-2, 1]"),
    ([torch.zeros(4, 8)], [1.0], "give the index of the sequence dimension"),
    ([torch.zeros(4, 8), torch.zeros(4, 6)], [1, 1], "disagree on the sequence length"),
    ([torch.zeros(4, 9)], [1], "pad the sequence to a multiple of 4"),
    ([torch.zeros(8, 4, device="meta")], [0], "move it with .to('cpu')"),
])
def test_buffer_check_messages_name_the_fix(buffers, seq_dims, expected):
    _, text = _problems(buffers, seq_dims)
    assert expected in text


def test_negative_dims_are_normalised_and_nested_buffers_flattened():
    plan, text = _problems({"ids": torch.zeros(2, 8), "pair": [torch.zeros(8), torch.zeros(1, 8, 3)]},
                           {"ids": -1, "pair": [0, -2]})
    assert text == "" and plan.dims == [1, 0, 1] and plan.seq_len == 8


def test_load_balance_needs_2cp_or_is_turned_off_with_a_reason():
    _, text = _problems([torch.zeros(1, 6)], [1], cp=2, lb=True)
    assert "divisible by 2 * cp = 4" in text and "set load_balance=False" in text
    plan, text = _problems([torch.zeros(1, 6)], [1], cp=2, lb="auto")
    assert text == "" and plan.load_balance is False and "load balancing is off" in plan.notes[0]
    _, text = _problems([torch.zeros(1, 8)], [1], cp=2, lb=True, causal=False)
    assert "only applies to causal attention" in text


def test_gloo_cannot_all_gather_cuda_tensors():
    # seen on an H200: ranks on gloo holding CUDA tensors crash in the ring's all-gather (SIGSEGV)
    (problem,) = transport_problems("cuda", "gloo", 2, "allgather")
    assert problem.argument == "config.rotate_method" and "nccl" in problem.fix and "alltoall" in problem.fix
    assert not transport_problems("cuda", "gloo", 2, "alltoall")  # its all-to-all works
    assert not transport_problems("cuda", "gloo", 1, "allgather")  # Ulysses alone: no ring
    assert not transport_problems("cuda", "nccl", 2, "allgather")
    assert not transport_problems("cpu", "gloo", 2, "allgather")


def test_no_restore_must_be_buffers():
    _, text = _problems([torch.zeros(1, 8)], [1], no_restore=[torch.zeros(1)])
    assert "list only tensors that are also in buffers" in text


def test_cp1_without_process_group_is_a_pass_through():
    q = torch.randn(1, 2, 8, 4)
    with cptune.context_parallel(buffers=[q], seq_dims=[2]) as cp:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert cp.cp_size == 1 and q.shape == (1, 2, 8, 4)
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert torch.equal(cptune.unshard(out, 2, context=cp), out)


def test_a_search_from_stdin_says_why_the_ranks_cannot_start(tmp_path):
    """`python - <<EOF`: spawned ranks cannot re-import '<stdin>'. A clear error before any rank or study,
    not 'GroupLost: rank(s) died' after each rank's traceback."""
    import subprocess
    import sys

    code = ("import cptune\nfrom cptune.search import Workload\n"
            "cptune.tune(Workload(seq_len=256, heads=2, head_dim=16), nproc=2, storage='sqlite:///s.db')\n")
    run = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("cptune.errors.CPTuneError: cannot start the ranks") and "'<stdin>' is not a file" in last
    assert "Fix: save the code to a .py file" in last and "GroupLost" not in run.stderr
    assert not (tmp_path / "s.db").exists()  # nothing made before the error


def test_without_process_group_asks_for_torchrun():
    with pytest.raises(cptune.ValidationError, match="launch with torchrun"):
        with cptune.context_parallel(config=cptune.CPConfig(mesh_shape=(1, 2))):
            pass


def test_decorator_form_checks_argument_names():
    with pytest.raises(cptune.ValidationError, match="use argument names of step"):
        @cptune.context_parallel(seq_dims={"tokens": 1})
        def step(input_ids):
            return input_ids


# -- on 2 real ranks: each bad input raises on every rank, and the group stays healthy -------


def _qkv(seq_len=16, layout="bhsd"):
    torch.manual_seed(0)
    shape = (1, 2, seq_len, 8) if layout == "bhsd" else (1, seq_len, 2, 8)
    return [torch.randn(*shape) for _ in range(3)]


def _run(kind):
    """One bad use of the public API, by name."""
    q, k, v = _qkv()
    cfg = cptune.CPConfig
    if kind == "not_divisible":
        q, k, v = _qkv(15)
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2]):
            pass
    elif kind == "lb_needs_2cp":
        q, k, v = _qkv(6)
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config=cfg(load_balance=True)):
            pass
    elif kind == "lb_non_causal":
        with cptune.context_parallel(buffers=[q], seq_dims=[2], causal=False, config=cfg(load_balance=True)):
            pass
    elif kind == "is_causal_mismatch":
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], causal=True):
            F.scaled_dot_product_attention(q, k, v)
    elif kind == "attn_mask":
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], causal=False):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    elif kind == "dropout":
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
    elif kind == "layout":
        q, k, v = _qkv(16, "bshd")
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[1, 1, 1]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif kind == "full_length_query":
        with cptune.context_parallel(buffers=[k, v], seq_dims=[2, 2]):
            F.scaled_dot_product_attention(q * 1, k, v, is_causal=True)
    elif kind == "gqa_heads":  # 4 query heads on 2 key heads without enable_gqa: plain SDPA refuses it too
        q4 = torch.randn(1, 4, 16, 8)
        with cptune.context_parallel(buffers=[q4, k, v], seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q4, k, v, is_causal=True)
    elif kind == "backend_efficient_on_cpu":
        with cptune.context_parallel(buffers=[q], seq_dims=[2], config=cfg(sdpa_backend="efficient")):
            pass
    elif kind == "backend_math_under_cp":
        with cptune.context_parallel(buffers=[q], seq_dims=[2], config=cfg(sdpa_backend=["math"])):
            pass
    elif kind == "mesh_shape_vs_world":
        with cptune.context_parallel(buffers=[q], seq_dims=[2], config=cfg(mesh_shape=(2, 2))):
            pass
    elif kind == "device_vs_mesh":
        mesh = init_device_mesh("cpu", (2,))
        with cptune.context_parallel(buffers=[torch.zeros(1, 2, 16, 8, device="meta")], seq_dims=[2], mesh=mesh):
            pass
    elif kind == "other_thread":  # SDPA is patched process-wide: another thread's call is refused, not routed
        caught = []

        def attend():
            try:
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            except BaseException as exc:  # noqa: BLE001 - handed to the block's thread
                caught.append(exc)

        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2]):
            worker = threading.Thread(target=attend, name="loader")
            worker.start()
            worker.join()
        if caught:
            raise caught[0]
    elif kind == "mesh_without_cp_dim":
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        with cptune.context_parallel(buffers=[q], seq_dims=[2], mesh=mesh):
            pass
    else:
        raise AssertionError(kind)


BAD_INPUTS = {
    "not_divisible": ("buffers", "pad the sequence to a multiple of 4"),
    "lb_needs_2cp": ("config.load_balance", "set load_balance=False"),
    "lb_non_causal": ("config.load_balance", "set load_balance='auto' or False"),
    "is_causal_mismatch": ("is_causal", "pass causal=False to cptune.context_parallel"),
    "attn_mask": ("attn_mask", "pass documents= / window= to cptune.context_parallel"),
    "dropout": ("dropout_p", "dropout_p=0.0 inside the CP block"),
    "layout": ("query", "transpose it to dim 2"),
    "full_length_query": ("query", "compute q/k/v inside the block from the sharded buffers"),
    "gqa_heads": ("key", "pass enable_gqa=True"),
    "backend_efficient_on_cpu": ("config.sdpa_backend", "use one of ['flash']"),
    "backend_math_under_cp": ("config.sdpa_backend", "cannot be merged across ranks"),
    "mesh_shape_vs_world": ("config.mesh_shape", "dp * cp == 2"),
    "device_vs_mesh": ("buffers[0]", "move it with .to('cpu')"),
    "mesh_without_cp_dim": ("mesh", "name the dims from dp_replicate, dp_shard (or dp), cp and tp, one of them 'cp'"),
    "other_thread": ("scaled_dot_product_attention", "run this attention on the block's thread"),
}


def _bad_inputs_then_healthy():
    before = (_torch_cp.global_options(), torch._C._get_sdp_priority_order(), F.scaled_dot_product_attention)
    messages = {}
    for kind in BAD_INPUTS:
        try:
            _run(kind)
            messages[kind] = ("no error", "")
        except cptune.ValidationError as exc:
            messages[kind] = (type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - the test reports what else came out
            messages[kind] = (type(exc).__name__, str(exc))
    after = (_torch_cp.global_options(), torch._C._get_sdp_priority_order(), F.scaled_dot_product_attention)
    # The group still works: a correct CP call after all those errors.
    q, k, v = _qkv()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2]) as cp:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    healthy = (cp.unshard(out, 2) - full).abs().max().item()
    dist.barrier()
    return {"messages": messages, "globals_unchanged": before == after, "healthy": healthy,
            "warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def bad_input_results(ranks):
    return ranks(2).run(_bad_inputs_then_healthy)


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input_on_ranks_names_argument_and_fix(bad_input_results, kind):
    argument, fix = BAD_INPUTS[kind]
    for result in bad_input_results:
        name, text = result["messages"][kind]
        assert name == "ValidationError", text
        assert f"{argument}:" in text and fix in text, text


def test_after_bad_inputs_globals_are_restored_and_group_healthy(bad_input_results):
    for result in bad_input_results:
        assert result["globals_unchanged"]
        assert result["healthy"] <= 1e-5
        assert result["warnings"] == []  # 16 tokens on 2 ranks: load balancing stays on


def _lb_turned_off():
    q, k, v = _qkv(6)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2]) as cp:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"lb": cp.load_balance, "err": (cp.unshard(out, 2) - full).abs().max().item(),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, cptune.CPTuneWarning)],
            "rank": dist.get_rank()}


def test_auto_load_balance_turns_off_with_a_warning_and_stays_exact(ranks):
    for r in ranks(2).run(_lb_turned_off):
        assert r["lb"] is False and r["err"] <= 1e-5
        if r["rank"] == 0:
            assert r["warnings"] and "pad to a multiple of 4" in r["warnings"][0]


def _exception_inside_block():
    q, k, v = _qkv()
    before = (_torch_cp.global_options(), torch._C._get_sdp_priority_order())
    cfg = cptune.CPConfig(rotate_method="alltoall", sdpa_backend="flash")
    try:
        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config=cfg):
            assert q.shape[2] == 8
            raise KeyError("user bug")
    except KeyError:
        pass
    after = (_torch_cp.global_options(), torch._C._get_sdp_priority_order())
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no ring any more
    return {"same": before == after, "restored_shape": tuple(q.shape), "plain_shape": tuple(plain.shape)}


def test_exception_inside_block_restores_everything(ranks):
    for r in ranks(2).run(_exception_inside_block):
        assert r["same"] and r["restored_shape"] == (1, 2, 16, 8) and r["plain_shape"] == (1, 2, 16, 8)
