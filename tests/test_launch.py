"""The multi-rank harness itself: every rank's traceback, timeouts, dead ranks, nothing left behind."""

import os
import time

import pytest
import torch.distributed as dist

from cptune.launch import GroupLost, RankFailure, WorkerGroup


def _rank_and_sum():
    import torch

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.getpid()


def _fail_on_odd_ranks():
    if dist.get_rank() % 2:
        raise ValueError(f"rank {dist.get_rank()} is odd")
    return "fine"


def _sleep(seconds):
    time.sleep(seconds)


def _die_on_rank(rank):
    if dist.get_rank() == rank:
        os._exit(3)
    time.sleep(60)


def _environment(*names):
    import sys

    return {n: os.environ.get(n) for n in names}, "torch" in sys.modules


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runs_on_every_rank_and_leaves_no_process():
    with WorkerGroup(3, timeout=60) as group:
        results = group.run(_rank_and_sum)
        pids = group.pids
        assert [r[:2] for r in results] == [(0, 6.0), (1, 6.0), (2, 6.0)]
        assert group.run(_rank_and_sum)[0][2] == pids[0]  # the same processes serve many jobs
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_failure_reports_every_failing_rank():
    with WorkerGroup(4, timeout=60) as group:
        group.error_grace = 2
        with pytest.raises(RankFailure) as info:
            group.run(_fail_on_odd_ranks)
        assert sorted(info.value.errors) == [1, 3]
        assert "rank 3 is odd" in info.value.tracebacks[3] and "Traceback" in info.value.tracebacks[1]
        assert group.run(_rank_and_sum)[0][1] == 10.0  # consistent failure: same group goes on


def test_timeout_kills_the_group_and_next_run_relaunches():
    with WorkerGroup(2, timeout=60) as group:
        pids = group.pids
        with pytest.raises(GroupLost, match="after 1s"):
            group.run(_sleep, 30, timeout=1)
        assert not any(_alive(p) for p in pids)
        assert group.run(_rank_and_sum)[1][1] == 3.0 and group.launches == 2


def test_a_dead_rank_is_reported_not_waited_for():
    with WorkerGroup(2, timeout=60) as group:
        start = time.monotonic()
        with pytest.raises(GroupLost, match=r"rank\(s\) 1 \(exit code 3\) died"):
            group.run(_die_on_rank, 1)
        assert time.monotonic() - start < 30


def _groups_outlive_a_plain_destroy_but_not_close_rank():
    """Every group cptune built (the world mesh, a CP block's mesh, hybrid groups), weakly held: a plain
    destroy_process_group leaves them alive while cptune's caches hold them, and DTensor's sharding caches,
    which hold the mesh of an FSDP2 model that ran (then freed during the interpreter's teardown, where gloo's
    worker threads abort the process); close_rank frees them while it is alive."""
    import gc
    import weakref

    import torch

    import cptune
    from cptune import mesh as _session
    from cptune.attention import _ulysses
    from cptune.launch import close_rank

    mesh = _session.world_mesh("cpu")
    q = torch.randn(1, 2, 8, 4)
    with cptune.context_parallel(buffers=[q], seq_dims=[2], config=cptune.CPConfig(load_balance=False)):
        pass
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
    model(torch.randn(2, 4)).sum().backward()
    groups = [mesh.get_group(), *_ulysses.hybrid_groups(mesh, 2, 2), *model.weight.device_mesh.get_all_groups(),
              *(m.get_group(d) for m in _session._MESHES.values() for d in range(m.ndim))]
    refs = [weakref.ref(g) for g in groups]
    del groups, mesh, model
    dist.destroy_process_group()
    gc.collect()
    held = sum(r() is not None for r in refs)
    close_rank()
    return len(refs), held, sum(r() is not None for r in refs), dist.is_initialized()


def _a_group_held_elsewhere_at_close_rank_is_kept_to_the_end():
    """A group something else still holds when close_rank runs (as torch's C++ holds the default group after an
    FSDP2 model trained) is never freed, not even once that holder lets go in the interpreter's teardown."""
    import gc
    import weakref

    from cptune.launch import close_rank

    kept = dist.new_group([0, 1])
    ref = weakref.ref(kept)
    close_rank()
    del kept
    gc.collect()
    return ref() is not None


def test_close_rank_frees_every_group_while_the_interpreter_lives_and_ranks_exit_cleanly():
    group = WorkerGroup(2)
    try:
        results = group.run(_groups_outlive_a_plain_destroy_but_not_close_rank)
    finally:
        group.close()
    for made, held_after_destroy, alive_after_close, initialized in results:
        assert made >= 4 and held_after_destroy == made and alive_after_close == 0 and not initialized
    assert group.exitcodes == [0, 0]  # each rank's own exit, after its close_rank
    group = WorkerGroup(2)
    try:
        assert group.run(_a_group_held_elsewhere_at_close_rank_is_kept_to_the_end) == [True, True]
    finally:
        group.close()
    assert group.exitcodes == [0, 0]


def test_each_group_runs_in_the_parents_environment_of_its_start(monkeypatch):
    """Ranks fork from a server that imported torch once: a group started later still sees the parent's
    environment as it is then (a variable set since, one removed since), and torch is there before any job."""
    monkeypatch.setenv("CPTUNE_LAUNCH_GONE", "1")
    with WorkerGroup(2, timeout=60) as group:
        (first, torch_loaded), _ = group.run(_environment, "CPTUNE_LAUNCH_GONE", "CPTUNE_LAUNCH_NEW")
    assert first == {"CPTUNE_LAUNCH_GONE": "1", "CPTUNE_LAUNCH_NEW": None} and torch_loaded
    monkeypatch.delenv("CPTUNE_LAUNCH_GONE")
    monkeypatch.setenv("CPTUNE_LAUNCH_NEW", "2")
    with WorkerGroup(2, timeout=60, env={"CPTUNE_LAUNCH_OWN": "3"}) as group:
        later = group.run(_environment, "CPTUNE_LAUNCH_GONE", "CPTUNE_LAUNCH_NEW", "CPTUNE_LAUNCH_OWN",
                          "OMP_NUM_THREADS")
    assert [env for env, _ in later] == [{"CPTUNE_LAUNCH_GONE": None, "CPTUNE_LAUNCH_NEW": "2",
                                          "CPTUNE_LAUNCH_OWN": "3", "OMP_NUM_THREADS": "1"}] * 2
