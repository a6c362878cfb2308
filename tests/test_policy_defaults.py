"""One default per option, said three times: every policy's YAML (conf/policy/*.yaml) against its class's constructor
defaults (kvbench/policies/*.py), and the options column of docs/policies.md's table against the YAML.

A YAML named after its class (`keydiff.yaml` for KeyDiff, name "keydiff") sets the class's own defaults; another YAML
of the same class is a preset (`h2o_original.yaml`: H2O with recent_ratio 0.5), whose options must exist but may
differ from the constructor's. The checks are plain functions, also run on planted mismatches below, so they cannot
pass by finding nothing.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "policies.md"
# Run-level settings every policy receives from the run (top-level `budget`, `seed`), not options of a policy.
RUN_LEVEL = {"budget", "seed"}


def _composed_base() -> dict[type, type]:
    # CriticalKV passes its remaining options (window, kernel) to the base policy it composes (SnapKV by default),
    # not to its own superclass: that base's constructor supplies their defaults.
    from kvbench.policies.criticalkv import CriticalKV
    from kvbench.policies.snapkv import SnapKV

    return {CriticalKV: SnapKV}


def plain(value: Any) -> Any:
    """Tuples as lists (a constructor's `(0, 1)` is the YAML's `[0, 1]`)."""
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def constructor_defaults(cls: type, composed: dict[type, type] | None = None) -> dict[str, Any]:
    """Every option `cls(...)` takes, with its default: its own `__init__` parameters, then those its `**kwargs` reach
    (the superclasses' `__init__`s in MRO order, and a composed base's), the nearest definition winning."""
    chain = [c for c in cls.__mro__ if "__init__" in vars(c) and c is not object]
    base = (composed if composed is not None else _composed_base()).get(cls)
    if base is not None:
        chain += [c for c in base.__mro__ if "__init__" in vars(c) and c is not object]
    out: dict[str, Any] = {}
    for c in chain:
        for name, p in inspect.signature(vars(c)["__init__"]).parameters.items():
            if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in RUN_LEVEL:
                continue
            out.setdefault(name, plain(p.default))
    return out


def doc_value(text: str) -> Any:
    """A default as the docs write it: JSON where it is JSON (4, 0.2, 1e-4, [0, 1], null), else the bare word."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(cell: str) -> dict[str, Any]:
    """`name` (default), `name` (a \\| b; default) and `name` (default; note), comma-separated, as {name: default};
    "—" is no options. Anything else (a name without its parenthesis, text between entries) is an error, so the
    column keeps the one form this test reads."""
    cell = cell.strip()
    if cell == "—":
        return {}
    out: dict[str, Any] = {}
    i = 0
    while i < len(cell):
        if not cell.startswith("`", i):
            raise ValueError(f"expected `option` at {cell[i:]!r}")
        end = cell.index("`", i + 1)
        name = cell[i + 1:end]
        i = end + 1
        if not cell.startswith(" (", i):
            raise ValueError(f"option `{name}` has no (default)")
        depth, j = 0, i + 1
        while True:  # the matching parenthesis: notes may hold their own, e.g. ⌈log2(2g)⌉
            depth += {"(": 1, ")": -1}.get(cell[j], 0)
            if depth == 0:
                break
            j += 1
        parts = [p.strip() for p in cell[i + 2:j].split(";")]
        choices = "|" in parts[0]
        if choices and len(parts) < 2:
            raise ValueError(f"option `{name}` lists choices but no default")
        out[name] = doc_value(parts[1] if choices else parts[0])
        i = j + 1
        if cell.startswith(", ", i):
            i += 2
        elif i < len(cell):
            raise ValueError(f"unexpected text after `{name}`: {cell[i:]!r}")
    return out


