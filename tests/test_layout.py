"""The package's map holds: modules of a readable size, no import cycle, one boundary to torch's private code,
and docs/internals.md's Layout naming every module. Pure file reads: no torch process group."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cptune"
MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PACKAGE.rglob("*.py")}


def _imports(module: str, path: Path) -> set[str]:
    """cptune modules ``module`` imports: at module level, inside functions, and for annotations only."""
    tree = ast.parse(path.read_text())
    guarded: set[int] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
            found |= subs
            if target in MODULES and len(subs) < len(node.names):
                found.add(target)
    # a package that is the importer's own ancestor is already importing: not an edge
    return {m for m in found if not (module == m or module.startswith(m + "."))}


def test_no_module_is_past_400_lines():
    every = {**MODULES, **{f"benchmarks.{p.stem}": p for p in (ROOT / "benchmarks").glob("*.py")}}
    long = {m: n for m, p in every.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these modules: {long}"


def test_the_package_root_is_thin():
    """One concept a subpackage (attention, mixers, models, hf, verify, plan, search, cli, examples): the root holds
    the public types, the block and the few modules every package shares."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 20, root


def _private_imports(base: str) -> list[tuple[str, str]]:
    """(importer, module) where a module under ``base`` imports a private module (a ``_name`` part) of a package
    that is not its own or one of its ancestors: packages talk through their faces."""
    found = []
    for path in (ROOT / base).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                head = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(head + ([node.module] if node.module else [])) if node.level else node.module or ""
                targets = [target] + [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            else:
                continue
            for target in targets:
                names = target.split(".")
                for i, name in enumerate(names):
                    if name.startswith("_") and not name.startswith("__") and ".".join(names[:i + 1]) in MODULES:
                        owner = ".".join(names[:i])
                        if not (module == owner or module.startswith(owner + ".")):
                            found.append((module, target))
                        break
    return sorted(set(found))


def test_packages_talk_through_their_faces():
    """No module of cptune, the benchmarks or the example scripts imports another package's private module (tests may:
    they test the insides)."""
    found = [pair for base in ("cptune", "benchmarks", "examples") for pair in _private_imports(base)]
    assert not found, found


def test_a_walk_from_build_model_to_a_split_path_stays_in_models_hf_and_mixers():
    """build_model enables the model (hf), which prepares each layer that mixes tokens (mixers), whose split path
    runs at the model's forward: the shortest chain of imports from the build to each split path crosses no other
    package."""
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    for goal in ("cptune.mixers._heads", "cptune.mixers._halo"):
        seen, queue = {"cptune.models._build": ["cptune.models._build"]}, ["cptune.models._build"]
        while queue and goal not in seen:
            here = queue.pop(0)
            for there in sorted(graph[here]):
                if there not in seen and there.startswith(("cptune.models", "cptune.hf", "cptune.mixers")):
                    seen[there] = seen[here] + [there]
                    queue.append(there)
        assert goal in seen, f"no walk from cptune.models._build to {goal} inside models/, hf/ and mixers/"


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_boundary_module_reaches_torch_private_code():
    """torch's private CP code, its C bindings, c10d's internals, the underscored aten ops (the SDPA kernels)
    and a tensor's ``_base``: named in ``cptune._torch_cp`` and nowhere else, docstrings included."""
    private = re.compile(r"tensor\.experimental\._|_context_parallel|torch\._[A-Za-z]|distributed_c10d\._|aten\._|"
                         r"\._base\b|_use_count")
    users = sorted(m for m, p in MODULES.items() if private.search(p.read_text()))
    assert users == ["cptune._torch_cp"], users


def test_the_attention_package_never_imports_what_uses_it():
    """One-way flow: cptune.attention imports only itself, the boundary and the error types (annotations
    included), so nothing in it can reach the block (``cptune._session``) or anything above."""
    allowed = {"cptune._torch_cp", "cptune.errors", "cptune._deps"}
    outside = {m: sorted(d for d in _imports(m, p) if not d.startswith("cptune.attention") and d not in allowed)
               for m, p in MODULES.items() if m.startswith("cptune.attention")}
    assert not {m: d for m, d in outside.items() if d}, outside
    assert not any(d.startswith("cptune.attention") for d in _imports("cptune._torch_cp", MODULES["cptune._torch_cp"]))


def test_the_internals_page_names_every_module():
    text = (ROOT / "docs" / "internals.md").read_text()
    layout = text[text.index("## Layout"):]
    missing = [m for m, p in MODULES.items() if p.name != "__init__.py" and p.name not in layout
               and f"`{p.stem}`" not in layout]
    assert not missing, f"docs/internals.md's Layout section does not name {missing}"


def test_texts_follow_their_constants():
    from cptune.search import racing
    from cptune.search.result import SearchResult

    assert f"within {racing.INDIFFERENCE:.0%} after paired race rounds" in SearchResult.LEGEND
    assert f"within {racing.MEMORY_TIE:.0%} counts as equal" in racing.TIE_RULE


def test_dependency_floors_agree_with_pyproject():
    from cptune._deps import FLOORS, version_tuple

    block = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    stated = {name.lower(): version_tuple(floor) for name, floor in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', block)}
    assert stated == {name: version_tuple(v) for name, v in FLOORS.items()}, \
        "pyproject.toml and cptune/_deps.py state different floors"


def test_the_readme_is_short_and_every_page_link_resolves():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert readme.index("python -m pip install torch==2.13.0 -e '.[test]' && python -m pytest -q") < 2000
    broken = [(page.name, link) for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
              for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text())
              if not (page.parent / link).exists()]
    assert not broken, broken


def test_every_shipped_recipe_launches_a_module_the_package_ships():
    """A wheel has no examples/ folder: a shipped recipe's script is one of cptune.examples, which it installs."""
    import yaml

    for path in (ROOT / "recipes").glob("*.yaml"):
        script = yaml.safe_load(path.read_text())["launch"]["script"]
        assert script.startswith("cptune.examples."), (path.name, script)
        assert (ROOT / (script.replace(".", "/") + ".py")).is_file(), (path.name, script)
    assert 'include = ["cptune*"]' in (ROOT / "pyproject.toml").read_text()  # cptune.examples goes into the wheel


def test_importing_cptune_leaves_dynamo_to_the_first_call_that_needs_it():
    """Importing dynamo is about a second of every cptune process (the CLI's, each rank's): ``cptune._torch_cp.
    not_compiled`` marks what torch.compile must not trace, and dynamo comes at its first call; nor does cptune's
    release at exit import it (torch's debug tools, which empty DTensor's caches, would)."""
    import subprocess
    import sys

    code = "import atexit, sys; atexit.register(lambda: print(sorted(m for m in sys.modules if " \
           "m.startswith('torch._dynamo')))); import cptune, cptune.cli, cptune.models, cptune.hf"  # run last
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
