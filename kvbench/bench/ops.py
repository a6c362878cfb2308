"""`kvbench-bench --ops`: aten operations per forward, the CPU proxy for a GPU's kernel launches; and what a reader
follows through one decoding step.

On a GPU every aten operation that does work is a kernel launch, and a small model's block or decoding step is bound
by launches, not arithmetic. Per policy: the operations one prompt block and one decoding step run through kvbench
(the forward and its eviction), against HF's own forward of the same block and step over a DynamicCache holding as
many tokens. Counted eagerly under a TorchDispatchMode (every aten call, views included), after the cache is over
budget, so the eviction is the steady one. Beside them, the distinct kvbench functions (and their files) the decoding
step calls, the forward and its eviction (`sys.setprofile`; comprehensions count as functions, as a reader steps into
them too): how much code one step asks a reader to follow.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.engine.generate import Batch, GenerationSettings, Job


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it (by name, in `ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class FunctionCounter:
    """The distinct kvbench functions, (file relative to the package, name), called inside it."""

    root = str(Path(__file__).resolve().parents[1])  # the kvbench package

    def __enter__(self) -> FunctionCounter:
        self.functions: set[tuple[str, str]] = set()
        sys.setprofile(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _call(self, frame: FrameType, event: str, arg: object) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(self.root) and path != __file__:  # not the counter's own exit
            self.functions.add((str(Path(path).relative_to(self.root)), frame.f_code.co_name))

    @property
    def files(self) -> list[str]:
        return sorted({f for f, _ in self.functions})


def _hf_ops(model: Any, ids: list[int], block: int) -> tuple[int, int]:
    """(ops of HF's forward of the last block, ops of its decoding step) over a DynamicCache of the tokens before."""
    from transformers import DynamicCache

    counts = []
    for t in (block, 1):
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:-t]], device=model.device), past_key_values=cache, use_cache=True)
        with OpCounter() as c:
            model(input_ids=torch.tensor([ids[-t:]], device=model.device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        counts.append(c.total)
    return counts[0], counts[1]


@torch.inference_mode()
def count_ops(model: Any, make_policy: Callable[[str], Any], names: Sequence[str], budget: int, block: int,
              length: int, ids: list[int]) -> list[dict[str, Any]]:
    """One row per policy: the aten ops of a prompt block and of a decoding step (the eviction included) and their
    ratios to HF's own; `length` prompt tokens (at least budget + 2 blocks, so the cache is over budget)."""
    hf_block, hf_step = _hf_ops(model, ids[:length], block)
    rows = []
    for name in names:
        batch = Batch(model, [Job(ids[:length], make_policy(name), GenerationSettings(block=block,
                                                                                      max_new_tokens=2))])
        spans = [(s, min(length, s + block)) for s in range(0, length, block)]
        for s, e in spans[:-1]:
            batch.step([(s, e)], [ids[s:e]], [True], "prefill")
        s, e = spans[-1]
        with OpCounter() as blk:
            batch.step([(s, e)], [ids[s:e]], [True], "prefill")
        batch.cache.view.decoding = True
        with OpCounter() as step:
            batch.step([(length, length + 1)], [[ids[0]]], [True], "decode")
        with FunctionCounter() as read:
            batch.step([(length + 1, length + 2)], [[ids[1]]], [True], "decode")
        rows.append({"policy": name, "block_ops": blk.total, "step_ops": step.total, "hf_block_ops": hf_block,
                     "hf_step_ops": hf_step, "block_ratio": round(blk.total / hf_block, 3),
                     "step_ratio": round(step.total / hf_step, 3), "step_functions": len(read.functions),
                     "step_files": read.files})
    return rows


def ops_markdown(rows: list[dict[str, Any]], what: str) -> str:
    head = ("| policy | block ops | x HF's block | step ops | x HF's step | step's kvbench functions | files |\n"
            "|---|---|---|---|---|---|---|")
    lines = [f"aten ops per forward (eviction included), {what}; HF's own: block {rows[0]['hf_block_ops']}, step "
             f"{rows[0]['hf_step_ops']}.", "", head] if rows else []
    lines += [f"| {r['policy']} | {r['block_ops']} | {r['block_ratio']:.2f} | {r['step_ops']} | "
              f"{r['step_ratio']:.2f} | {r['step_functions']} | {len(r['step_files'])} |" for r in rows]
    return "\n".join(lines) + "\n"