def docs_table(text: str) -> dict[str, dict[str, Any]]:
    """{policy name: {option: default}} from the table whose header is `| name | keeps (higher score) | options ...`."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("| name | keeps"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    col = header.index("options (default)")
    rows: dict[str, dict[str, Any]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        # A cell's own pipes are escaped (\|): split on the others only.
        cells = [c.strip().replace("\0", "|") for c in line.strip("|").replace("\\|", "\0").split("|")]
        rows[cells[0].strip("`")] = parse_options(cells[col])
    return rows


def mismatches(name: str, yaml_options: dict[str, Any], ctor: dict[str, Any], docs: dict[str, Any] | None,
               own: bool) -> list[str]:
    """What disagrees for the policy YAML `name`: an option the constructor does not take; for the class's own YAML a
    value other than the constructor default; a docs row missing, listing other options or other values."""
    out = []
    for k, v in yaml_options.items():
        if k not in ctor:
            out.append(f"{name}: YAML option {k} is not a constructor parameter")
        elif own and plain(v) != ctor[k]:
            out.append(f"{name}: YAML {k}={v!r}, constructor default {ctor[k]!r}")
    if docs is None:
        return out + [f"{name}: no row in docs/policies.md"]
    if set(docs) != set(yaml_options):
        out.append(f"{name}: docs list {sorted(docs)}, YAML has {sorted(yaml_options)}")
    for k in sorted(set(docs) & set(yaml_options)):
        if docs[k] != plain(yaml_options[k]):
            out.append(f"{name}: docs {k}={docs[k]!r}, YAML {yaml_options[k]!r}")
    return out


def policy_yamls() -> dict[str, dict[str, Any]]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "conf" / "policy").glob("*.yaml"))}


def target_class(target: str) -> type:
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- the repository ------------------------------------------------------------------------------------------------

def test_every_policy_default_agrees_in_yaml_constructor_and_docs() -> None:
    docs = docs_table(DOCS.read_text())
    found = []
    for stem, cfg in policy_yamls().items():
        options = {k: v for k, v in cfg.items() if k != "_target_"}
        cls = target_class(cfg["_target_"])
        found += mismatches(stem, options, constructor_defaults(cls), docs.get(stem), own=cls.name == stem)
    assert found == []
    assert set(docs) == set(policy_yamls())  # no docs row without its YAML


def test_the_repository_has_what_the_check_compares() -> None:
    # Not vacuous: the table is found with every policy, presets included, and options on both sides.
    docs = docs_table(DOCS.read_text())
    assert len(docs) == len(policy_yamls()) >= 14
    assert docs["criticalkv"] == {"base": "snapkv", "alpha": 0.5, "eps": 1e-4, "stage1_window": "outside",
                                  "allocation": "adakv", "alpha_safeguard": 0.2, "head_cap": 2.0, "window": 32,
                                  "kernel": 7, "pooling": "max"}
    from kvbench.policies.criticalkv import CriticalKV
    from kvbench.policies.h2o import H2O

    assert constructor_defaults(CriticalKV)["window"] == 32  # from the composed SnapKV
    assert constructor_defaults(H2O)["recent_ratio"] == 0.0 and policy_yamls()["h2o_original"]["recent_ratio"] == 0.5


# --- the checks on planted cases -----------------------------------------------------------------------------------

class _Base:
    def __init__(self, budget: int | None = None, n_sink: int = 0, skip_layers: tuple = (), seed: int = 0) -> None:
        pass


class _Windowed(_Base):
    def __init__(self, window: int = 32, pooling: str = "avg", **kwargs: Any) -> None:
        super().__init__(**kwargs)


class _Sinky(_Windowed):
    def __init__(self, n_sink: int = 4, pooling: str = "max", **kwargs: Any) -> None:
        super().__init__(n_sink=n_sink, pooling=pooling, **kwargs)


class _Composer(_Base):
    def __init__(self, alpha: float = 0.5, **kwargs: Any) -> None:
        super().__init__()


def test_constructor_defaults_follow_kwargs_up_the_chain() -> None:
    assert constructor_defaults(_Sinky, {}) == {"n_sink": 4, "pooling": "max", "window": 32, "skip_layers": []}
    # A composed base adds its options; without the map they would be missing.
    assert constructor_defaults(_Composer, {_Composer: _Windowed}) == {
        "alpha": 0.5, "n_sink": 0, "skip_layers": [], "window": 32, "pooling": "avg"}
    assert "window" not in constructor_defaults(_Composer, {})


def test_parse_options_by_hand() -> None:
    cell = ("`anchor` (mean \\| median; mean), `eps` (1e-4), `skip` ([0, 1]; never pruned), `k` (null), "
            "`recent` (null; N − sink − g·k − 1, ⌈log2(2g)⌉), `n_recent` (0; the larger of it and `r`·N applies)")
    cell = cell.replace("\\|", "|")  # as docs_table hands a cell over
    assert parse_options(cell) == {"anchor": "mean", "eps": 1e-4, "skip": [0, 1], "k": None, "recent": None,
                                   "n_recent": 0}
    assert parse_options("—") == {}
    for bad in ("as `h2o`, `recent_ratio` (0.5)", "`sink`, `k` (null)", "`pooling` (avg | max)"):
        with pytest.raises(ValueError):
            parse_options(bad)


def test_docs_table_reads_escaped_pipes_and_stops_at_the_table_end() -> None:
    text = ("intro\n\n| name | keeps (higher score) | options (default) | source |\n|---|---|---|---|\n"
            "| `a` | x \\| y | `pooling` (avg \\| max; max) | p |\n| `b` | z | — | q |\n\n| other | table |\n")
    assert docs_table(text) == {"a": {"pooling": "max"}, "b": {}}


def test_planted_mismatches_are_reported() -> None:
    ctor = constructor_defaults(_Sinky, {})
    docs = {"n_sink": 4, "window": 32}
    assert mismatches("sinky", {"n_sink": 4, "window": 32}, ctor, docs, own=True) == []
    # The YAML disagrees with the constructor ...
    assert mismatches("sinky", {"n_sink": 4, "window": 16}, ctor, {"n_sink": 4, "window": 16}, own=True) == [
        "sinky: YAML window=16, constructor default 32"]
    # ... which a preset of the same class may (its values only have to match the docs) ...
    assert mismatches("preset", {"n_sink": 4, "window": 16}, ctor, {"n_sink": 4, "window": 16}, own=False) == []
    # ... the docs disagree with the YAML, or list other options, or have no row ...
    assert mismatches("sinky", {"n_sink": 4, "window": 32}, ctor, {"n_sink": 2, "window": 32}, own=True) == [
        "sinky: docs n_sink=2, YAML 4"]
    assert mismatches("sinky", {"n_sink": 4, "window": 32}, ctor, {"n_sink": 4}, own=True) == [
        "sinky: docs list ['n_sink'], YAML has ['n_sink', 'window']"]
    assert mismatches("sinky", {"n_sink": 4}, ctor, None, own=True) == ["sinky: no row in docs/policies.md"]
    # ... or the YAML sets an option the class does not take.
    assert mismatches("sinky", {"windw": 32}, ctor, {"windw": 32}, own=True) == [
        "sinky: YAML option windw is not a constructor parameter"]
    # Tuples and lists are the same value; 0 and 0.0 too.
    assert mismatches("sinky", {"skip_layers": [], "n_sink": 4.0}, ctor, {"skip_layers": [], "n_sink": 4},
                      own=True) == []
