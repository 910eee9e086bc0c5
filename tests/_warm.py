"""``python SCRIPT ARGS`` and ``python -m MODULE ARGS`` as processes forked from one warm interpreter.

A test that runs a script or a cptune command as its own process pays torch's, transformers' and cptune's imports
each time (about 5 s of a core here). :func:`run` sends the command line to a zygote, an interpreter started once a
session that has imported them; it forks a child per command, which takes the command's working directory,
environment, standard streams and ``sys.argv`` and runs the script or module as ``__main__``, as ``python`` would.
Each command is still its own process (its own memory, its own ranks and torchrun agent); only the imports are
shared. Anything else (another interpreter, ``torchrun``) runs as a plain subprocess.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch.distributed.run", "transformers", "cptune", "cptune.cli", "cptune.models", "cptune.hf",
           "cptune.examples.train_hf")
ROOT = Path(__file__).resolve().parents[1]


def _serve() -> None:  # the zygote: imports once, then one forked child per line of its standard input
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # transformers is optional
            pass
    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


def _child(job: dict) -> None:
    import runpy
    import traceback

    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["out"], os.O_WRONLY),
                                (2, job["err"], os.O_WRONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        for entry in reversed(job["env"].get("PYTHONPATH", "").split(os.pathsep)):  # as the interpreter reads it
            if entry:
                sys.path.insert(1, str(Path(entry).resolve()))
        argv = job["argv"][1:]
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], job["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests._warm import _serve; _serve()"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            out.touch()
            err.touch()
            job = {"argv": [str(a) for a in args], "cwd": str(Path(cwd).resolve()), "env": env, "out": str(out),
                   "err": str(err)}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            deadline = time.monotonic() + timeout
            while not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if time.monotonic() >= deadline:
                    os.kill(pid, signal.SIGKILL)
                    self.proc.stdout.readline()
                    raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text())
            code = json.loads(self.proc.stdout.readline())["code"]
            return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_zygote: _Zygote | None = None


def run(args: list, cwd, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """What ``subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)`` returns; a
    ``[sys.executable, SCRIPT | -m MODULE, ...]`` command runs forked from the warm interpreter."""
    global _zygote
    env = dict(os.environ if env is None else env)
    if len(args) < 2 or args[0] != sys.executable or str(args[1]).startswith("-") and args[1] != "-m":
        return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
        atexit.register(_zygote.close)
    return _zygote.run(args, cwd, env, timeout)
