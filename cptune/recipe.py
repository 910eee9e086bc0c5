"""Recipes: what a search chose, on what, and why, as a YAML file that launches with torchrun.

A recipe is plain data (``yaml.safe_load``; it never executes code), versioned by
``schema_version``, and starts with a comment holding the exact command it stands for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field

from ._env import environment
from .config import CPConfig, StrictModel
from .errors import CPTuneError, Problem, ProblemError, ValidationError, raise_if
from .workload import Workload

SCHEMA_VERSION = 1
ENV_VAR = "CPTUNE_RECIPE"


class Launch(StrictModel):
    """How torchrun starts the job. Multi-node values are placeholders until set at launch."""

    nnodes: int = Field(1, ge=1, json_schema_extra={"fix": "set launch.nnodes to the number of machines"})
    nproc_per_node: int = Field(1, ge=1, json_schema_extra={"fix": "set launch.nproc_per_node to ranks per machine"})
    rdzv_backend: str = Field("c10d", json_schema_extra={"fix": "use rdzv_backend: c10d"})
    rdzv_endpoint: str = Field("HOST:29500", json_schema_extra={
        "fix": "set launch.rdzv_endpoint to node 0's HOST:PORT (or pass --rdzv-endpoint)"})
    script: str | None = Field(None, json_schema_extra={
        "fix": "set launch.script to the training script's path, or to a module (cptune.examples.train_llama_cp)"})
    """A script's path (``train.py``), or a module torchrun runs as ``python -m`` would (``cptune.examples.train_hf``)."""
    args: list[str] = Field(default_factory=list, json_schema_extra={"fix": "give launch.args as a list of strings"})

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def is_module(script: str) -> bool:
    """Whether ``script`` names a module (``pkg.mod``: run as ``python -m``) rather than a file."""
    return not script.endswith(".py") and all(part.isidentifier() for part in script.split("."))


def script_problem(script: str) -> Problem | None:
    """Why ``script`` cannot be launched from here (no such file, or no such module), or None."""
    if is_module(script):
        import importlib.util

        try:
            found = importlib.util.find_spec(script) is not None
        except ImportError:  # its package is missing
            found = False
        return None if found else Problem("script", f"{script!r} is no module this Python can import",
                                          "install the package that has it, or give a script's path after --")
    if not Path(script).is_file():
        return Problem("script", f"{script!r} does not exist", "give the path of the training script after --")
    return None


def script_argv(script: str) -> list[str]:
    """How torchrun is told to run ``script``: its path, or ``-m`` and the module."""
    return ["-m", script] if is_module(script) else [script]


class Provenance(StrictModel):
    cptune_version: str
    torch_version: str
    device: str = Field(json_schema_extra={"fix": "set provenance.device to 'cpu' or a GPU name"})
    device_type: Literal["cpu", "cuda"] = Field(json_schema_extra={"fix": "use device_type: cpu or cuda"})
    device_count: int
    backend: Literal["gloo", "nccl"] = Field(json_schema_extra={"fix": "use backend: gloo or nccl"})
    date: str
    study_name: str | None = None
    storage: str | None = None
    n_trials: int | None = None
    command: str | None = None


class Metrics(StrictModel):
    measured: bool = Field(json_schema_extra={"fix": "set metrics.measured: true only for measured recipes"})
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_bytes_per_rank: list[int] | None = None
    memory_budget: int | None = None
    memory_margin: float | None = None
    """The safety margin feasibility was judged with: worst peak x (1 + margin) <= budget."""
    headroom: float | None = None
    """(budget - worst peak per rank) / budget."""
    compile_s: float | None = None
    """torch.compile time of the first step (workload.compile), kept out of tokens_per_s."""
    equivalent: list[str] = Field(default_factory=list)
    """Configurations the search could not tell apart from this one (within measurement noise)."""
    digest: str | None = None
    """A hash of what was measured and found (workload, config, ranks, provenance, metrics): an edit shows up
    as a mismatch, and a recipe without one cannot be verified."""
    predicted_by: str | None = None
    """Set by cptune plan: the figures are its predictions (for hardware not at hand), not measurements."""
    note: str = ""


