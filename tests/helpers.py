"""Helpers the tests call as functions (`from helpers import make_view`; pyproject.toml puts tests/ on the path):
the tiny model with kvbench's attention installed, hand-built slot views and their selection, and run configs
composed from the real conf/config.yaml. Fixtures live in conftest.py, which pytest finds by itself.
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

import torch

from kvbench.engine.cache import install, select
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.base import SlotView


def installed_model(arch: str = "tiny-llama", **kw: Any) -> tuple[Any, Any]:
    """A tiny random model (and its tokenizer) with kvbench's attention wrapper installed; `kw` go to
    `build_tiny_model` (seed, dtype, output_scale, config overrides such as num_hidden_layers)."""
    model, tok = build_tiny_model(arch, **kw)
    install(model)
    return model, tok


def float64_model(layers: int) -> Any:
    """tiny-llama with `layers` layers (output scale 1), kvbench's attention installed, in float64: the model the
    batch tests decode with, where a product over more rows cannot swap a step."""
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0, num_hidden_layers=layers)
    install(model)
    return model.double()


def random_prompt(n: int, seed: int) -> list[int]:
    """n token ids drawn from 8..499 with a seeded generator."""
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def held_positions(trace: list[list[torch.Tensor | None]]) -> list[list[list[list[int]] | None]]:
    """A trace (Observer(trace=True)): per forward, layer and KV head, the positions held, sorted (free slots left
    out), whatever slots they sit in."""
    return [[None if t is None else [sorted(p for p in row if p >= 0) for row in t[0].tolist()] for t in step]
            for step in trace]


def held_counts(step: list[torch.Tensor | None]) -> list[int]:
    """One traced step (Observer(trace=True)): per layer, the most tokens any KV head holds (free slots left out):
    the bound a budget sets."""
    return [0 if pos is None else int((pos >= 0).sum(dim=-1).max()) for pos in step]


def make_view(keys: list, queries: list | None = None, values: list | None = None, layer_idx: int = 0,
              scaling: float = 1.0, positions: list | None = None) -> SlotView:
    """One layer's slots holding `keys` (h_kv, n, d) at positions 0..n-1 (or `positions`, (h_kv, n), -1 free), values
    zero unless given, and optionally `queries` (h_q, w, d) as the latest w queries (positions seen - w .. seen - 1):
    a view with L = b = 1, as the engine hands a policy."""
    k = torch.tensor(keys, dtype=torch.float32)[None, None]  # (1, 1, h_kv, n, d)
    v = torch.zeros_like(k) if values is None else torch.tensor(values, dtype=torch.float32)[None, None]
    h_kv, n = k.shape[2], k.shape[3]
    pos = (torch.arange(n).expand(1, 1, h_kv, n) if positions is None
           else torch.tensor(positions)[None, None]).clone()  # (1, 1, h_kv, n)
    seen = torch.tensor([int(pos.max()) + 1])
    view = SlotView(keys=k, values=v, pos=pos, seen=seen, fed=seen.clone(), layers=(layer_idx,), scaling=scaling)
    if queries is not None:
        q = torch.tensor(queries, dtype=torch.float32)[None, None]  # (1, 1, h_q, w, d)
        view.queries, view.qpos = q, torch.arange(int(seen) - q.shape[3], int(seen))[None]
    return view


def settle(policy: Any, view: SlotView) -> SlotView:
    """`view` with the per-token state the engine would keep (`Policy.token_state` of every slot), where the test
    gave none."""
    if all(name in view.state for name in policy.state_names):
        return view
    slots = torch.arange(view.pos.shape[-1]).expand(view.pos.shape)
    for name, value in policy.token_state(view, slots).items():
        view.state.setdefault(name, value.float())
    return view


def kept(policy: Any, view: SlotView, budget: int | None = None) -> list[list[int]]:
    """Per KV head, the positions the engine's selection keeps of `view` (L = b = 1) at `budget` (default: the
    policy's layer budget), sorted."""
    n = budget if budget is not None else policy.layer_budget(view.layers[0], int(view.seen))
    settle(policy, view)
    drop = select(policy, view, torch.tensor([[[n]]]))[0, 0]  # (h_kv, S)
    return [sorted(int(p) for p, d in zip(view.pos[0, 0, h].tolist(), drop[h].tolist()) if p >= 0 and not d)
            for h in range(view.pos.shape[2])]


