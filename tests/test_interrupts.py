"""A real Ctrl-C (SIGINT) and a scheduler's SIGTERM to a real `cptune search`: clean stop, nothing lost."""

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _descendants(pid):
    """The processes ``pid`` started, and theirs: the resource tracker, the fork server and the ranks it forked."""
    found = _children(pid)
    return found + [d for c in found for d in _descendants(c)]


def _group(pgid):
    """(pid, state, command) of every process /proc lists in process group ``pgid``. A zombie counts: it is listed
    until its parent waits for it, and a process the search waited for is not listed at all."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            if stat and int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                found.append((int(entry), stat.split()[2], Path(f"/proc/{entry}/cmdline").read_text()[:120]))
        except OSError:  # gone meanwhile
            continue
    return found


def _exited_leaving_nothing(proc, started, own_group):
    """Wait for the search to exit (not for its stderr to close: every process it started holds that) and check
    at once that nothing it started is left: none of ``started``, nor anything of its process group when it has
    one of its own (``own_group``, as a terminal's command has)."""
    proc.wait(timeout=60)
    if own_group:
        assert not (left := _group(proc.pid)), left  # the group Ctrl-C reaches
    assert not (left := [p for p in started if os.path.exists(f"/proc/{p}")]), left


def _stop_cleanly(proc, sig, code, seen):
    """Send ``sig`` to a running `cptune search` (to its whole process group when it runs in a session of its own,
    as a terminal's Ctrl-C does); check it stopped cleanly and left no process. Returns the stop line."""
    started = _descendants(proc.pid)
    assert len(started) >= 4, started  # the tracker, the fork server and the 2 ranks
    own_group = os.getpgid(proc.pid) == proc.pid
    if own_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _exited_leaving_nothing(proc, started, own_group)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Error" not in err and "Aborted" not in err, err
    stop = [x for x in err.splitlines() if x.startswith("cptune search: stopped by")]
    assert len(stop) == 1 and "trial(s) stored in study" in stop[0] and "resume with: " in stop[0], err
    assert stop[0].split("resume with: ")[1] == shlex.join(["cptune", *proc.args[3:]])  # retypable, not __main__.py
    return stop[0]


SEARCH = ["-m", "cptune", "search", "--seq-len", "256", "--heads", "2", "--head-dim", "16",
          "--workload", "tests.test_interrupts:paced_step", "--exhaustive",  # every config runs: none skipped by plan
          "--min-seconds", "0"]  # each trial its fewest timed steps: what is stopped and resumed is the same


def _held_search(tmp_path, when, launcher=None, session=False):
    """A real `cptune search` subprocess over :func:`paced_step` (``launcher``: run under it; with it or
    ``session``, in a session of its own). Once a progress line passes ``when(done, total)``, the test holds the next
    step being built (a file the step waits on) until the signal comes, so the signal lands
    mid-measurement on any machine. Returns (proc, lines seen, total, command, env)."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    cmd = [*launcher, *SEARCH] if launcher else [sys.executable, *SEARCH, "--nproc", "2"]
    cmd += ["--storage", storage]
    env = {**os.environ, "CPTUNE_TEST_HOLD": str(tmp_path / "hold"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=launcher is not None or session)
    seen = []
    while True:
        line = proc.stderr.readline()
        assert line, "search ended early: " + "".join(seen)
        seen.append(line)
        progress = re.search(r"\[[#-]+\] (\d+)/(\d+) ", line)  # the search's progress bar, not torchrun's logs
        if progress and when(int(progress[1]), int(progress[2])):
            total = progress[2]
            break
    (tmp_path / "hold").touch()
    deadline = time.monotonic() + 60
    while not (tmp_path / "hold.waiting").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "no step was held: " + "".join(seen)
        time.sleep(0.05)
    return proc, seen, int(total), cmd, env


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130)])  # SIGTERM: the race's test, and torchrun's
def test_signal_stops_cleanly_and_resume_measures_every_config(tmp_path, sig, code):
    """Ctrl-C to the search's process group mid-trial: the one stop line, exit 130, and the command returns only
    once every process it started (the ranks, the fork server, the resource tracker) has exited."""
    proc, seen, total, cmd, env = _held_search(tmp_path, lambda done, total: done < total,  # a screening trial held
                                               session=True)
    name = _stop_cleanly(proc, sig, code, seen).split("in study ")[1].split(";")[0]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 's.db'}")
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states  # storage consistent: nothing left running
    interrupted = [t for t in study.trials if t.user_attrs.get("reason") == "the search stopped during this trial"]
    assert len(interrupted) == 1 and interrupted[0].state == optuna.trial.TrialState.FAIL
    before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)

    (tmp_path / "hold").unlink()
    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{total - before} trial(s) run now" in resumed.stdout  # the interrupted one is measured again
    table = resumed.stdout.split("-----")[-1]
    assert table.count(" yes ") == total, resumed.stdout  # every configuration has its measurement


def test_ctrl_c_while_the_ranks_start_stops_cleanly(tmp_path):
    """Ctrl-C to the group while the fork server first imports torch: it reaches the server too, which must not die
    of it (a traceback, the search failing), and a rank being forked must not be left behind."""
    cmd = [sys.executable, "-m", "cptune", "search", "--seq-len", "256", "--nproc", "2",
           "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not any("forkserver" in command for _, _, command in _group(proc.pid)):
        assert time.monotonic() < deadline and proc.poll() is None, "no fork server started"
        time.sleep(0.01)
    started = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _exited_leaving_nothing(proc, started, own_group=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Error" not in err, err
    assert len([x for x in err.splitlines() if x.startswith("cptune search: stopped by SIGINT")]) == 1, err


def slow_second_trial(workload, config, settings):
    """Measures instantly, except the second configuration, which takes a minute unless interrupted."""
    import torch.distributed as dist

    from cptune.search import config_key

    if config_key(config) == "dp1-cp2-alltoall-nolb-flash" and os.environ.get("CPTUNE_TEST_SLOW"):
        open(os.environ["CPTUNE_TEST_SLOW"], "a").close()  # tells the test the trial is running
        time.sleep(60)
    return {"rank": dist.get_rank(), "times": [1.0] * 3, "peak": 2**20, "baseline": 0, "pid": os.getpid()}


def test_signal_during_a_trial_records_it_interrupted_and_resume_measures_it(tmp_path, monkeypatch):
    import threading

    import cptune
    from cptune.search import MeasureSettings, SearchInterrupted, Workload, config_key

    storage = f"sqlite:///{tmp_path / 'i.db'}"
    kw = dict(nproc=2, storage=storage, memory_budget="8GiB", settings=MeasureSettings(min_seconds=0), confirm=False,
              exhaustive=True)  # every config runs: none skipped by plan
    marker = tmp_path / "slow-trial-running"
    monkeypatch.setenv("CPTUNE_TEST_SLOW", str(marker))

    def interrupt_when_running():
        while not marker.exists():
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, while the slow trial is being measured

    timer = threading.Thread(target=interrupt_when_running, daemon=True)
    timer.start()
    started = time.monotonic()
    with pytest.raises(SearchInterrupted) as info:
        cptune.tune(Workload(seq_len=1024), measure=slow_second_trial, **kw)
    assert time.monotonic() - started < 40 and info.value.exit_code == 130  # stopped at once, not after 60 s
    study = optuna.load_study(study_name=info.value.study_name, storage=storage)
    stopped = [t for t in study.trials if t.user_attrs.get("reason") == "the search stopped during this trial"]
    assert [t.user_attrs["key"] for t in stopped] == ["dp1-cp2-alltoall-nolb-flash"]
    assert all(t.state.is_finished() for t in study.trials)
    monkeypatch.delenv("CPTUNE_TEST_SLOW")
    resumed = cptune.tune(Workload(seq_len=1024), measure=slow_second_trial, **kw)
    assert resumed.complete and all(r.state == "ok" for r in resumed.trials)
    assert "dp1-cp2-alltoall-nolb-flash" in {config_key(r.config) for r in resumed.trials}


def paced_step(workload, device):
    """A --workload step that takes the same time in every configuration, so the leaders tie and race.
    Once the test creates the file $CPTUNE_TEST_HOLD, building it says so (a second file) and waits."""
    import torch

    hold = os.environ.get("CPTUNE_TEST_HOLD")
    if hold and os.path.exists(hold):
        open(hold + ".waiting", "a").close()
        time.sleep(60)
    x = torch.zeros(workload.batch, workload.seq_len, device=device)

    def step(x):  # in proportion to this rank's tokens (the same tokens/s for dp and cp), ±30 %: within noise.
        # Long enough that a CP block's own few ms per step (more on a loaded machine) stay small beside it: at
        # 0.04 s a CP step slept 0.02 s, its overhead made the CP configs 25-35 % slower than dp2, their ranges
        # missed the leader's and no race ran (a full-suite run's failure)
        time.sleep(0.2 * x.numel() / workload.seq_len * random.uniform(0.7, 1.3))

    return step, [x], [1]


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143)])  # SIGINT: the mid-trial test, and torchrun's
def test_signal_during_the_race_stops_cleanly_and_resume_races_again(tmp_path, sig, code):
    """Screening done, the leaders racing: the signal still stops the search cleanly (not click's
    'Aborted!', not a killed process), and the resumed search runs the race it lost."""
    proc, seen, total, cmd, env = _held_search(tmp_path, lambda done, total: done == total)  # a race round held
    storage = f"sqlite:///{tmp_path / 's.db'}"
    stop = _stop_cleanly(proc, sig, code, seen)
    assert f"with {total} trial(s) stored" in stop  # every screened config is kept
    name = stop.split("in study ")[1].split(";")[0]
    study = optuna.load_study(study_name=name, storage=storage)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)  # screening is whole
    assert study.user_attrs["race"] == {"running": True}  # a race cut short decides nothing

    (tmp_path / "hold").unlink()
    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "0 trial(s) run now" in resumed.stdout  # nothing measured twice ...
    assert "race:" in resumed.stdout, resumed.stdout  # ... but the race ran again, to its end
    race = optuna.load_study(study_name=name, storage=storage).user_attrs["race"]
    assert race and race.get("survivors"), race


def test_a_signal_held_outside_a_trial_is_never_dropped():
    """Bookkeeping holds a signal; leaving the window raises it, and an inner window (the library's
    search inside the CLI) takes over one the outer window held."""
    from cptune.search.interrupts import Interrupts, SearchInterrupted

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN under nohup or `&`
    with pytest.raises(SearchInterrupted) as info:
        with Interrupts():
            os.kill(os.getpid(), signal.SIGTERM)  # held: not inside a measurement
            time.sleep(0.1)
            reached = True  # the code after the signal still ran: the study is never left half-written
    assert reached and info.value.exit_code == 143
    with pytest.raises(SearchInterrupted) as info:
        with Interrupts() as outer:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            with Interrupts() as inner:
                assert inner.pending == signal.SIGINT and outer.pending is None
    assert info.value.exit_code == 130
    with pytest.raises(SearchInterrupted):
        with Interrupts() as outer:
            with pytest.raises(ValueError):  # an error on its way out hands the held signal back to the outer window
                with Interrupts():
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.1)
                    raise ValueError
            assert outer.pending == signal.SIGINT
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    # held until every study was stored (the ranks closing, the result printing): named after the last study
    from types import SimpleNamespace

    done = [SimpleNamespace(study_name="a", trials=[1]), SimpleNamespace(study_name="b", trials=[1, 2])]
    late = SearchInterrupted(signal.SIGINT).after(done)
    assert (late.study_name, late.stored, late.exit_code) == ("b", 2, 130) and "2 trial(s) stored in study b" in \
        late.message("cptune search")
    named = SearchInterrupted(signal.SIGTERM, "x", 1)
    assert named.after(done) is named and SearchInterrupted(signal.SIGINT).after([]).study_name == ""


def test_a_signal_inside_a_finalizer_still_stops_the_measurement_at_once():
    """A signal landing in a weakref callback (SQLAlchemy's, any collection's) raises there, where Python drops
    the exception: the measurement is stopped all the same, right after the callback, not left to run on
    (under torchrun its peers are gone by then: the rank would hang until torchrun kills it)."""
    import weakref

    from cptune.search.interrupts import Interrupts, SearchInterrupted

    class Thing:
        pass

    def in_finalizer(_):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the callback
            pass

    hook = sys.unraisablehook
    with pytest.raises(SearchInterrupted) as info:
        with Interrupts() as window:
            with window.immediate():
                thing = Thing()
                ref = weakref.ref(thing, in_finalizer)
                start = time.monotonic()
                del thing  # the callback runs now
                while time.monotonic() < start + 10:  # the measurement, running on
                    pass
    ran_on = time.monotonic() - start
    assert info.value.exit_code == 143 and ref() is None
    assert ran_on < 2, f"the measurement ran on for {ran_on:.1f}s after the signal"
    assert sys.unraisablehook is hook and window.pending is None
    errors = []  # outside a window, other unraisable errors still reach the hook that was there
    with Interrupts():
        sys.unraisablehook, saved = errors.append, sys.unraisablehook
        try:
            with Interrupts():
                weakref.ref(Thing(), lambda _: 1 / 0)
        finally:
            sys.unraisablehook = saved
    assert len(errors) == 1 and isinstance(errors[0].exc_value, ZeroDivisionError)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_under_torchrun_a_signal_to_the_job_leaves_the_study_consistent_and_resumable(tmp_path, sig):
    """Ctrl-C reaches the terminal's whole process group (SIGINT), a scheduler signals every process of
    the job (SIGTERM): torchrun, rank 0 (the driver) and rank 1. Rank 0 records the running trial as
    interrupted and prints the one line; torchrun then stops its workers and exits in its own way
    (exit 1, its SignalException), which cptune cannot change. The same torchrun command resumes."""
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    proc, seen, total, cmd, env = _held_search(tmp_path, lambda done, total: done < total, launcher=torchrun)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    stop = [x for x in err.splitlines() if x.startswith("cptune search: stopped by")]
    assert len(stop) == 1 and f"stopped by {sig.name} with " in stop[0], err
    search = shlex.join(cmd[len(torchrun):])
    assert stop[0].endswith(f"resume with: the same torchrun command (torchrun ... {search})"), stop
    name = stop[0].split("in study ")[1].split(";")[0]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert all(t.state.is_finished() for t in study.trials)  # nothing left RUNNING
    assert [t.user_attrs.get("reason") for t in study.trials if t.state == optuna.trial.TrialState.FAIL] == \
        ["the search stopped during this trial"]

    (tmp_path / "hold").unlink()
    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split("-----")[-1].count(" yes ") == total, resumed.stdout  # every config measured
