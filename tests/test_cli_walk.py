"""Every option and argument of every cptune command, taken from click's own command tree, given bad values of its
kind: each call exits non-zero with one error line naming the option, prints no traceback, starts no rank and
writes nothing. An option of a type this walk has no bad values for fails the walk, so a new option is covered the
day it is added. In-process (click's runner), ranks and torchrun replaced by a tripwire: no process is started."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from cptune.cli import _types as T
from cptune.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "models" / "tiny-llama"
RECIPE = ROOT / "recipes" / "cpu-2r-s4096-causal.yaml"


class Started(BaseException):
    """The call got past every check: it would start ranks or torchrun."""


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def _scripts() -> dict[str, click.Command]:
    """Every training script that ships (cptune.examples, which recipes launch) or sits in examples/: its click
    command, found from the files, not from a list (a script that is not a click command fails the walk)."""
    import importlib
    import importlib.util
    import pkgutil

    import cptune.examples

    found: dict[str, click.Command] = {}
    modules = [importlib.import_module(f"cptune.examples.{m.name}")
               for m in pkgutil.iter_modules(cptune.examples.__path__) if not m.name.startswith("_")]
    for path in sorted((ROOT / "examples").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_walked_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    for module in modules:
        command = getattr(module, "main", None)
        assert isinstance(command, click.Command), f"{module.__file__}: its options are not a click command (main)"
        if command not in found.values():  # examples/train_hf.py runs cptune.examples.train_hf's
            found[Path(module.__file__).name] = command
    return found


SCRIPTS = _scripts()
SCRIPT_BASES = {"train_hf.py": ["--model", str(MODEL), "--seq-len", "64", "--steps", "1"],
                "train_llama_cp.py": ["--seq-len", "256", "--steps", "1"], "vit_noncausal.py": ["--steps", "1"],
                "train_hf_trainer.py": ["--model", str(MODEL), "--steps", "1", "--no-fsdp"],  # any transformers
                "cp_example.py": ["--seq-len", "256"]}
"""A valid call of each script (the walk runs it as the second of two torchrun ranks)."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Files the bad values point at: kept apart from the folder each call runs in."""
    d = tmp_path_factory.mktemp("inputs")
    files = {"empty": "", "notjson": "{not json", "badyaml": "a: [unclosed\n  - b: {", "list": "[1, 2]",
             "text": "just words, no structure"}
    out = {}
    for name, text in files.items():
        (d / f"{name}.json").write_text(text)
        out[name] = str(d / f"{name}.json")
    (d / "binary.json").write_bytes(bytes(range(256)) * 4)
    out["binary"] = str(d / "binary.json")
    (d / "folder").mkdir()
    out["folder"] = str(d / "folder")
    out["missing"] = str(d / "no-such-file.json")
    (d / "model-unknown-type").mkdir()
    (d / "model-unknown-type" / "config.json").write_text(json.dumps({**json.loads((MODEL / "config.json").read_text()),
                                                                    "model_type": "no-such-model-type"}))
    out["model-unknown-type"] = str(d / "model-unknown-type")
    (d / "model-notjson").mkdir()
    (d / "model-notjson" / "config.json").write_text("{not json")
    out["model-notjson"] = str(d / "model-notjson")
    out["dir"] = str(d)
    return out


