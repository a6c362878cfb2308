"""The layer order of the package (docs/extending.md, "The layers"): a module imports only from lower layers or its
own package, no import cycle anywhere, Hydra only in the CLI and the config module.

kvbench's Hydra launchers (hydra_plugins/kvbench_*) count as a package of the top layer beside the CLI: they call the
run layer (kvbench.run.jobs) and the report's table, and the CLI does not import them (Hydra finds them as plugins),
so no cycle runs through them.

Every import counts: lazy imports inside functions and imports under `if TYPE_CHECKING:` (type hints) alike, so a
type hint cannot hide a tie to a higher layer. Policies see the cache's evicting layers through the `SlotView` of their
own layer (kvbench/policies/base.py), which the engine's `SlotCache.view` fills; the last tests check both sides.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvbench"
PLUGINS = sorted(ROOT.glob("hydra_plugins/kvbench_*"))

# Lowest first. Packages of one layer do not import each other.
LAYERS = [
    ("errors", "options"),  # the one-line report of an exception; the run options' tables (torch-free)
    ("metrics", "models"),  # official metrics; model loading and builders
    ("tasks",),  # prompts, answers and scoring rules (use metrics; the probe task uses the probe model)
    ("policies",),  # scores and selection over a cache layer
    ("engine",),  # cache, attention wrapper, generation loop: drives the policies
    ("run",),  # settings, config, run assembly and directories, the jobs, the per-task loop, kvbench-score
    ("report", "bench"),  # kvbench-report, kvbench-bench
    ("cli", "hydra_plugins"),  # kvbench; kvbench's Hydra launchers
]
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}
# Hydra stays at the top: the entry point, the config side, the settings (whose `instantiate` is Hydra's) and the
# jobs (Hydra's task function).
HYDRA_ALLOWED = {"kvbench.cli", "kvbench.run.config", "kvbench.run.settings", "kvbench.run.jobs"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    """kvbench's modules and its launchers' (hydra_plugins.kvbench_*), by dotted name."""
    paths = [*PKG.rglob("*.py"), *(p for d in PLUGINS for p in d.rglob("*.py"))]
    return {module_name(p): p for p in sorted(paths)}


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """kvbench modules (and third-party top-level names) that `path` imports anywhere: top level, inside functions,
    under `if TYPE_CHECKING:`."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from kvbench.models import packaged` imports the module kvbench.models.packaged
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def layer_of(module: str) -> tuple[int, str] | None:
    parts = module.split(".")
    if parts[0] == "hydra_plugins" and parts[1:2] and parts[1].startswith("kvbench_"):
        return LAYER["hydra_plugins"], "hydra_plugins"
    if parts[0] != "kvbench" or len(parts) == 1:
        return None  # kvbench itself (its __version__) sits below everything; third-party packages
    return LAYER[parts[1]], parts[1]


def test_every_package_has_a_layer() -> None:
    tops = {m.split(".")[1] for m in all_modules() if m.startswith("kvbench.")}
    assert tops | {"hydra_plugins"} == set(LAYER), "add new packages to LAYERS (and docs/extending.md)"
    assert {m for m in all_modules() if m.startswith("hydra_plugins.")} >= {
        "hydra_plugins.kvbench_launcher.launcher", "hydra_plugins.kvbench_slurm_launcher._launcher"}


def test_imports_go_down_the_layers() -> None:
    modules = all_modules()
    bad = []
    for name, path in modules.items():
        here = layer_of(name)
        for imp in imports(path, modules):
            there = layer_of(imp)
            if here is None or there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:
                bad.append(f"{name} ({LAYERS[here[0]]}) imports {imp} ({LAYERS[there[0]]})")
    assert not bad, "\n".join(bad)


