"""Every way a `cptune search` ends, over and over, under load: each process's exit counted by status and signal.

    python -m benchmarks.exits --cycles 50             # a CPU hog runs beside it (--no-hog: without)
    python -m benchmarks.exits --cycles 2 --no-hog     # a quick look

Not part of the suite (opt in by running it). Each cycle, on a study of its own:
- interrupted: a torchrun job (2 ranks) held mid-screening, then SIGTERM or SIGINT (alternating) to its whole
  process group, as a scheduler or Ctrl-C sends it. Expected: one stop line; rank 0 exits 128 + signal, rank 1
  is ended by the signal, torchrun exits 1 (its SignalException);
- resumed: the same torchrun command: every rank exits 0 and every configuration is measured;
- finished: the same command once more, on the finished study: it measures nothing, every rank exits 0;
- every 5th cycle, plain: `cptune search --nproc 2` spawning its own ranks, then the same command on the
  finished study: exit 0, and no "did not all exit cleanly" line from the ranks' group.
torchrun starts each rank through a recorder (this module, ``--record``) that runs the rank as its child,
hands on torchrun's signals, writes how the rank ended and ends the same way. Any process ended by SIGABRT or
SIGSEGV, or "terminate called" in any output, is an abort; any other status that differs from the expected
one is an unexpected exit. Results: benchmarks/results/exits-<stamp>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCH = ["-m", "cptune", "search", "--seq-len", "256", "--heads", "2", "--head-dim", "16",
          "--workload", "tests.test_interrupts:paced_step", "--exhaustive"]
CRASHES = ("terminate called", "Fatal Python error", "Segmentation fault", "core dumped")


def describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def record(folder: str, argv: list[str]) -> None:
    """One torchrun rank: run it as a child in a process group of its own (so a signal to the job's group
    reaches it once, through here), note how it ended, and end the same way."""
    child = subprocess.Popen([sys.executable, *argv], process_group=0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    Path(folder, f"rank{os.environ.get('RANK', '?')}-{child.pid}").write_text(str(code))
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


class Tally:
    def __init__(self) -> None:
        self.runs: collections.Counter = collections.Counter()
        self.exits: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.aborts: list[str] = []
        self.unexpected: list[str] = []

    def add(self, phase: str, what: str, status: str, expected: set[str], output: str) -> None:
        self.exits[phase][f"{what}: {status}"] += 1
        crashed = [c for c in CRASHES if c in output]
        if "SIGABRT" in status or "SIGSEGV" in status or crashed:
            self.aborts.append(f"{phase} {what}: {status} {crashed}\n{output[-2000:]}")
        elif status not in expected:
            self.unexpected.append(f"{phase} {what}: {status}, expected {sorted(expected)}\n{output[-2000:]}")

    def ranks(self, phase: str, folder: Path, expected: dict[str, set[str]], output: str) -> None:
        files = sorted(folder.glob("rank*"))
        if len(files) != 2:
            self.unexpected.append(f"{phase}: {len(files)} rank records, expected 2\n{output[-2000:]}")
        for f in files:
            rank = f.name.split("-")[0]
            self.add(phase, rank, describe(int(f.read_text())), expected.get(rank, {"exit 0"}), output)
            f.unlink()


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "CPTUNE_TEST_HOLD": str(work / "hold"), "PYTHONPATH": str(ROOT)}


def _torchrun(work: Path, records: Path) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
            "-m", "benchmarks.exits", "--record", str(records), "--", *SEARCH,
            "--storage", f"sqlite:///{work / 's.db'}"]


def interrupted(work: Path, records: Path, sig: signal.Signals, tally: Tally) -> int:
    """A torchrun job held in a screening trial, then ``sig`` to its process group. Returns the trials' total."""
    proc = subprocess.Popen(_torchrun(work, records), cwd=work, env=_env(work), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen, total = [], 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        progress = re.search(r"\[[#-]+\] (\d+)/(\d+) ", line)
        if progress and int(progress[1]) < int(progress[2]):
            total = int(progress[2])
            break
    if total:
        (work / "hold").touch()
        while not (work / "hold.waiting").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    output = "".join(seen) + err + out
    phase = f"interrupted ({sig.name})"
    tally.runs[phase] += 1
    if not total or sum(x.startswith("cptune search: stopped by") for x in output.splitlines()) != 1:
        tally.unexpected.append(f"{phase}: no single stop line\n{output[-3000:]}")
    tally.add(phase, "torchrun", describe(proc.returncode), {"exit 1"}, output)
    tally.ranks(phase, records, {"rank0": {f"exit {128 + sig}"}, "rank1": {f"killed by {sig.name}"}}, output)
    return total


def finish(work: Path, records: Path, phase: str, total: int, tally: Tally) -> None:
    """The same torchrun command: every rank exits 0; every configuration measured (``total``) or nothing run."""
    (work / "hold").unlink(missing_ok=True)
    done = subprocess.run(_torchrun(work, records), cwd=work, env=_env(work), capture_output=True, text=True,
                          timeout=600)
    output = done.stderr + done.stdout
    tally.runs[phase] += 1
    tally.add(phase, "torchrun", describe(done.returncode), {"exit 0"}, output)
    tally.ranks(phase, records, {}, output)
    measured = done.stdout.split("-----")[-1].count(" yes ")
    ran_again = phase == "finished" and "0 trial(s) run now" not in done.stdout
    if done.returncode == 0 and (measured != total or ran_again):
        tally.unexpected.append(f"{phase}: {measured} of {total} configurations measured\n{done.stdout[-2000:]}")


def plain(work: Path, tally: Tally) -> None:
    """`cptune search --nproc 2` (its own spawned ranks), then the same command on the finished study."""
    cmd = [sys.executable, *SEARCH, "--nproc", "2", "--storage", f"sqlite:///{work / 'plain.db'}"]
    for phase in ("plain", "plain finished"):
        done = subprocess.run(cmd, cwd=work, env=_env(work), capture_output=True, text=True, timeout=600)
        output = done.stderr + done.stdout
        tally.runs[phase] += 1
        tally.add(phase, "cptune", describe(done.returncode), {"exit 0"}, output)
        if "did not all exit cleanly" in output:
            tally.unexpected.append(f"{phase}: a spawned rank did not exit cleanly\n{output[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"]:
        record(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--no-hog", action="store_true", help="no CPU hog beside the runs")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/exits-<stamp>.json)")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be 1 or more")
    hog = None if args.no_hog else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    tally, started = Tally(), time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="cptune-exits-"))
    try:
        for cycle in range(args.cycles):
            work, records = base / f"c{cycle}", base / f"c{cycle}" / "records"
            records.mkdir(parents=True)
            sig = (signal.SIGTERM, signal.SIGINT)[cycle % 2]
            total = interrupted(work, records, sig, tally)
            finish(work, records, "resumed", total, tally)
            finish(work, records, "finished", total, tally)
            if cycle % 5 == 0:
                plain(work, tally)
            shutil.rmtree(work, ignore_errors=True)
            print(f"cycle {cycle + 1}/{args.cycles}: {sum(tally.runs.values())} runs, {len(tally.aborts)} aborts, "
                  f"{len(tally.unexpected)} unexpected exits, {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if hog is not None:
            hog.kill()
        shutil.rmtree(base, ignore_errors=True)
    import torch

    result = {"cycles": args.cycles, "hog": hog is not None, "seconds": round(time.monotonic() - started),
              "torch": torch.__version__, "runs": dict(tally.runs),
              "exits": {phase: dict(c) for phase, c in tally.exits.items()},
              "aborts": tally.aborts, "unexpected": tally.unexpected}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"exits-{time.strftime('%Y-%m-%d-%H%M')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for phase, counts in result["exits"].items():
        print(f"{phase:24s} {tally.runs[phase]:4d} runs  " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    print(f"aborts: {len(tally.aborts)}; unexpected exits: {len(tally.unexpected)}; written: {out}")
    return 1 if tally.aborts or tally.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
