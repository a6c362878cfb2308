"""HF's own decoding loop, no kvbench, in parts (`HFLoop`): run whole, as `measure.hf_generate` times it, or one step
between each two of a kvbench call's decoding steps (`Lockstep`, kvbench-bench --hf-lockstep).

Why lockstep: the decoding goal compares a policy's time per token with HF's at the same cache size, and on a shared
machine a call's time moves with the stretch it ran in. HF's call measured right after each kvbench call
(--hf-beside) shares that call's stretch only where the stretch outlasts both calls; in lockstep HF's k-th
step runs right after kvbench's k-th, a tenth of a second apart, so the two sides' steps sample the same stretches
and what the machine moves, it moves alike on both sides of each call's ratio. The kvbench call's clock is paused
while HF steps (`Lockstep.clock`), so its times (prefill, decoding, eviction) stay its own.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from kvbench.bench.setup import BenchError
from kvbench.engine.generate import sync


class HFLoop:
    """HF's own greedy loop over `ids`: `prefill` (one forward into a plain `DynamicCache`, logits of the last token
    only, as HF's `generate` asks), then `step` until it returns False (`new_tokens` tokens, `new_tokens - 1`
    one-token forwards). The kvbench attention wrapper passes straight through to HF's sdpa outside a kvbench run.
    Callers hold torch.inference_mode.

    `layer_sizes` (one per layer, each <= len(ids)): after the prompt forward each layer keeps only its latest that
    many tokens, so HF decodes at the per-layer cache sizes a policy held (K-norm's unevicted layers, PyramidKV's
    pyramid). HF's one-token steps need no mask over them (sdpa's causal skip for one query), so each layer attends
    its own length; the positions go on from layer 0's, which only the tokens read."""

    def __init__(self, model: Any, ids: Sequence[int], new_tokens: int,
                 layer_sizes: Sequence[int] | None = None) -> None:
        from transformers import DynamicCache

        self.model, self.ids, self.new_tokens, self.layer_sizes = model, list(ids), new_tokens, layer_sizes
        self.cache = DynamicCache(config=model.config)  # one layer per model layer already: sizes checked up front
        if layer_sizes is not None and (len(layer_sizes) != len(self.cache.layers) or max(layer_sizes) > len(ids)):
            raise BenchError(f"HF's cache has {len(self.cache.layers)} layers of {len(ids)} tokens; cannot keep "
                             f"{len(layer_sizes)} layers of up to {max(layer_sizes)}")
        self.tokens: list[int] = []
        self.steps = 0  # one-token forwards made
        self.logits: torch.Tensor | None = None  # (1, vocab) float32: the next token's

    def prefill(self) -> None:
        out = self.model(input_ids=torch.tensor([self.ids], device=self.model.device), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        for layer, n in zip(self.cache.layers, self.layer_sizes or ()):  # (1, h_kv, T, d) -> (1, h_kv, n, d)
            layer.keys, layer.values = layer.keys[..., -n:, :].contiguous(), layer.values[..., -n:, :].contiguous()
        self.logits = out.logits[:, -1].float()

    def step(self) -> bool:
        """The next greedy token (one host read), then its one-token forward unless it was the last; False when the
        loop is done (no forward made)."""
        tok = int(self.logits.argmax(dim=-1))
        self.tokens.append(tok)
        if len(self.tokens) >= self.new_tokens:
            return False
        out = self.model(input_ids=torch.tensor([[tok]], device=self.model.device), past_key_values=self.cache,
                         use_cache=True)
        self.logits = out.logits[:, -1].float()
        self.steps += 1
        return True

    def held(self) -> tuple[int, int]:
        """(the longest layer's tokens, K + V bytes of every layer) of its cache now."""
        return max(layer.get_seq_length() for layer in self.cache.layers), kv_bytes(self.cache)


def kv_bytes(cache: Any) -> int:
    """Bytes of K and V an HF cache's layers hold now."""
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.keys is not None
               for t in (layer.keys, layer.values))


def hf_layer_sizes(layer_tokens: Sequence[int] | None, budget: int | None) -> list[int] | None:
    """The per-layer cache sizes HF's reference (beside or in lockstep) decodes at for a kvbench call whose layers held
    `layer_tokens` at its first decoding step (the step's token included; HF's reference then holds one fewer, as its
    step appends it): None where every layer held N + 1, the plain reference at cache size N (N prompt tokens)."""
    if not layer_tokens or budget is None or all(n == budget + 1 for n in layer_tokens):
        return None
    return [max(n - 1, 1) for n in layer_tokens]


class Lockstep:
    """HF's own decoding (`HFLoop` over the first tokens of the call's prompt) one step after each of a kvbench
    call's decoding steps: give the call `Observer(clock=lockstep.clock, on_step=lockstep.on_step)`, then call
    `finish()`. At the call's first decoding step HF's prompt forward runs (not timed) at the per-layer sizes the
    call's layers held then (`hf_layer_sizes`: N, or K-norm's and PyramidKV's own), and HF's first step; after each
    later step of the call, HF's next; `finish` makes what is left (the last token's pick; every step where the call
    stopped early). HF's steps are timed by `clock` with a sync on each side, and the call's clock stops meanwhile."""

    def __init__(self, model: Any, ids: Sequence[int], budget: int, new_tokens: int,
                 clock: Callable[[], float]) -> None:
        self.model, self.ids, self.budget, self.new_tokens = model, ids, budget, new_tokens
        self._raw, self._paused = clock, 0.0
        self.loop: HFLoop | None = None
        self.done = False
        self.decode_s = 0.0  # HF's steps' seconds (not its prompt forward)

    def clock(self) -> float:
        """The kvbench call's clock: `clock` less the seconds HF spent in between."""
        return self._raw() - self._paused

    def on_step(self, cache: Any) -> None:
        """Observer.on_step: called with the call's cache before each of its token picks."""
        device = self.model.device
        sync(device)  # the call's queued work is its own (charged to it before the clock stops)
        t0 = self._raw()
        with torch.inference_mode():
            if self.loop is None:
                held = cache.layer_tokens  # the first batch row's (the reference runs beside a run alone)
                if held is None:
                    return  # before the call's first decoding step: its layers' sizes are not known yet
                self._start(held)
            self._step(device)  # waits for the prompt forward before its own timer starts
        self._paused += self._raw() - t0

    def _start(self, layer_tokens: Sequence[int] | None) -> None:
        sizes = hf_layer_sizes(layer_tokens, self.budget)
        n = max(sizes) if sizes else self.budget
        self.loop = HFLoop(self.model, self.ids[:n], self.new_tokens, sizes)
        self.loop.prefill()

    def _step(self, device: torch.device) -> bool:
        """HF's next step, timed; False when it was done already."""
        if self.done:
            return False
        sync(device)
        t0 = self._raw()
        self.done = not self.loop.step()
        sync(device)
        self.decode_s += self._raw() - t0
        return True

    def finish(self) -> dict[str, Any]:
        """HF's steps left after the call, then its numbers: `hf_decode_s`, `hf_decode_steps` (one-token forwards),
        `hf_layer_sizes` (None: N in every layer), `hf_tokens`."""
        with torch.inference_mode():
            if self.loop is None:  # the call made no decoding step
                self._start(None)
            while self._step(self.model.device):
                pass
        return {"hf_decode_s": self.decode_s, "hf_decode_steps": self.loop.steps,
                "hf_layer_sizes": self.loop.layer_sizes, "hf_tokens": self.loop.tokens}