def bad_values(param: click.Parameter, inputs: dict[str, str]) -> list[str]:
    """Values of ``param``'s kind that must be refused; an unknown kind fails the walk (give it cases here)."""
    t = param.type
    if isinstance(t, click.IntRange):
        low = [str(t.min - 1), str(t.min - 1000)] if t.min is not None else []
        return [*low, *([str(t.max + 1)] if t.max is not None else []), "abc", "", "1.5"]
    if isinstance(t, click.FloatRange):
        low = [str(t.min if t.min_open else t.min - 1), str(t.min - 1000)] if t.min is not None else []
        high = [str(t.max if t.max_open else t.max + 1)] if t.max is not None else []
        return [*low, *high, "abc", "", "nan"]
    if isinstance(t, click.Choice):
        return ["no-such-choice", ""]
    if isinstance(t, T.InputFile):
        wrong_kind = [] if t.dir_okay else [inputs["folder"]]
        contents = [inputs[k] for k in ("empty", "notjson", "badyaml", "list", "text", "binary")]
        models = [inputs["model-unknown-type"], inputs["model-notjson"], inputs["folder"]] if t.dir_okay else []
        return [inputs["missing"], *wrong_kind, *contents, *models]
    if isinstance(t, T.OutputFile):
        return [inputs["dir"], inputs["empty"] + "/r.yaml"]  # a folder; a path inside a file
    if isinstance(t, click.Path):
        if t.exists:
            return [inputs["missing"], *([inputs["folder"]] if not t.dir_okay else [])]
        return [inputs["dir"]] if not t.dir_okay else [inputs["empty"]] if not t.file_okay else []
    cases = {T.Size: ["abc", "0", "-1GiB", "10", "", "1.5XB"], T.Lengths: ["0", "abc", "", "8192,", "-1", "1.5"],
             T.Dims: ["32,4096,0,8,14336,128256", "1,2,3", "a,b,c,d,e,f", "", "32,4096,32,8,14336,-1"],
                 T.Video: ["8,16", "8,16,16,1", "0,16,16", "8,-16,16", "a,b,c", "", "8,16,1.5"],
             T.KeyValue: ["x", "=3", ""], T.Reference: ["nomodule", ":f", "", "no_such_module_xyz:fn", "os:no_such_fn"],
             T.Documents: ["abc", "0", "-1", "", "3,x"], T.Storage: ["bogus", "", "nosuchdialect://x/y"],
             T.Endpoint: ["host", "host:0", "host:99999", "", ":29500"], T.Name: ["", "   "],
             T.HardwareProfile: ["no-such-gpu", inputs["missing"], inputs["notjson"], inputs["empty"], inputs["list"],
                                 inputs["binary"], inputs["folder"]]}
    for kind, values in cases.items():
        if isinstance(t, kind):
            return values
    if isinstance(t, click.types.BoolParamType) or getattr(param, "is_flag", False):
        return []  # a flag has no value to get wrong
    if isinstance(t, click.types.UnprocessedParamType):
        return ["stray-word"]  # cptune launch's torchrun options and overrides
    pytest.fail(f"{param.name}: the walk has no bad values for {type(t).__name__}; give the option a checked type "
                "(cptune/cli/_types.py) and its bad values here")


def base_calls(inputs: dict[str, str]) -> dict[tuple[str, ...], list[str]]:
    """A valid call of each command: a bad value replaces one part of it."""
    return {("search",): ["--seq-len", "256", "--nproc", "2"],
            ("plan",): ["--dims", "32,4096,32,8,14336,128256", "--seq-len", "8192", "--gpus", "8"],
            ("probe",): ["--out", "profile.json"],
            ("launch",): [str(RECIPE), "--dry-run"], ("show",): [str(RECIPE)], ("check",): [str(RECIPE)],
            ("index",): ["recipes"], ("ls",): [], ("cp",): ["cpu-2r-s4096-causal", "copy.yaml"],
            ("report",): ["some-study"]}


def with_value(base: list[str], cmd: click.Command, param: click.Parameter, value: str) -> list[str]:
    args = list(base)
    if isinstance(param, click.Argument):
        position = [p for p in cmd.params if isinstance(p, click.Argument)].index(param)
        if position < len(args) and not args[position].startswith("-"):
            args[position] = value
            return args
        return args[:position] + [value] + args[position:] if param.nargs != -1 else [*args, value]
    flag = max(param.opts, key=len)
    if flag in args:  # replace the base's value
        i = args.index(flag)
        return args[:i] + args[i + 2:] + [flag, value]
    return [*args, flag, value]


def _names(param: click.Parameter) -> list[str]:
    argument = [param.human_readable_name, param.name.upper()] if isinstance(param, click.Argument) else []
    return list(param.opts) + argument