def run_config(*overrides: str, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A resolved run config exactly as `kvbench <overrides>` hands it to the run: conf/config.yaml composed by Hydra
    with the command-line `overrides` ("model=tiny-llama", "policy=keydiff", "task.max_new_tokens=4", ...), as a plain
    dict. Then `values` are set as given, by dotted key ({"task.path": str(path)}, {"model": {"name": "m"}}): what is
    awkward on a command line (temporary paths, whole hand-made sections, keys the YAML does not have). So no test
    repeats config.yaml's keys by hand, and a key added there reaches every test's config."""
    cfg = copy.deepcopy(_composed(tuple(overrides)))  # a fresh copy: tests change their configs
    for key, value in (values or {}).items():
        *parents, last = key.split(".")
        node = cfg
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = value
    return cfg


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict[str, Any]:
    # Composing takes Hydra a noticeable fraction of a second; report tests write many run configs.
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvbench.run.config import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)), resolve=True)
    assert isinstance(cfg, dict)
    return cfg


def kvbench_main(*args: str) -> subprocess.CompletedProcess:
    """`kvbench ARGS` run in this process: kvbench.cli.main with ARGS as its argv, as the installed command runs it
    from there on; its exit code and printed output as subprocess.run(capture_output=True, text=True) returns them.
    A subprocess pays the imports (~4-8 s) at every call, so most tests of the command call this; tests/test_cli.py
    still runs the real command once, so that nothing its imports print goes unseen."""
    import contextlib

    from kvbench import cli

    out, err, code, argv, threads = io.StringIO(), io.StringIO(), 0, sys.argv, torch.get_num_threads()
    sys.argv = ["kvbench", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            cli.main()
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)  # a run may set the thread count of the process it runs in
    return subprocess.CompletedProcess(["kvbench", *args], code, out.getvalue(), err.getvalue())


def load_script(name: str) -> ModuleType:
    """A module of scripts/ (scripts are run as files, not imported as a package), loaded from its path."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


# Wheels and a tokenizer for tasks that read source files out of pinned wheels (task=code, task=lm source=code).

class CharTokenizer:
    """One token per character (id = code point), BOS id 1 added by default, offsets per character: a fast
    tokenizer's interface as the task uses it."""

    is_fast = True

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 truncation: bool = False) -> dict[str, list]:
        ids, offsets = [ord(c) for c in text], [(i, i + 1) for i in range(len(text))]
        if add_special_tokens:
            ids, offsets = [1, *ids], [(0, 0), *offsets]
        return {"input_ids": ids, **({"offset_mapping": offsets} if return_offsets_mapping else {})}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 1))


def b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, files: dict[str, str], name: str = "fakepkg", version: str = "1.0",
               bad_record: str | None = None) -> tuple[Path, str]:
    """A wheel as pip would download it, and its sha256; `bad_record` names a file whose RECORD hash is wrong."""
    record = [f"{path},sha256={b64_sha256(b'tampered' if path == bad_record else text.encode())},{len(text)}"
              for path, text in files.items()]
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{name}-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    path.write_bytes(buf.getvalue())
    return path, hashlib.sha256(buf.getvalue()).hexdigest()


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def word_samples(path: Path, n: int, text: Callable[[int], str], **fields: Any) -> Path:
    """A jsonl task file of n samples for task=jsonl: id "s<i>", prompt "<text(i)> question <i>?", answer WORDS[i]
    (and `fields` in every row, e.g. max_new_tokens); `text(i)` builds sample i's words from WORDS."""
    with path.open("w") as f:
        for i in range(n):
            row = {"id": f"s{i}", "prompt": f"{text(i)} question {i}?", "answers": [WORDS[i]], **fields}
            f.write(json.dumps(row) + "\n")
    return path