class Recipe(StrictModel):
    schema_version: Literal[1] = Field(1, json_schema_extra={
        "fix": f"this cptune reads schema_version {SCHEMA_VERSION}; regenerate the recipe with cptune search"})
    workload: Workload
    config: CPConfig
    launch: Launch
    provenance: Provenance
    metrics: Metrics

    @pydantic.model_validator(mode="after")
    def _mesh_is_the_world(self) -> Recipe:
        """The configuration's mesh holds the ranks the recipe launches: named at load, before any rank starts."""
        try:
            self.config.parallel_dims(self.launch.world_size)
        except ValidationError as exc:
            problem = exc.problems[0]
            raise ProblemError(Problem(problem.argument, f"{problem.message} (launch: {self.launch.nnodes} node(s) x "
                                       f"{self.launch.nproc_per_node} ranks)", problem.fix + ", or launch that many "
                                       "ranks")) from None
        return self

    def torchrun_args(self, script: str | None = None, args: list[str] | None = None, *, nnodes: int | None = None,
                      node_rank: int | None = None, rdzv_endpoint: str | None = None,
                      torchrun_options: list[str] = ()) -> list[str]:
        """The torchrun argument list (no shell involved); overrides win over the recipe.

        ``torchrun_options`` (e.g. ``--max-restarts 3``) go to torchrun, before the script.
        """
        launch = self.launch
        script = script or launch.script
        if not script:
            raise ValidationError([Problem("launch.script", "the recipe names no script and none was given",
                                           "append '-- path/to/train.py [args]' or set launch.script")])
        nnodes = nnodes or launch.nnodes
        if nnodes != launch.nnodes:  # the job's world must be the one the configuration was measured for
            raise_if([Problem("nnodes", p.message, "leave the node count as the recipe has it, or search again for "
                              f"{nnodes} node(s)") for p in world_size_problems(self, nnodes * launch.nproc_per_node)])
        if node_rank is not None and not 0 <= node_rank < nnodes:
            raise ValidationError([Problem("node_rank", f"is {node_rank} in a job of {nnodes} node(s)",
                                           f"give each node its rank, 0 to {nnodes - 1}")])
        argv = ["torchrun"]
        if nnodes == 1:
            argv += ["--standalone", "--nnodes=1"]
        else:
            endpoint = rdzv_endpoint or launch.rdzv_endpoint
            if endpoint.startswith("HOST"):
                raise ValidationError([Problem("launch.rdzv_endpoint", f"is the placeholder {endpoint!r}",
                                               "pass --rdzv-endpoint node0-host:29500")])
            argv += [f"--nnodes={nnodes}", f"--rdzv-backend={launch.rdzv_backend}",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=cptune"]
            if node_rank is not None:
                argv.append(f"--node-rank={node_rank}")
        argv += [f"--nproc-per-node={launch.nproc_per_node}", *torchrun_options, *script_argv(script),
                 *(launch.args if args is None else args)]
        return argv

    def with_overrides(self, overrides: list[str]) -> Recipe:
        """This recipe with ``section.field=value`` overrides applied (values read as YAML).

        An overridden recipe no longer describes what was measured: it is marked unmeasured,
        and its note says what changed from the measured configuration.
        """
        if not overrides:
            return self
        data, changes, problems = self.model_dump(mode="json"), [], []
        for item in overrides:
            key, sep, text = item.partition("=")
            section, _, name = key.partition(".")
            if not sep or section not in ("config", "launch", "workload") or not name or "." in name:
                problems.append(Problem(item, "is not an override", "write section.field=value with section config, "
                                        "launch or workload, e.g. config.rotate_method=alltoall"))
                continue
            if name not in data[section]:
                problems.append(Problem(key, "is not a recipe field", f"use one of {', '.join(data[section])}"))
                continue
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
            changes.append(f"{key}: {data[section][name]!r} -> {value!r}")
            data[section][name] = value
        raise_if(problems)
        data["metrics"] = {**data["metrics"], "measured": False,
                           "note": "overridden at launch (" + "; ".join(changes) + "); the figures are for the "
                                   "measured configuration"}
        try:
            patched = Recipe(**data)
            raise_if(patched.config.degree_problems(patched.config.parallel_dims(patched.launch.world_size).cp))
        except ValidationError as exc:
            raise ValidationError([Problem(f"override {pr.argument}", pr.message, pr.fix) for pr in exc.problems]) \
                from None
        return patched

    def measured_digest(self) -> str:
        """A hash of what was measured and what was found: workload, config, ranks, provenance and metrics.

        Fields at their defaults are left out, so a field added to the format later does not change
        the digests of recipes written before it. Prefixed ``v2:``; a digest without the prefix was
        written before the metrics were covered and is checked as it was made (:meth:`_v1_digest`).
        """
        launch = {"nnodes": self.launch.nnodes, "nproc_per_node": self.launch.nproc_per_node}
        what = {"workload": self.workload.model_dump(mode="json", exclude_defaults=True),
                "config": self.config.model_dump(mode="json", exclude_defaults=True), "launch": launch,
                "provenance": self.provenance.model_dump(mode="json", exclude_defaults=True),
                "metrics": self.metrics.model_dump(mode="json", exclude_defaults=True, exclude={"digest"})}
        return "v2:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def _v1_digest(self) -> str:
        launch = {"nnodes": self.launch.nnodes, "nproc_per_node": self.launch.nproc_per_node}
        config = self.config.model_dump(mode="json")
        if config["strategy"] == "ring" and config["ulysses_degree"] is None:  # recipes from before strategies
            del config["strategy"], config["ulysses_degree"]
        for name, default in (("mixers", "split"), ("ep_degree", 1)):  # every v1 recipe is from before these
            if config.get(name) == default:
                del config[name]
        what = {"workload": self.workload.question(), "config": config,  # the workload's fields of 0.1.0
                "launch": launch, "provenance": self.provenance.model_dump(mode="json")}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def verifiable(self) -> bool:
        """Whether the recipe carries a digest to check its figures against (search writes one)."""
        return self.metrics.digest is not None

    @property
    def edited(self) -> bool:
        """Measured, but what was measured or found has been changed since (by hand): its figures do not apply."""
        digest = self.metrics.digest
        if not self.metrics.measured or digest is None:
            return False
        return digest != (self.measured_digest() if digest.startswith("v2:") else self._v1_digest())

    @property
    def figures_apply(self) -> bool:
        """Measured, with a digest that matches: the figures are what the search found for this content."""
        return self.metrics.measured and self.verifiable and not self.edited

    def figures_status(self) -> str | None:
        """Why the figures do not apply, in a few words ('edited after measuring', 'not verifiable (no
        digest)', 'not measured'), or None when they do."""
        if self.figures_apply:
            return None
        if self.edited:
            return "edited after measuring"
        if self.metrics.predicted_by:
            return f"predicted, not measured ({self.metrics.predicted_by})"
        return "not verifiable (no digest)" if self.metrics.measured else "not measured"

    def header(self, path: str | os.PathLike | None = None) -> str:
        where = path or "RECIPE.yaml"
        endpoint = "NODE0_HOST:29500" if self.launch.rdzv_endpoint.startswith("HOST") else None  # several nodes
        lines = [f"# {shlex.join([f'{ENV_VAR}={where}', *self.torchrun_args('SCRIPT.py' if not self.launch.script else None, rdzv_endpoint=endpoint)])}",
                 f"# or: cptune launch {where}{'' if self.launch.script else ' -- SCRIPT.py [ARGS]'}"]
        if self.metrics.measured:
            lines.append(f"# measured by cptune search on {self.provenance.device_count} x {self.provenance.device} "
                         f"({self.provenance.backend}), {self.provenance.date}")
        elif self.metrics.predicted_by:
            lines.append(f"# PREDICTED, NOT MEASURED: by {self.metrics.predicted_by}; measure with cptune search")
        else:
            lines.append("# NOT MEASURED: written by hand or from defaults; run cptune search to measure")
        return "\n".join(lines) + "\n"


def _yaml_text(recipe: Recipe, path: str | os.PathLike | None) -> str:
    body = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=None)
    return recipe.header(path) + body


