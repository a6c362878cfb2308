"""Host synchronisations per decoding step, counted on any device (a CPU too).

A host sync is a point where Python needs a tensor's *value* (or a data-dependent size), so on a GPU the host waits
for every queued kernel before it can go on: `.item()`, `int(t)` / `float(t)` / `bool(t)` / `t.__index__()`,
`.tolist()`, `nonzero` and the ops built on it (boolean-mask indexing `x[mask]`, `x[mask] = tensor`, one-argument
`torch.where`, `masked_select`, `unique`, `repeat_interleave` with tensor repeats), `torch.equal`, and a copy to the
host. On a CPU nothing waits, but the same calls are made, so counting the calls measures what a GPU would pay.

Mechanism: a `TorchDispatchMode` sees every aten op of the call (library code included: HF's masks, the model) and
counts the ops above; `Tensor.tolist` reads the data without an aten op, so it is wrapped for the duration.
Not counted: `x[mask] = scalar` (ATen runs a single boolean mask with one host value as masked_fill), and the
`torch.cuda.synchronize` calls `engine.generate` makes around its timers on CUDA (deliberate, not data-dependent:
`timer_syncs` counts them separately). Each event is attributed to the innermost Python frame outside torch
(file:line), so a report can say which line of kvbench or transformers asks for the value.

`count_host_syncs` runs one `generate` call under the counter and splits the events by decoding step: step k runs
from the k-th next-token logits (Observer.on_logits) to the (k+1)-th, so it holds the k-th token's argmax, its
forward and the eviction after it; the prompt (everything before the first logits) is left out, as is the last
token's argmax (no forward follows it). A loop that only reads the token does exactly 1 per step.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)

# aten overload packets whose kernels need a value on the host (or a data-dependent output size).
_ALWAYS = {"item", "_local_scalar_dense", "is_nonzero", "nonzero", "argwhere", "masked_select", "equal", "allclose",
           "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount"}


def _bool_index(indices: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in (indices or ()))


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in _ALWAYS:
        return True
    if name == "where":  # one argument: nonzero
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":  # tensor repeats: the output size is their sum, unless output_size is given
        repeats = args[1] if len(args) > 1 else (args[0] if func._overloadname == "Tensor" else kwargs.get("repeats"))
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "index":  # x[mask]: the result's size is the mask's count
        return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name in ("index_put", "index_put_", "_index_put_impl_"):  # x[mask] = values
        value = args[2] if len(args) > 2 else kwargs.get("values")
        # ATen runs one mask with a single host value as masked_fill (no count needed)
        masked_fill = isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"
        return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")) and not masked_fill
    if name in ("_to_copy", "to", "copy_"):  # device -> host copy (never fires on a CPU-only run)
        if name == "copy_":
            src, to_cpu = args[1], args[0].device.type == "cpu"
        else:
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            src, to_cpu = args[0], isinstance(device, (torch.device, str)) and torch.device(device).type == "cpu"
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and to_cpu
    return False


def _site() -> str:
    """file:line of the innermost Python frame outside torch and this module (who asked for the value)."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _THIS:
            parts = path.split(os.sep)
            # A short, machine-independent name: from the innermost `kvbench` or `transformers` directory on.
            roots = [i for i, p in enumerate(parts[:-1]) if p in ("kvbench", "transformers")]
            return f"{'/'.join(parts[roots[-1]:]) if roots else path}:{f.f_lineno}"
        f = f.f_back
    return "?"


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            name = func.overloadpacket.__name__
            # One name for a scalar read (item, int, float, bool): which aten op it arrives as depends on the mode.
            self.counter.record("item" if name in ("_local_scalar_dense", "is_nonzero") else name)
        return func(*args, **kwargs)


class SyncCounter:
    """Context manager counting host syncs; `events` holds (step, op, site) in call order, `step` is set by the
    caller (count_host_syncs advances it at every decoding step)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, str]] = []
        self.step = 0
        self.muted = 0  # > 0 inside a counted tolist: the ops it runs are that one sync
        self._saved: Any = None
        self._mode: _Mode | None = None

    def record(self, op: str) -> None:
        if self.muted:
            return
        self.events.append((self.step, op, _site()))

    @property
    def total(self) -> int:
        return len(self.events)

    def __enter__(self) -> SyncCounter:
        counter, original = self, torch.Tensor.tolist

        def tolist(t: torch.Tensor) -> Any:  # on a CPU it reads the data directly: no aten op to see
            counter.record("tolist")
            # On a GPU tolist copies to the host through an aten op, which the mode would count a second time
            # (results/bench_gpu/RUN.md: every step read 2 where one tolist ran); the read is this one sync.
            counter.muted += 1
            try:
                return original(t)
            finally:
                counter.muted -= 1

        self._saved = original
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._mode.__exit__(*exc)  # type: ignore[union-attr]
        finally:
            torch.Tensor.tolist = self._saved  # type: ignore[method-assign]


@dataclass
class SyncCount:
    """Host syncs of one generate call, by decoding step (see the module doc)."""

    per_step: list[int]  # syncs of each complete decoding step (argmax + forward + eviction)
    prefill: int  # syncs while the prompt was processed (not in per_step)
    by_site: dict[str, int] = field(default_factory=dict)  # file:line -> syncs in the complete decoding steps
    timer_syncs: int = 0  # engine.generate's CUDA timer synchronisations in the complete steps (0 work on a CPU)

    @property
    def mean(self) -> float | None:
        return sum(self.per_step) / len(self.per_step) if self.per_step else None


def count_host_syncs(model: Any, policy: Any, ids: Sequence[int], block: int | None, new_tokens: int,
                     protocol: str = "blockwise") -> SyncCount:
    """Run `generate` once (greedy, no stop tokens) and count the host syncs of each decoding step."""
    from kvbench.engine import generate as engine_generate

    counter = SyncCounter()
    timers: list[int] = []
    real_sync = engine_generate.sync

    def on_logits(_: torch.Tensor) -> None:
        counter.step += 1

    def timed_sync(device: torch.device) -> None:
        timers.append(counter.step)
        real_sync(device)

    engine_generate.sync = timed_sync  # the engine's timer syncs: counted apart, never a dispatch op
    try:
        with counter:
            settings = engine_generate.GenerationSettings(block=block, max_new_tokens=new_tokens, protocol=protocol)
            res = engine_generate.generate(model, policy, list(ids), settings,
                                           observer=engine_generate.Observer(on_logits=on_logits))
    finally:
        engine_generate.sync = real_sync
    steps = res.decode_steps  # complete steps: 1..steps (step steps+1 only reads the last token)
    per = Counter(s for s, _, _ in counter.events)
    return SyncCount(per_step=[per.get(k, 0) for k in range(1, steps + 1)], prefill=per.get(0, 0),
                     by_site=dict(Counter(site for s, _, site in counter.events if 1 <= s <= steps).most_common()),
                     timer_syncs=sum(1 for s in timers if 1 <= s <= steps))
