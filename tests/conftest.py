"""Shared fixtures: ``ranks(n)`` gives a group of n gloo ranks on localhost, started once per session."""

import inspect
import re

import pytest
import torch

from cptune.launch import WorkerGroup


TOUCHES_TRANSFORMERS = re.compile(r"transformers|tests/models|cptune\.models|\bmodels\.\w+\(|cptune\.hf|\"--model\"|"
                                  r"\bMODEL\b|train_hf")
"""What in a test's text says that it runs transformers (a model, a config, the Trainer, the script that trains one)."""


def _text(function, module, depth: int = 3) -> str:
    """``function``'s source and, ``depth`` calls deep, the sources of the module's functions it names."""
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        return ""
    if depth:
        for name in function.__code__.co_names:
            helper = getattr(module, name, None)
            if inspect.isfunction(helper) and helper.__module__ == module.__name__ and helper is not function:
                text += _text(helper, module, depth - 1)
    return text


def _touches_transformers(item) -> bool:
    """A test runs transformers when its own text, that of the helpers and fixtures of its module it uses, or
    its parameters say so (found from the code, not kept in a list)."""
    function, module = getattr(item, "function", None), getattr(item, "module", None)
    if function is None or module is None:
        return False
    texts = [_text(function, module)]
    if 'importorskip("transformers")' in inspect.getsource(module):  # every test of a module that needs it
        return True
    for name in getattr(item, "fixturenames", ()):
        fixture = getattr(module, name, None)
        texts.append(_text(getattr(fixture, "__wrapped__", fixture), module) if callable(fixture) else "")
    callspec = getattr(item, "callspec", None)
    texts.append(repr(callspec.params) if callspec is not None else "")
    return any(TOUCHES_TRANSFORMERS.search(t) for t in texts)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: end-to-end runs of the CLI or examples")
    config.addinivalue_line("markers", "transformers: runs transformers (marked from the test's code; CI runs these "
                                       "again on the oldest transformers pyproject admits)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _touches_transformers(item):
            item.add_marker(pytest.mark.transformers)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks():
    groups: dict[int, WorkerGroup] = {}

    def get(n: int) -> WorkerGroup:
        if n not in groups:
            groups[n] = WorkerGroup(n, timeout=120)
        return groups[n]

    yield get
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor() as pool:  # the groups wind down together, not one after another
        list(pool.map(WorkerGroup.close, groups.values()))
