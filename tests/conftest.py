"""Shared fixtures: ``ranks(n)`` gives a group of n gloo ranks on localhost, started once per session."""

import pytest
import torch

from cptune.launch import WorkerGroup


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: end-to-end runs of the CLI or examples")


def pytest_collection_modifyitems(config, items):
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
