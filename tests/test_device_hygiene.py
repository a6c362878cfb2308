"""Device hygiene of the engine and the policies, read from the source: every tensor they create takes its device
from an input tensor (`device=x.device`), so a run on a GPU never builds a tensor on the CPU by default (a wrong
device error, or a silent host-to-device copy at every step).

The scan parses kvbench/engine/*.py and kvbench/policies/*.py with `ast` and flags every call of a torch factory
(`torch.zeros(...)`, `torch.arange(...)`, ...) without a `device=` keyword, or with a constant one (`device="cpu"`,
`device=None`). `*_like` factories and `Tensor.new_*` methods inherit the device of their tensor and are not
factories here. EXEMPT lists the deliberate CPU tensors, each with its reason; an exemption that no longer matches
a call fails too, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvbench

ROOT = Path(kvbench.__file__).parent
SCANNED = ("engine", "policies")
FACTORIES = frozenset({"arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "logspace",
                       "ones", "rand", "randint", "randn", "randperm", "scalar_tensor", "tensor", "tril_indices",
                       "triu_indices", "zeros"})

# (file under kvbench/, enclosing function, factory) -> why a CPU tensor is right there.
EXEMPT = {
    ("policies/random.py", "Random.score", "rand"):
        "drawn from the policy's seeded CPU torch.Generator (one stream per sample, the same draws on every device), "
        "then moved with .to(view.pos.device)",
    # A forward's token ids and positions (K rows, left-padded with PAD) are assembled on the host from host lists
    # (the prompt, and the greedy tokens the loop has already read back: its one read per step), then moved with one
    # `.to(self.device)` each: two small host-to-device copies per forward, queued (no sync), never a device tensor
    # built on the CPU by mistake. The per-row zeros/full frames and each row's tensor/arange pieces:
    ("engine/generate.py", "Batch.step", "zeros"): "the forward's ids (K, t), built on the host, moved once",
    ("engine/generate.py", "Batch.step", "full"): "the forward's positions (K, t), PAD-filled on the host, moved once",
    ("engine/generate.py", "Batch.step", "tensor"): "a row's token ids (host ints) written into the host frame",
    ("engine/generate.py", "Batch.step", "arange"): "a row's positions (host ints) written into the host frame",
    ("policies/hashevict.py", "HashEvict.projection", "randn"):
        "the SimHash projection R is drawn once per layer from a seeded CPU torch.Generator (the same R on every "
        "device), then moved to the keys' device once and kept there",
}


def offenders(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, factory) of every torch factory call in `source` without a device taken from a
    tensor: no `device=` keyword, or a constant one. Knows `import torch [as t]` and `from torch import zeros [as z]`.
    """
    tree = ast.parse(source)
    modules = {"torch"}
    names: dict[str, str] = {}  # local name -> factory imported from torch
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name: a.name for a in node.names if a.name in FACTORIES}
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, ast.Call):
            f = node.func
            factory = None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                factory = f.attr if f.attr in FACTORIES else None
            elif isinstance(f, ast.Name):
                factory = names.get(f.id)
            if factory is not None:
                device = next((k.value for k in node.keywords if k.arg == "device"), None)
                if device is None or isinstance(device, ast.Constant):
                    found.append((node.lineno, ".".join(scope) or "<module>", factory))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def test_engine_and_policies_create_tensors_on_their_inputs_device() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).glob("*.py"))
    assert {p.parent.name for p in files} == set(SCANNED) and len(files) >= 15  # the scan really read both
    bad, used = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, scope, factory in offenders(path.read_text(encoding="utf-8")):
            if (rel, scope, factory) in EXEMPT:
                used.add((rel, scope, factory))
            else:
                bad.append(f"kvbench/{rel}:{line} {scope}: torch.{factory}(...) without device= from a tensor")
    assert bad == []
    assert set(EXEMPT) == used, f"stale exemptions: {set(EXEMPT) - used}"


def test_the_scan_flags_a_bad_snippet() -> None:
    """The scanner itself: what it must flag and what it must let through."""
    snippet = '''
import torch
import torch as th
from torch import empty, ones as one

def fine(x):
    a = torch.zeros(3, device=x.device)
    b = torch.zeros_like(x)
    c = x.new_zeros(2)
    d = th.arange(4, device=x.device)
    return torch.cat([a, b, c, d])

class Bad:
    def method(self, x):
        a = torch.zeros(3)
        b = th.arange(4, device="cpu")
        c = torch.tensor([1, 2], dtype=torch.long, device=None)
        return empty(2), one(3), a, b, c

def also_bad():
    return torch.full((2,), 1.0, dtype=torch.float32)
'''
    assert offenders(snippet) == [(15, "Bad.method", "zeros"), (16, "Bad.method", "arange"),
                                  (17, "Bad.method", "tensor"), (18, "Bad.method", "empty"),
                                  (18, "Bad.method", "ones"), (21, "also_bad", "full")]
