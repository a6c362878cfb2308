"""kvbench.models.generation: the transformers internals kvbench calls still take what kvbench passes them. A
transformers release that renames or drops one fails here by name, before any run decodes with a processor list built
wrong."""

from __future__ import annotations

import inspect

import pytest
from transformers.generation.utils import GenerationMixin

from kvbench.models.generation import PRIVATE_CALLS


@pytest.mark.parametrize("name", sorted(PRIVATE_CALLS))
def test_private_methods_take_what_kvbench_passes(name: str) -> None:
    method = getattr(GenerationMixin, name, None)
    assert method is not None, f"transformers' GenerationMixin has no {name} any more (kvbench/models/generation.py)"
    params = inspect.signature(method).parameters
    missing = [p for p in PRIVATE_CALLS[name] if p not in params]
    assert not missing, f"GenerationMixin.{name} no longer takes {missing} (kvbench/models/generation.py)"


def test_the_adapter_names_every_private_call_it_makes() -> None:
    # Every `model._name(` call in the adapter is listed in PRIVATE_CALLS, with the keywords it passes.
    import re

    import kvbench.models.generation as hf

    source = inspect.getsource(hf)
    called = set(re.findall(r"model\.(_\w+)\(", source))
    assert called == set(PRIVATE_CALLS)
    for name, params in PRIVATE_CALLS.items():
        call = source[source.index(f"model.{name}("):]
        call = call[:call.index(")\n")]
        keywords = set(re.findall(r"(\w+)=", call))
        assert keywords <= set(params), (name, keywords - set(params))
