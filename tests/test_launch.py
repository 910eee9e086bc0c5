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