def find_cycles(graph: dict[str, list[str]]) -> list[str]:
    """Every cycle a depth-first walk of `graph` (module -> the modules it imports) closes, as `a -> b -> a`."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def dfs(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph.get(m, []):
            if state.get(n) == 1:
                cycles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                dfs(n, path + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            dfs(m, [m])
    return cycles


def import_graph() -> dict[str, list[str]]:
    modules = all_modules()
    return {m: sorted(i for i in imports(p, modules) if i in modules and i != m) for m, p in modules.items()}


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "\n".join(cycles)


def test_the_launchers_call_the_run_layer_and_the_cli_does_not_import_them() -> None:
    graph = import_graph()
    assert "kvbench.run.jobs" in graph["hydra_plugins.kvbench_launcher.launcher"]
    assert "hydra_plugins.kvbench_launcher.launcher" in graph["hydra_plugins.kvbench_slurm_launcher._launcher"]
    assert not [m for m in graph["kvbench.cli"] if m.startswith("hydra_plugins")]


def test_the_cycle_finder_sees_a_cycle_through_the_launchers() -> None:
    # The graph kvbench had: the CLI registered the launchers, which imported the CLI's job functions back.
    graph = {"kvbench.cli": ["hydra_plugins.kvbench_launcher.launcher", "kvbench.run.app"],
             "hydra_plugins.kvbench_launcher.launcher": ["kvbench.cli"],
             "hydra_plugins.kvbench_slurm_launcher._launcher": ["hydra_plugins.kvbench_launcher.launcher"],
             "kvbench.run.app": []}
    assert find_cycles(graph) == ["kvbench.cli -> hydra_plugins.kvbench_launcher.launcher -> kvbench.cli"]
    assert layer_of("hydra_plugins.kvbench_launcher.launcher") == layer_of("kvbench.cli")[:1] + ("hydra_plugins",)
    assert layer_of("hydra_plugins.hydra_submitit_launcher.config") is None  # (third-party: no layer)


def test_hydra_only_in_the_cli_and_config() -> None:
    modules = {m: p for m, p in all_modules().items() if m.startswith("kvbench")}
    users = {m for m, p in modules.items() if any(i.split(".")[0] == "hydra" for i in imports(p, modules))}
    assert users <= HYDRA_ALLOWED, sorted(users - HYDRA_ALLOWED)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    # The checks above would pass vacuously if `imports` found nothing: show that it finds a lazy upward import and
    # one that only a type hint needs.
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvbench.engine.cache import X\n"
                   "def f():\n    from kvbench.run.app import run_one\n    from kvbench.models import packaged\n")
    found = imports(src, all_modules())
    assert found == {"typing", "kvbench.engine.cache", "kvbench.run.app", "kvbench.models.packaged"}


def view_members() -> set[str]:
    """What `SlotView` names: its fields, its methods and properties."""
    import dataclasses

    from kvbench.policies.base import SlotView

    methods = {k for k, v in vars(SlotView).items()
               if (callable(v) or isinstance(v, property)) and not k.startswith("_")}
    return {f.name for f in dataclasses.fields(SlotView)} | methods


def view_uses(path: Path, param: str = "SlotView") -> set[str]:
    """Attributes read or written, in `path`, on a function parameter annotated `param` (`self` for "self")."""
    used: set[str] = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        names = {a.arg for a in args if (a.annotation is not None and ast.unparse(a.annotation) == param)
                 or (param == "self" and a.arg == "self")}
        used |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id in names}
    return used


def test_policies_use_only_what_slot_view_names() -> None:
    # The interface is the whole contract: a policy that reaches for more of the cache fails here (add it to SlotView
    # on purpose). A member nobody uses any more fails too: each is read by a policy, by the engine (which builds
    # and evicts through the view, and measures diagnostics on it) or by SlotView's own methods (the model's scale
    # and softcap, which `attention` applies).
    paths = sorted((PKG / "policies").glob("*.py"))
    used = set().union(*(view_uses(p) for p in paths))
    members = view_members()
    assert used and used <= members, sorted(used - members)
    engine = set().union(*(view_uses(p) for p in sorted((PKG / "engine").glob("*.py"))))
    own = view_uses(PKG / "policies" / "base.py", "self")
    assert members <= used | engine | own, sorted(members - used - engine - own)
    # Every view a policy takes is typed as the interface: no policy names the engine's cache class.
    assert "SlotCache" not in "".join(p.read_text() for p in paths)


def test_the_use_checker_sees_an_attribute(tmp_path: Path) -> None:
    src = tmp_path / "p.py"
    src.write_text("def score(self, view: SlotView, other: int):\n    view.state['x'] = view.keys.sum()\n"
                   "    return other.real\n")
    assert view_uses(src) == {"state", "keys"}


def test_the_engine_fills_every_field_of_the_view() -> None:
    """SlotCache.make_view passes every SlotView field but `budgets` (the eviction's counts, which `select` sets on
    the view it is given) and `decoding` (set once the prompt is done); a field added to SlotView that the engine does
    not fill fails here. The cache's `view` is a SlotView over its own evicting buffers (tiny-llama: 2 layers, 2 KV
    heads)."""
    import dataclasses

    from kvbench.engine.cache import SlotCache, install
    from kvbench.models.tiny import build_tiny_model
    from kvbench.policies.keydiff import KeyDiff
    from kvbench.policies.base import SlotView

    fields = {f.name for f in dataclasses.fields(SlotView)}
    calls = [n for n in ast.walk(ast.parse((PKG / "engine" / "cache.py").read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "SlotView"]
    assert len(calls) == 1 and not calls[0].args
    assert {k.arg for k in calls[0].keywords} == fields - {"budgets", "decoding"}

    model, _ = build_tiny_model("tiny-llama")
    install(model)
    cache = SlotCache(model, KeyDiff(budget=16), batch=1, capacity=24, full_capacity=64)
    view = cache.view
    assert isinstance(view, SlotView) and view.layers == (0, 1) and view.budgets is None
    assert view.pos is cache.evicting.pos and view.keys is cache.evicting.keys
    assert tuple(view.pos.shape) == (2, 1, 2, 24)
