"""Shared test fixtures and builders: the tiny tokenizer and models, and hand-built cache layers.

Helpers are imported by name (`from conftest import make_layer`); fixtures are found by pytest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbench.engine import attention
from kvbench.engine.cache import EvictingLayer
from kvbench.models.tiny import build_tiny_model, build_tiny_tokenizer


def installed_model(arch: str = "tiny-llama", **kw: Any) -> tuple[Any, Any]:
    """A tiny random model (and its tokenizer) with kvbench's attention wrapper installed."""
    model, tok = build_tiny_model(arch, **kw)
    attention.install(model)
    return model, tok


def make_layer(keys: list, queries: list | None = None, values: list | None = None, layer_idx: int = 0,
               scaling: float = 1.0) -> EvictingLayer:
    """A layer holding `keys` (h_kv, n, d) at positions 0..n-1 (values zero unless given), and optionally stashed
    `queries` (h_q, w, d) at the latest w positions."""
    k = torch.tensor(keys, dtype=torch.float32).unsqueeze(0)  # (1, h_kv, n, d)
    v = torch.zeros_like(k) if values is None else torch.tensor(values, dtype=torch.float32).unsqueeze(0)
    layer = EvictingLayer(layer_idx)
    layer.update(k, v)
    layer.scaling, layer.softcap = scaling, None
    if queries is not None:
        q = torch.tensor(queries, dtype=torch.float32).unsqueeze(0)  # (1, h_q, w, d)
        layer.queries = q
        layer.query_positions = torch.arange(layer.seen - q.shape[2], layer.seen)
    return layer


@pytest.fixture(scope="session")
def tok() -> Any:
    """The tiny byte-level tokenizer the built-in models use."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model() -> Any:
    """tiny-llama with the attention wrapper (modules that need another variant define their own `model`)."""
    return installed_model()[0]