def per_length_path(path: str | os.PathLike, seq_len: int) -> str:
    """runs/x.yaml -> runs/x-s8192.yaml: where a schedule's recipe for one length goes."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-s{seq_len}{p.suffix or '.yaml'}"))


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write atomically: a failure never leaves a half-written recipe behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_yaml_text(recipe, path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_recipe(path: str | os.PathLike | None = None) -> Recipe:
    """Read and validate a recipe; ``None`` reads the file named by $CPTUNE_RECIPE."""
    if path is None:
        path = os.environ.get(ENV_VAR)
        if not path:
            raise CPTuneError(f"no recipe given and ${ENV_VAR} is not set; pass a path or launch with cptune launch")
    p = Path(path)
    if not p.is_file():
        raise ValidationError([Problem("recipe", f"{str(p)!r} does not exist", "check the path; cptune ls lists the shipped and local recipes")])
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError([Problem("recipe", f"{p} cannot be read as text ({exc})",
                                       "give a recipe file that cptune search or cptune plan wrote")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValidationError([Problem("recipe", f"{p} is not valid YAML{where}: {getattr(exc, 'problem', exc)}",
                                       "fix the YAML syntax there, or regenerate it with cptune search")]) from None
    if not isinstance(data, dict):
        raise ValidationError([Problem("recipe", f"{p} holds a {type(data).__name__}, not a mapping",
                                       "a recipe is a YAML mapping with workload, config, launch, ... keys")])
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValidationError([Problem("schema_version", f"{p} has schema_version {version!r}",
                                       f"this cptune reads version {SCHEMA_VERSION}: regenerate it with cptune search "
                                       "or upgrade cptune")])
    try:
        return Recipe(**data)
    except ValidationError as exc:
        raise ValidationError([Problem(f"{p.name}: {pr.argument}", pr.message, pr.fix) for pr in exc.problems]) \
            from None
    except (TypeError, pydantic.ValidationError) as exc:  # nested sections that are not mappings
        raise ValidationError([Problem(f"{p.name}", str(exc).splitlines()[0], "compare with a generated recipe")]) \
            from None


def command_line() -> str:
    """The command that ran this process, as a user retypes it: ``cptune ...`` from the script or
    ``python -m cptune`` (whose argv[0] is the package's ``__main__.py``); under torchrun, the
    torchrun command is the launcher's, so the line says to rerun it."""
    path = Path(sys.argv[0])
    if path.name == "cptune" or (path.name == "__main__.py" and path.parent.name == "cptune"):
        line = shlex.join(["cptune", *sys.argv[1:]])
    else:
        line = shlex.join(sys.argv)
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return line
    return f"the same torchrun command (torchrun ... {'-m ' if line.startswith('cptune ') else ''}{line})"


MODEL_SCRIPT = "cptune.examples.train_hf"
"""What a --model recipe launches unless told otherwise: it trains the recipe's model on its data settings."""


def recipe_from_search(result: Any, script: str | None = None, args: list[str] | None = None) -> Recipe:
    """The recipe for a search's best feasible configuration (``result``: a SearchResult), in the shape it was
    measured on: its world of ranks as nodes x ranks per node (a torchrun job's LOCAL_WORLD_SIZE per node)."""
    best = result.best
    if best is None:
        raise CPTuneError("the search found no feasible configuration; nothing to write")
    nnodes, rest = divmod(result.world_size, result.nproc_per_node)
    if rest:
        raise CPTuneError(f"the search ran on {result.world_size} ranks, {result.nproc_per_node} on this node: "
                          "not the same number on every node, which a recipe (nodes x ranks per node) cannot say")
    env = environment(result.device, result.world_size, result.nproc_per_node).provenance()
    recipe = Recipe(
        workload=result.workload.model_copy(update={"ac": best.ac}) if best.ac else result.workload,
        config=best.config,
        launch=Launch(nnodes=nnodes, nproc_per_node=result.nproc_per_node, args=list(args or []),
                      script=script or (MODEL_SCRIPT if result.workload.model else None)),
        provenance=Provenance(**env, study_name=result.study_name, storage=result.storage,
                              n_trials=len(result.trials), command=command_line()),
        metrics=Metrics(measured=True, tokens_per_s=best.tokens_per_s, step_time_s=best.step_time_s,
                        peak_bytes_per_rank=best.peak_per_rank, memory_budget=result.memory_budget,
                        compile_s=best.compile_s, memory_margin=result.memory_margin, headroom=best.headroom,
                        equivalent=[r.label for r in result.tie],
                        note=f"best of {len(result.trials)} trials; "
                             f"{sum(r.state == 'ok' for r in result.trials)} feasible"
                             + (f"; tie: {result.tie_note()}" if result.tie else "")),
    )
    return recipe.model_copy(update={"metrics": recipe.metrics.model_copy(
        update={"digest": recipe.measured_digest()})})


def world_size_problems(recipe: Recipe, world_size: int, argument: str = "recipe") -> list[Problem]:
    """A problem if the job's world size is not the recipe's."""
    launch = recipe.launch
    if world_size == launch.world_size:
        return []
    return [Problem(argument, f"the recipe is for {launch.world_size} ranks ({launch.nnodes} node(s) x "
                    f"{launch.nproc_per_node}) but this job has {world_size}",
                    f"launch with cptune launch (it starts {launch.world_size} ranks) or use a recipe "
                    f"searched for {world_size} ranks")]
