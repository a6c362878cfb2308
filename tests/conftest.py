"""Shared fixtures: the tiny tokenizer and the tiny model with kvbench's attention installed.

Fixtures are found by pytest (never imported); functions the tests call themselves are in helpers.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbench.models.tiny import build_tiny_tokenizer

from helpers import installed_model


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml's markers (same effect): the tests that need a SLURM cluster
    # (tests/test_slurm.py starts one with scripts/slurm_cluster.sh, or skips with the reason when it cannot).
    config.addinivalue_line("markers", "slurm: needs a SLURM cluster (a one-node one from scripts/slurm_cluster.sh); "
                                       "part of the default run, skipped where none can be started unless CI is set")


@pytest.fixture(scope="session")
def tok() -> Any:
    """The tiny byte-level tokenizer the built-in models use."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    """tiny-llama with the attention wrapper, one per test module. A module that needs another variant says so once,
    `pytestmark = pytest.mark.tiny_model("tiny-llama", num_hidden_layers=4)`: the marker's arguments are
    `installed_model`'s."""
    marker = request.node.get_closest_marker("tiny_model")
    args, kwargs = (marker.args, marker.kwargs) if marker is not None else ((), {})
    return installed_model(*args, **kwargs)[0]


@pytest.fixture
def one_thread() -> Any:
    """One torch thread for the test. Block forwards of a few tokens on a loaded machine: a second thread only adds
    waiting."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