CONFLICTS = [  # documented pairs that cannot go together, each with the flags its error must name
    (("search", "--model", str(MODEL), "--heads", "8"), "--heads"),
    (("search", "--model", str(MODEL), "--kv-heads", "2"), "--kv-heads"),
    (("search", "--model", str(MODEL), "--head-dim", "64"), "--head-dim"),
    (("search", "--model", str(MODEL), "--layers", "1"), "--layers"),
    (("search", "--model", str(MODEL), "--workload", "tests.test_interrupts:paced_step"), "--model"),
    (("search", "--window", "16", "--no-causal"), "--window"),
    (("search", "--model-override", "num_hidden_layers=1"), "--model-override"),
    (("plan", "--seq-len", "8192", "--gpus", "8"), "--model"),
    (("plan", "--dims", "32,4096,32,8,14336,128256", "--model-override", "num_hidden_layers=1", "--seq-len", "8192",
      "--gpus", "8"), "--model-override"),
    (("plan", "--model", str(MODEL), "--dims", "32,4096,32,8,14336,128256", "--seq-len", "8192", "--gpus", "8"),
     "--model"),
    (("plan", "--dims", "32,4096,32,8,14336,128256", "--seq-len", "8192", "--gpus", "8", "--gpus-per-node", "3"),
     "--gpus-per-node"),
    (("launch", str(RECIPE), "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "node0:29500"), "--nnodes"),
    (("launch", str(RECIPE), "--dry-run", "--node-rank", "1"), "--node-rank"),
    (("check", str(RECIPE), "--world-size", "3"), "--world-size"),
]


def _walk_cases(inputs):
    bases = base_calls(inputs)
    for path, cmd in _commands(main):
        assert path in bases, f"cptune {' '.join(path)}: give the walk a valid call of it (base_calls)"
        for param in cmd.params:
            if param.name == "help":
                continue
            for value in bad_values(param, inputs):
                yield path, cmd, param, value, [*path, *with_value(bases[path], cmd, param, value)]


def _script_cases(inputs):
    for name, cmd in SCRIPTS.items():
        assert name in SCRIPT_BASES, f"{name}: give the walk a valid call of it (SCRIPT_BASES)"
        for param in cmd.params:
            if param.name == "help":
                continue
            for value in bad_values(param, inputs):
                yield name, cmd, param, value, with_value(SCRIPT_BASES[name], cmd, param, value)


@pytest.fixture
def tripwire(monkeypatch):
    """No rank, torchrun or probe is started: a call that gets that far raises Started."""
    import subprocess

    import cptune.launch

    def started(*args, **kwargs):
        raise Started("would start processes")

    import cptune.models

    monkeypatch.setattr(cptune.launch.WorkerGroup, "start", started)
    monkeypatch.setattr(subprocess, "call", started)
    monkeypatch.setattr(cptune, "init_rank", started)  # a training script got past its checks
    monkeypatch.setattr(cptune.models, "build_model", started)
    monkeypatch.delenv("CPTUNE_RECIPE", raising=False)


@pytest.fixture
def rank_one(tripwire, monkeypatch):
    """A training script's call as the second of two torchrun ranks would make it (no rank is started)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.fixture
def workdir(tmp_path) -> Path:
    """The folder each call runs in, laid out as a clone: its recipes and the examples their scripts name."""
    where = tmp_path / "cwd"
    where.mkdir()
    (where / "recipes").mkdir()
    shutil.copy(RECIPE, where / "recipes")
    (where / "examples").symlink_to(ROOT / "examples")
    return where


def _call(args: list[str], where: Path, command: click.Command = main):
    before = sorted(p.name for p in where.iterdir())
    old = os.getcwd()
    os.chdir(where)
    try:
        result = CliRunner().invoke(command, args, catch_exceptions=True)
    except Started as exc:  # a BaseException: no handler of cptune's can take it for a refusal
        result = SimpleNamespace(exception=exc, exit_code=None, output="")
    finally:
        os.chdir(old)
    written = sorted(set(p.name for p in where.iterdir()) - set(before))
    return result, written


def _verdict(result, written, names: list[str]) -> str | None:
    """Why this call is not a clean refusal, or None."""
    out = result.output
    if isinstance(result.exception, Started):
        return "accepted: got past every check"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"raised {type(result.exception).__name__}: {result.exception}"
    if result.exit_code == 0:
        return "exit 0"
    errors = [line for line in out.splitlines() if line.lower().startswith("error")]
    if len(errors) != 1 and not out.lower().startswith("cptune found"):
        return f"{len(errors)} error lines: {out[-400:]}"
    if not any(n in out for n in names):
        return f"does not name {names[0]}: {out[-400:]}"
    if "Fix:" not in out:
        return f"says no fix: {out[-400:]}"
    if "Traceback" in out:
        return "printed a traceback"
    if written:
        return f"wrote {written}"
    return None


def test_every_option_of_every_command_refuses_bad_values_by_name(inputs, tripwire, workdir, capsys):
    failures, count, options = [], 0, set()
    for path, cmd, param, value, args in _walk_cases(inputs):
        count += 1
        options.add((path, param.name))
        result, written = _call(args, workdir)
        why = _verdict(result, written, _names(param))
        if why:
            failures.append(f"cptune {' '.join(args)}\n    -> {why}")
    with capsys.disabled():
        print(f"\nCLI walk: {count} (command, option, value) cases over {len(options)} options")
    assert not failures, f"{len(failures)} of {count} calls were not clean refusals:\n" + "\n".join(failures)


def test_every_option_of_every_training_script_refuses_bad_values_by_name(inputs, rank_one, workdir, capsys):
    failures, count, options = [], 0, set()
    for name, cmd, param, value, args in _script_cases(inputs):
        count += 1
        options.add((name, param.name))
        result, written = _call(args, workdir, cmd)
        why = _verdict(result, written, _names(param))
        if why:
            failures.append(f"{name} {' '.join(args)}\n    -> {why}")
    with capsys.disabled():
        print(f"\nscript walk: {count} (script, option, value) cases over {len(options)} options of {len(SCRIPTS)} "
              "scripts")
    assert not failures, f"{len(failures)} of {count} calls were not clean refusals:\n" + "\n".join(failures)


SCRIPT_CONFLICTS = [  # values of the right kind that cannot work together, each with the flag its error must name
    ("train_hf.py", ["--resume"], "--resume"),
    ("train_hf.py", ["--save-every", "2"], "--save-every"),
    ("train_hf.py", ["--eos-id", "2"], "--eos-id"),
    ("train_hf.py", ["--documents", "1000"], "--documents"),
    ("train_hf.py", ["--batch", "3", "--recipe", str(RECIPE)], "--batch"),  # dp 2
    ("train_hf.py", ["--weights"], "--weights"),
    ("train_hf.py", ["--data", "{tokens_out_of_vocab}"], "--data"),
    ("train_hf.py", ["--data", "{not_token_lines}"], "--data"),
    ("train_llama_cp.py", ["--documents", "3", "--seq-len", "256"], "--documents"),
    ("vit_noncausal.py", ["--patch", "7"], "--patch"),
    ("train_hf_trainer.py", ["--replicas", "2"], "--replicas"),
]


@pytest.mark.parametrize("script,extra,flag", SCRIPT_CONFLICTS,
                         ids=[f"{s} {' '.join(e)}" for s, e, _ in SCRIPT_CONFLICTS])
def test_script_options_that_cannot_work_together_are_refused_by_name(script, extra, flag, rank_one, workdir):
    data = workdir.parent / "data"
    data.mkdir()
    (data / "ids.jsonl").write_text('{"input_ids": [1, 2, 100000]}\n')
    (data / "text.jsonl").write_text('{"text": "words, not token ids"}\n')
    extra = [x.format(tokens_out_of_vocab=data / "ids.jsonl", not_token_lines=data / "text.jsonl") for x in extra]
    result, written = _call([*SCRIPT_BASES[script], *extra], workdir, SCRIPTS[script])
    assert _verdict(result, written, [flag]) is None, result.output


@pytest.mark.parametrize("script,args,said", [
    ("train_hf.py", ["--steps", "0"], "Invalid value for '--steps': 0 is not in the range x>=1"),
    ("train_hf.py", ["--lr", "nan"], "Invalid value for '--lr': 'nan' is not a number"),
    ("train_hf.py", ["--data", "missing.jsonl"], "Invalid value for '--data': File 'missing.jsonl' does not exist"),
    ("train_hf.py", ["--resume"], "--resume: needs --checkpoint-dir"),
    ("train_hf_trainer.py", ["--grad-accum", "0"], "Invalid value for '--grad-accum': 0 is not in the range x>=1")])
def test_the_five_script_calls_found_by_hand_are_refused_by_name(script, args, said, rank_one, workdir):
    """The five calls that answered with a message not naming the option, torch's ValueError, a bare
    FileNotFoundError, a silent fresh start, and a ZeroDivisionError."""
    result, written = _call([*SCRIPT_BASES[script], *args], workdir, SCRIPTS[script])
    assert _verdict(result, written, [args[0]]) is None and said in result.output, result.output


@pytest.mark.parametrize("args,flag", CONFLICTS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CONFLICTS])
def test_documented_conflicts_are_refused_by_name(args, flag, tripwire, tmp_path):
    result, written = _call(list(args), tmp_path)
    assert _verdict(result, written, [flag]) is None, result.output


def test_the_walk_covers_every_option_and_tries_each_base_call_cleanly(inputs, tripwire, workdir):
    """Every option has bad values (or is a flag), and each base call gets past its checks: the refusals above
    are the bad value's, not the base's."""
    assert len(list(_commands(main))) >= 10
    for path, cmd in _commands(main):
        for param in cmd.params:
            bad_values(param, inputs)  # fails on an option of a kind the walk does not know
    for path, args in base_calls(inputs).items():
        if path == ("report",):
            continue  # no study to report on here
        result, _ = _call([*path, *args], workdir)
        assert isinstance(result.exception, Started) or result.exit_code == 0, (path, result.output)



def test_each_scripts_valid_call_gets_past_its_checks(inputs, rank_one, workdir):
    """The scripts' refusals above are the bad value's, not the base call's."""
    for name, cmd in SCRIPTS.items():
        for param in cmd.params:
            bad_values(param, inputs)
        result, _ = _call(SCRIPT_BASES[name], workdir, cmd)
        assert isinstance(result.exception, Started), (name, result.output)


@pytest.mark.parametrize("case", ["not-json", "unknown-type", "zero-dims", "override-type", "heads-with-model"])
def test_the_five_calls_found_by_hand_are_refused_by_name(case, inputs, tripwire, tmp_path):
    """The five malformed calls of the newest commands that were not refused by name (a JSONDecodeError, transformers'
    400-type ValueError, a ZeroDivisionError, a TypeError from a config class, --heads 8 taken for the default)."""
    plan = ["plan", "--seq-len", "8192", "--gpus", "8"]
    args, flag, said = {
        "not-json": ([*plan, "--model", inputs["model-notjson"]], "--model", "is not a JSON file"),
        "unknown-type": ([*plan, "--model", inputs["model-unknown-type"]], "--model",
                         "'no-such-model-type' is not one"),
        "zero-dims": ([*plan, "--dims", "32,4096,0,8,14336,128256"], "--dims", "six positive integers"),
        "override-type": ([*plan, "--model", str(MODEL), "--model-override", "num_hidden_layers=many"],
                          "--model-override", "num_hidden_layers='many': the config holds a int"),
        "heads-with-model": (["search", "--model", str(MODEL), "--heads", "8"], "--heads", "come from its config"),
    }[case]
    result, written = _call(args, tmp_path)
    assert _verdict(result, written, [flag]) is None, result.output
    assert said in result.output and len(result.output) < 1000, result.output  # one line, not transformers' list


def test_library_errors_name_python_arguments_and_only_the_cli_says_flags():
    """cptune.plan, cptune.models, cptune.search and the rest name the Python argument (memory_budget); the CLI
    modules map those names to flags."""
    import re

    import cptune
    from cptune.plan import load_hardware
    from cptune.sizes import parse_size

    cli = ROOT / "cptune" / "cli"  # the command's package
    flagged = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "cptune").rglob("*.py") if cli not in p.parents
               for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"Problem\(f?\"--", line)]
    assert not flagged, flagged
    with pytest.raises(cptune.ValidationError, match=r"^cptune: memory: cannot read 'lots'"):
        parse_size("lots", "memory")
    with pytest.raises(cptune.ValidationError, match=r"cptune: hardware: 'no-such-gpu' is neither"):
        load_hardware("no-such-gpu")
    with pytest.raises(cptune.ValidationError, match=r"n_trials: is 0"):
        cptune.tune(cptune.Workload(seq_len=256), n_trials=0)


def _search_with_nproc_inside_a_job():
    import cptune

    try:
        cptune.tune(cptune.Workload(seq_len=256), nproc=4)
    except cptune.ValidationError as exc:
        return str(exc)
    return "accepted"


def test_nproc_inside_a_torchrun_job_is_refused_on_every_rank_before_any_trial(ranks):
    said = ranks(2).run(_search_with_nproc_inside_a_job)
    assert all("nproc: is 4 inside a torchrun job, whose own 2 ranks are measured" in s for s in said), said
