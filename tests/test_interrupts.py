"""A real Ctrl-C (SIGINT) and a scheduler's SIGTERM to a real `cptune search`: clean stop, nothing lost."""

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_cleanly_and_resume_measures_every_config(tmp_path, sig, code):
    cmd = [sys.executable, "-m", "cptune", "search", "--seq-len", "512", "--heads", "2", "--head-dim", "16",
           "--nproc", "2", "--min-seconds", "1.5", "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    while True:  # wait until the first trial is in the study, then interrupt the second one mid-measurement
        line = proc.stderr.readline()
        assert line, "search ended before a trial finished: " + "".join(seen)
        seen.append(line)
        if "1/5" in line:
            break
    time.sleep(0.7)
    ranks = _children(proc.pid)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Error" not in err, err
    stop = [x for x in err.splitlines() if x.startswith("cptune search: stopped by")]
    assert len(stop) == 1 and "trial(s) stored in study" in stop[0] and "resume with: " in stop[0], err
    time.sleep(0.5)
    assert ranks and not any(_alive(p) for p in ranks)  # the ranks were reaped
    name = stop[0].split("in study ")[1].split(";")[0]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 's.db'}")
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states  # storage consistent: nothing left running
    interrupted = [t for t in study.trials if t.user_attrs.get("reason") == "the search stopped during this trial"]
    before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)

    resumed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{5 - before} trial(s) run now" in resumed.stdout  # the interrupted one is measured again
    table = resumed.stdout.split("-----")[-1]
    assert table.count(" yes ") == 5, resumed.stdout  # every configuration has its measurement
    assert len(interrupted) <= 1
