"""Slot reuse while decoding (kvbench/engine/slots.py): the hole mechanics by hand, ties by position, the same kept
tokens as the chronological storage for every policy (float64), the float64 reference, and the K/V bytes a decoding
step copies (counted)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.engine import attention
from kvbench.engine.cache import EvictingLayer
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate, generate_batch
from kvbench.engine.ragged import FlatHeads
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import rank_mask, top_slots
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.h2o import H2O
from kvbench.policies.hashevict import HashEvict
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.random import Random
from kvbench.policies.sagekv import SageKV
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA
from kvbench.run.settings import ConfigError, RunSettings

from float64_reference import reference_logits
from helpers import float64_model, held_positions, random_prompt


def _layer(positions: list[int]) -> EvictingLayer:
    """A decoding layer (b = 1, h_kv = 1, d = 2) holding tokens whose keys are (p, -p) at the given positions (in
    slot order), with slot reuse on."""
    layer = EvictingLayer(0)
    pos = torch.tensor(positions, dtype=torch.float32)
    keys = torch.stack([pos, -pos], dim=-1).view(1, 1, -1, 2)
    layer.update(keys, keys.clone())
    layer.positions = torch.tensor(positions).view(1, 1, -1)
    layer.seen = max(positions) + 1
    layer.reuse_slots, layer.decoding = True, True
    return layer


def _token(p: int) -> torch.Tensor:
    return torch.tensor([float(p), -float(p)]).view(1, 1, 1, 2)


def test_a_hole_is_left_and_filled_in_place() -> None:
    layer = _layer([0, 1, 2, 3])
    keys = layer.keys
    layer.keep(torch.tensor([[[0, 1, 3]]]))  # drops slot 2 (position 2)
    assert layer.keys is keys and layer.keys.shape[-2] == 4  # nothing moved
    assert layer.positions.tolist() == [[[0, 1, -1, 3]]] and layer.physical() == 3
    assert layer.hole.tolist() == [[[2]]]
    new_k, new_v = _token(4), _token(4)
    layer.update(new_k, new_v)  # the next token goes into the hole
    assert layer.keys is keys
    assert layer.positions.tolist() == [[[0, 1, 4, 3]]] and not layer.chronological
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 1.0, 4.0, 3.0] and layer.values[0, 0, 2].tolist() == [4.0, -4.0]
    k, v = layer.block_kv(1)  # the new token's K/V for its state: the very tensors written, not a copy read back
    assert k is new_k and v is new_v
    layer.set_block_state("acc", torch.tensor([[[7.0]]]))
    assert layer.state["acc"].tolist() == [[[0.0, 0.0, 7.0, 0.0]]]
    # dropping two tokens (slots 0 and 3) is no hole: the kept slots are gathered in position order
    layer.keep(torch.tensor([[[1, 2]]]))
    assert layer.hole is None and layer.chronological
    assert layer.positions.tolist() == [[[1, 4]]] and layer.keys[0, 0, :, 0].tolist() == [1.0, 4.0]
    assert layer.state["acc"].tolist() == [[[0.0, 7.0]]]


def test_a_block_of_several_tokens_closes_the_hole_first() -> None:
    layer = _layer([0, 1, 2, 3])
    layer.keep(torch.tensor([[[0, 1, 3]]]))  # a hole at slot 2
    block = torch.cat([_token(4), _token(5)], dim=2)  # (1, 1, 2, 2): no single hole fits it
    layer.update(block, block.clone())
    assert layer.hole is None and layer.chronological
    assert layer.positions.tolist() == [[[0, 1, 3, 4, 5]]]
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 1.0, 3.0, 4.0, 5.0]


def test_a_general_selection_of_scrambled_slots_is_stored_in_position_order() -> None:
    layer = _layer([5, 2, 9, 7])  # slots out of order (as after slot reuse)
    layer.chronological = False
    layer.keep(torch.tensor([[[0, 1, 3]]]), torch.tensor([[[True, True, True]]]))  # a selection with a validity mask
    assert layer.positions.tolist() == [[[2, 5, 7]]] and layer.keys[0, 0, :, 0].tolist() == [2.0, 5.0, 7.0]
    layer = _layer([5, 2, 9, 7, 8])
    layer.chronological = False
    layer.keep(torch.tensor([[[0, 2, 3]]]))  # drops two: a gather, by position
    assert layer.positions.tolist() == [[[5, 7, 9]]] and layer.chronological


def test_a_fork_with_a_hole_writes_its_own_tensors() -> None:
    layer = _layer([0, 1, 2])
    layer.keep(torch.tensor([[[0, 2]]]))
    branch = layer.fork()
    branch.update(_token(8), _token(8))
    layer.update(_token(3), _token(3))
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 3.0, 2.0]
    assert branch.keys[0, 0, :, 0].tolist() == [0.0, 8.0, 2.0]
    assert layer.positions.tolist() == [[[0, 3, 2]]] and branch.positions.tolist() == [[[0, 3, 2]]]
    assert branch.positions is not layer.positions and branch.values is not layer.values


def test_ties_break_by_position_when_slots_are_out_of_order() -> None:
    scores = torch.tensor([[[1.0, 0.0, 0.0, 2.0]]])
    # by slot: the later slot of the two lowest goes (slot 2)
    assert top_slots(scores, 3).tolist() == [[[0, 1, 3]]]
    # by position: slot 1 holds the later token (position 2 > 1), so it goes
    assert top_slots(scores, 3, torch.tensor([[[3, 2, 1, 0]]])).tolist() == [[[0, 2, 3]]]
    # the sort path: the two highest of [5, 5, 5, 1]: by slot 0 and 1, by position the two earliest tokens (slots 2, 0)
    scores = torch.tensor([[[5.0, 5.0, 5.0, 1.0]]])
    assert top_slots(scores, 2).tolist() == [[[0, 1]]]
    assert top_slots(scores, 2, torch.tensor([[[1, 3, 0, 2]]])).tolist() == [[[0, 2]]]
    assert rank_mask(scores, 1).tolist() == [[[True, False, False, False]]]
    assert rank_mask(scores, 1, torch.tensor([[[1, 3, 0, 2]]])).tolist() == [[[False, False, True, False]]]


POLICIES = {
    "keydiff": lambda: KeyDiff(budget=24), "h2o": lambda: H2O(budget=24),
    "snapkv": lambda: SnapKV(budget=24, window=4, kernel=3), "streamingllm": lambda: StreamingLLM(budget=24),
    "tova": lambda: TOVA(budget=24), "hashevict": lambda: HashEvict(budget=24),
    "criticalkv": lambda: CriticalKV(budget=24, window=4, kernel=3),
    "pyramidkv": lambda: PyramidKV(budget=24, window=4, kernel=3), "knorm": lambda: KNorm(budget=24),
    "random": lambda: Random(budget=24), "adakv": lambda: AdaKV(budget=24, window=4, kernel=3),
    "sagekv": lambda: SageKV(budget=40),
}
# Per-head selections, stored flat per head: AdaKV's never leave a hole (Policy.ragged_slot_reuse False); SAGE-KV's
# slide drops one token of every head, whose row takes the next token. Its ragged layers attend in float32
# (explicit_attention) over rows then out of position order: float32 rounding of the same sums, not float64's.
RAGGED = {"adakv"}
FLOAT32_ORDER = {"sagekv": 1e-5}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_slot_reuse_keeps_the_tokens_the_chronological_storage_keeps(name: str) -> None:
    """float64, so attention summed in another order cannot swap a greedy step: every forward holds the same tokens,
    every step's logits and the graded branch's log-probability agree to float64 rounding (SAGE-KV: float32's)."""
    model, ids = float64_model(3), random_prompt(90, 0)
    runs = []
    for reuse in (False, True):
        logits: list[torch.Tensor] = []
        res = generate(model, POLICIES[name](), ids, GenerationSettings(block=16, max_new_tokens=20, slot_reuse=reuse),
                       answer_ids=[11, 12, 13, 14, 15],
                       observer=Observer(trace=True, on_logits=lambda lg: logits.append(lg[0])))
        runs.append((res, logits))
    (chrono, l0), (slots, l1) = runs
    assert slots.tokens == chrono.tokens and len(slots.tokens) == 20
    assert held_positions(slots.trace) == held_positions(chrono.trace)
    tol = FLOAT32_ORDER.get(name, 1e-12)
    assert max((a - b).abs().max().item() for a, b in zip(l0, l1, strict=True)) < tol
    assert abs(slots.answer_logprob - chrono.answer_logprob) < tol
    assert slots.peak_kv_tokens == chrono.peak_kv_tokens and slots.kv_bytes_peak == chrono.kv_bytes_peak
    # the slots were really reused: the layers held a hole (one slot more than the chronological layout) before some
    # forward (never AdaKV's ragged layers)
    holes = any(a is not None and a.shape != b.shape for s, c in zip(slots.trace, chrono.trace) for a, b in zip(s, c))
    assert holes == (name not in RAGGED)


@pytest.mark.parametrize("policy_factory,layers", [
    (lambda: KeyDiff(budget=24), 2),  # uniform budget, per-head kept sets
    (lambda: H2O(budget=24), 2),  # attention computed by the wrapper itself over scrambled slots
    (lambda: KNorm(budget=24, skip_layers=[0]), 3),  # per-layer lengths: layer 0 keeps all
    (lambda: SnapKV(budget=24, window=4, kernel=3), 2),  # the incremental window over reused slots
    (lambda: PyramidKV(budget=24, window=4, kernel=3), 3),  # per-layer budgets
    (lambda: AdaKV(budget=24, window=4, kernel=3), 2),  # ragged per-head budgets beside the option
    (lambda: SageKV(budget=40), 2),  # ragged heads whose slide writes each step's token into the row it freed
])
def test_slot_reuse_matches_float64_reference(policy_factory, layers: int) -> None:
    model, ids = float64_model(layers), random_prompt(70, 0)
    logged: list[torch.Tensor] = []
    res = generate(model, policy_factory(), ids, GenerationSettings(block=16, max_new_tokens=8, slot_reuse=True),
                   observer=Observer(trace=True, on_logits=lambda lg: logged.append(lg[0])))
    chunks = [ids[s:s + 16] for s in range(0, len(ids), 16)] + [[t] for t in res.tokens[:-1]]
    ref = reference_logits(model, chunks, res.trace)
    first = len(chunks) - len(res.tokens)  # the last prompt block's logits, then one per decoding step
    for got, want in zip(logged, ref[first:], strict=True):
        assert (got.double() - want).abs().max().item() < 1e-5


class _KVWrites(TorchDispatchMode):
    """While `on` is set, what kvbench's own code (not the model's forward) writes: `copied`, the bytes of every new
    tensor (an out-of-place op's output) of at least `rows_at_least` x head_dim elements, what a copy of a layer's K or
    V makes; `written`, the bytes written in place into K/V rows (index_copy_ of head_dim rows)."""

    def __init__(self, head_dim: int, rows_at_least: int) -> None:
        super().__init__()
        self.head_dim, self.rows_at_least = head_dim, rows_at_least
        self.on, self.copied, self.written = False, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and _from_kvbench():
            name = func._schema.name
            if name == "aten::index_copy_" and args[3].shape[-1] == self.head_dim:  # (self, dim, index, source)
                self.written += args[3].numel() * args[3].element_size()
            elif (isinstance(out, torch.Tensor) and not func.is_view and not name.endswith("_")
                  and out.numel() >= self.rows_at_least * self.head_dim):
                self.copied += out.numel() * out.element_size()
        return out


def _from_kvbench() -> bool:
    """Whether the op was called from kvbench's engine or policies (not from the model's own forward)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/kvbench/engine/" in name or "/kvbench/policies/" in name:
            return True
        if "/transformers/" in name:
            return False
        f = f.f_back
    return False


@pytest.mark.parametrize("name", ["h2o", "keydiff", "sagekv", "snapkv", "streamingllm", "tova"])
def test_a_decoding_step_copies_kv_of_the_new_token_only(name: str) -> None:
    """tiny-llama (2 layers, 2 KV heads, head_dim 64, float32), N = 40: after the prompt, each decoding step of the
    chronological storage copies every layer's K and V twice (append, then the kept slots: >= 2 x 2 layers x 40 x 2
    heads x 64 x 4 bytes); with slot reuse it copies no K/V and writes the new token's K and V once:
    2 layers x 2 (K, V) x 2 heads x 64 x 4 bytes = 2048 bytes per step. SAGE-KV's slide too, on its ragged layer
    (heads of 37 and 36 tokens here) and on its uniform one (36 each): the row each head drops takes the next token."""
    factory = {"streamingllm": lambda: StreamingLLM(budget=40), "keydiff": lambda: KeyDiff(budget=40),
               "snapkv": lambda: SnapKV(budget=40, window=4, kernel=3), "tova": lambda: TOVA(budget=40),
               "h2o": lambda: H2O(budget=40), "sagekv": lambda: SageKV(budget=40)}[name]
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0)
    attention.install(model)
    ids = random_prompt(100, 0)
    per_step = {}
    for reuse in (False, True):
        mode = _KVWrites(head_dim=64, rows_at_least=40)
        steps = []

        def on_logits(_: torch.Tensor) -> None:  # the first call ends the prompt: count from there, per step
            steps.append((mode.copied, mode.written))
            mode.on = True

        with mode:
            generate(model, factory(), ids, GenerationSettings(block=16, max_new_tokens=6, slot_reuse=reuse),
                     observer=Observer(on_logits=on_logits))
        # steps[i] is counted before step i's logits: differences between calls 2.. are whole decoding steps (the
        # first step appends to the prompt's chronological slots: its eviction leaves the first hole)
        per_step[reuse] = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(steps[2:], steps[3:])]
    assert len(per_step[True]) == 3
    assert all(copied == 0 and written == 2048 for copied, written in per_step[True]), per_step[True]
    held = 34 if name == "sagekv" else 40  # tokens per head: SAGE-KV's heads keep 35-38 of 40 here (unions overlap)
    assert all(copied >= 2 * 2 * 2 * held * 2 * 64 * 4 for copied, _ in per_step[False]), per_step[False]


def test_a_ragged_decoding_step_writes_its_tokens_into_free_rows() -> None:
    """AdaKV under prefill_once (one eviction after the prompt, then the cache grows): the eviction leaves the heads
    with different counts (stored flat per head) and SLACK = 16 free rows after each; tiny-llama (2 layers, 2 KV
    heads, head_dim 64, float32). Each decoding forward then copies no K/V and writes its token's K and V once:
    2 layers x 2 (K, V) x 2 heads x 64 x 4 bytes = 2048 bytes; the 17th, with every head's free rows used, lays the
    layers out anew (a copy of each: >= 2 layers x 2 x 40 tokens x 64 x 4 bytes). Without slot reuse (no free rows,
    as before them) every forward concatenates each layer anew."""
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0)
    attention.install(model)
    per_forward = {}
    for reuse in (False, True):
        mode, steps = _KVWrites(head_dim=64, rows_at_least=40), []

        def on_logits(_: torch.Tensor) -> None:  # the first call ends the prompt: count from there, per forward
            steps.append((mode.copied, mode.written))
            mode.on = True

        with mode:
            res = generate(model, AdaKV(budget=40, window=4, kernel=3), random_prompt(100, 0),
                           GenerationSettings(max_new_tokens=20, protocol="prefill_once", slot_reuse=reuse),
                           observer=Observer(trace=True, on_logits=on_logits))
        sizes = [(p >= 0).sum(-1).flatten().tolist() for p in res.trace[-1]]  # tokens per head before the last forward
        assert all(len(set(s)) > 1 for s in sizes), sizes  # ragged in both layers
        per_forward[reuse] = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(steps, steps[1:])]
    assert len(per_forward[True]) == 19
    assert per_forward[True][16][0] >= 2 * 2 * 40 * 64 * 4, per_forward[True]
    assert all(f == (0, 2048) for i, f in enumerate(per_forward[True]) if i != 16), per_forward[True]
    assert all(copied >= 2 * 2 * 40 * 64 * 4 for copied, _ in per_forward[False]), per_forward[False]


def test_the_flat_layout_leaves_free_rows_after_each_head() -> None:
    """By hand: heads of 3 and 1 tokens, 2 free rows each: segments at rows 0 and 5 with room for 5 and 3; a selection
    of rows 10, 11, 12 (head 0) and 20 (head 1) is stored at rows 0-2 and 5, the free rows holding placeholders
    (row 0); a token written in place goes to rows 3 and 6; every reader takes the heads' tokens only."""
    flat = FlatHeads.laid_out(torch.tensor([[3, 1]]), [3, 1], slack=2)
    assert (flat.starts, flat.caps, flat.start_rows.tolist()) == ([0, 5], [5, 3], [0, 5])
    assert flat.gapped_rows(torch.tensor([10, 11, 12, 20]), slack=2).tolist() == [10, 11, 12, 0, 0, 20, 0, 0]
    assert flat.room(2) and not flat.room(3)
    grown = flat.grown(1)
    assert grown.block_index(1).tolist() == [[3], [6]] and grown.sizes == [4, 2]
    store = torch.tensor([1.0, 2, 3, 4, -9, 5, 6, -9])  # -9: a free row
    assert [v.tolist() for v in grown.views(store)] == [[1, 2, 3, 4], [5, 6]]
    assert grown.pad(store, 0).tolist() == [[[1, 2, 3, 4], [5, 6, 0, 0]]]
    assert not grown.shared().room(1)  # a fork's storage is never written into


def test_a_forked_ragged_layer_and_its_fork_append_apart() -> None:
    """Copy-on-write: a ragged layer with free rows, forked; each appends a different token, and each holds its own
    after (the fork's first append lays it out anew rather than writing into the rows both share)."""
    gen = torch.Generator().manual_seed(0)
    layer = EvictingLayer(0)
    layer.reuse_slots = True  # as the engine sets it (slot_reuse, the default); else no free rows
    layer.update(torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 2, 6, 4, generator=gen))
    layer.keep(torch.tensor([[[0, 2, 5], [1, 4, 0]]]), torch.tensor([[[True, True, True], [True, True, False]]]))
    assert layer.ragged and layer.flat.room(1)
    fork = layer.fork()
    k1, k2 = torch.full((1, 2, 1, 4), 1.0), torch.full((1, 2, 1, 4), 2.0)
    layer.update(k1, k1)
    fork.update(k2, k2)
    for held, want in ((layer, 1.0), (fork, 2.0)):
        heads = held.flat.views(held.keys)
        assert [len(h) for h in heads] == [4, 3]
        assert all(h[-1].eq(want).all() for h in heads)
        assert all(torch.equal(a[:-1], b[:-1]) for a, b in zip(heads, fork.flat.views(fork.keys)))


def _ragged_decoding_layer() -> EvictingLayer:
    """A decoding layer (b = 1, h_kv = 2, d = 1) stored flat per head, each token's key and value its position:
    head 0 holds positions 0, 2, 5, head 1 positions 1, 4 (free rows after each), holes allowed
    (Policy.ragged_slot_reuse), selections stored at once (no engine to read the sizes)."""
    layer = EvictingLayer(0)
    layer.reuse_slots = layer.reuse_ragged_slots = True
    pos = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 2, 6, 1).contiguous()
    layer.update(pos, pos.clone())
    layer.keep(torch.tensor([[[0, 2, 5], [1, 4, 0]]]), torch.tensor([[[True, True, True], [True, True, False]]]))
    layer.decoding = True
    return layer


def _heads(layer: EvictingLayer) -> list[list[float]]:
    return [h.flatten().tolist() for h in layer.flat.views(layer.keys)]


def test_a_ragged_slide_leaves_a_hole_per_head_and_the_next_token_fills_it() -> None:
    """By hand: heads [0, 2, 5] and [1, 4]; the slide keeps [0, 5] and [4] (padded view slots 0, 2 and 1): no row
    moves, the dropped rows (head 0's second, head 1's first) are the heads' holes (position -1), and token 6 is
    written into them, so head 0 reads [0, 6, 5] and head 1 [6, 4]: out of position order."""
    layer = _ragged_decoding_layer()
    keys, starts = layer.keys, list(layer.flat.starts)
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    assert layer.ragged and layer.keys is keys and layer.flat.starts == starts  # nothing moved
    assert layer.hole.tolist() == [[[1], [0]]]
    assert layer.flat.padded_positions(layer.positions).tolist() == [[[0, -1, 5], [-1, 4, -1]]]
    assert layer.physical() == 2 and layer.head_lengths() == [2, 1] and layer.tokens_per_head() == 2
    assert layer.kv_bytes() == 3 * 2 * 4  # 3 tokens' key and value (d = 1, float32)
    new = torch.full((1, 2, 1, 1), 6.0)
    layer.update(new, new)
    assert layer.keys is keys and _heads(layer) == [[0.0, 6.0, 5.0], [6.0, 4.0]]
    assert layer.flat.padded_positions(layer.positions).tolist() == [[[0, 6, 5], [6, 4, -1]]]
    assert not layer.chronological and layer.hole is None and layer.head_lengths() == [3, 2]
    assert layer.block_kv(1)[0].flatten().tolist() == [6.0, 6.0]  # the new token's rows, for its state


def test_a_state_a_slide_sets_anew_follows_the_rows() -> None:
    """A selection that leaves holes and sets a per-token state anew (in the padded view's layout: head 0 [1, 2, 3],
    head 1 [4, 5, pad]) stores it flat, each value at its token's row, the holes' rows included."""
    layer = _ragged_decoding_layer()
    layer.state["mark"] = torch.zeros(layer.keys.shape[0])
    layer.unpack(kv=False)
    layer.state["mark"] = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]])
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    assert layer.hole is not None
    assert [layer.state["mark"][s:s + n].tolist() for s, n in zip(layer.flat.starts, layer.flat.sizes)] == [
        [1.0, 2.0, 3.0], [4.0, 5.0]]


def test_a_selection_of_rows_out_of_order_is_stored_in_position_order() -> None:
    """After a hole was filled (head 0 [0, 6, 5], head 1 [6, 4]), a selection that is not one token per head (head 0
    keeps the tokens at 5 and 6, head 1 both) is stored anew, each head in position order: [5, 6] and [4, 6]."""
    layer = _ragged_decoding_layer()
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    new = torch.full((1, 2, 1, 1), 6.0)
    layer.update(new, new)
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[1, 2, 0], [0, 1, 0]]]), torch.tensor([[[True, True, False], [True, True, False]]]))
    assert layer.uniform and layer.chronological and layer.hole is None
    assert layer.keys.flatten().tolist() == [5.0, 6.0, 4.0, 6.0] and layer.positions.tolist() == [[[5, 6], [4, 6]]]


def test_a_ragged_hole_is_closed_in_position_order_before_a_block() -> None:
    """A block of 2 tokens cannot go into one hole per head: the layer is laid out anew without its holes, each head
    in position order, then the block appended: [0, 5, 7, 8] and [4, 7, 8]."""
    layer = _ragged_decoding_layer()
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    block = torch.tensor([7.0, 8.0]).view(1, 1, 2, 1).expand(1, 2, 2, 1)
    layer.seen = 7
    layer.update(block, block)
    assert _heads(layer) == [[0.0, 5.0, 7.0, 8.0], [4.0, 7.0, 8.0]] and layer.hole is None and layer.chronological
    assert layer.flat.padded_positions(layer.positions).tolist() == [[[0, 5, 7, 8], [4, 7, 8, -1]]]


def test_a_forked_ragged_layer_with_holes_is_laid_out_anew() -> None:
    """Copy-on-write: after a fork neither layer writes into the rows they may share; each closes its holes (a copy)
    and appends its own token."""
    layer = _ragged_decoding_layer()
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    fork = layer.fork()
    a, b = torch.full((1, 2, 1, 1), 6.0), torch.full((1, 2, 1, 1), 9.0)
    layer.update(a, a)
    fork.update(b, b)
    assert _heads(layer) == [[0.0, 5.0, 6.0], [4.0, 6.0]] and _heads(fork) == [[0.0, 5.0, 9.0], [4.0, 9.0]]


def test_without_the_policy_s_leave_a_ragged_selection_is_stored_anew() -> None:
    """Policy.ragged_slot_reuse False (AdaKV's, CriticalKV's): the same selection copies the kept rows in order."""
    layer = _ragged_decoding_layer()
    layer.reuse_ragged_slots = False
    keys = layer.keys
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    assert layer.keys is not keys and layer.hole is None and _heads(layer) == [[0.0, 5.0], [4.0]]


def test_dropping_a_position_leaves_the_hole_keep_leaves() -> None:
    """drop_position(p) (Policy.dropped_position): by hand, the slot holding p becomes each head's hole, as keep of
    every other slot makes it; uniform: [0, 1, 2, 3] drops position 2 (slot 2); ragged: heads [0, 6, 5] and [6, 4]
    (after a slide and token 6) drop position 6, head 0's slot 1 and head 1's slot 0, nothing moved, and a free row
    holding a leftover 6 is not taken for a head's token."""
    layer = _layer([0, 1, 2, 3])
    keys = layer.keys
    assert layer.drop_position(2) and layer.keys is keys
    assert layer.positions.tolist() == [[[0, 1, -1, 3]]] and layer.hole.tolist() == [[[2]]]
    assert not layer.drop_position(1)  # a hole open already: the next token goes there first
    layer.update(_token(4), _token(4))
    assert layer.block_slots.tolist() == [[[2]]] and layer.positions.tolist() == [[[0, 1, 4, 3]]]

    layer = _ragged_decoding_layer()
    layer.unpack(kv=False)
    layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
    new = torch.full((1, 2, 1, 1), 6.0)
    layer.update(new, new)
    keys, flat = layer.keys, layer.flat
    assert flat.padded_positions(layer.positions).tolist() == [[[0, 6, 5], [6, 4, -1]]]
    free = flat.starts[0] + flat.sizes[0]  # head 0's first free row
    layer.positions[free] = 6
    assert layer.drop_position(6)
    assert layer.keys is keys and layer.flat is flat and layer.hole.tolist() == [[[1], [0]]]
    assert flat.padded_positions(layer.positions).tolist() == [[[0, -1, 5], [-1, 4, -1]]]
    assert layer.positions[free].item() == 6 and layer.head_lengths() == [2, 1]
    layer.update(torch.full((1, 2, 1, 1), 7.0), torch.full((1, 2, 1, 1), 7.0))
    assert _heads(layer) == [[0.0, 7.0, 5.0], [7.0, 4.0]]


def test_dropping_a_position_declines_where_keep_leaves_no_hole() -> None:
    """False, nothing changed: a fork's shared rows (copy-on-write), a layer with extras of its own, no slot reuse
    for ragged layers (the policy's), a layer in its padded view, a prompt (not decoding)."""
    def ragged() -> EvictingLayer:
        layer = _ragged_decoding_layer()
        layer.unpack(kv=False)
        layer.keep(torch.tensor([[[0, 2, 0], [1, 0, 0]]]), torch.tensor([[[True, True, False], [True, False, False]]]))
        layer.update(torch.full((1, 2, 1, 1), 6.0), torch.full((1, 2, 1, 1), 6.0))
        return layer

    layer = ragged()
    fork = layer.fork()
    cases = [fork, ragged(), ragged(), ragged(), ragged()]
    cases[1].extras["mine"] = object()
    cases[2].reuse_ragged_slots = False
    cases[3].unpack()
    cases[4].decoding = False
    for case in cases:
        before = case.positions.clone()
        assert not case.drop_position(6)
        assert case.hole is None and torch.equal(case.positions, before)


def test_the_setting_is_a_flag_recorded_with_every_run() -> None:
    assert RunSettings.from_config({}).slot_reuse is True  # the default
    s = RunSettings.from_config({"slot_reuse": False})
    assert not s.slot_reuse and s.recorded()["slot_reuse"] is False
    assert s.key() == RunSettings.from_config({}).key()  # like batch_size: the same results up to rounding
    with pytest.raises(ConfigError, match="slot_reuse must be true or false"):
        RunSettings.from_config({"slot_reuse": "yes"})


def test_batched_samples_reuse_slots_as_alone() -> None:
    """batch_size's path (generate_batch: each sample its own cache, the model over the rows together) with slot reuse:
    float64, each sample's tokens and kept tokens are those of its own batch-1 run with slot reuse."""
    model = float64_model(3)
    prompts = [random_prompt(90, 0), random_prompt(70, 0)[::-1]]
    settings = GenerationSettings(block=16, max_new_tokens=12, slot_reuse=True)
    alone = [generate(model, KeyDiff(budget=24), ids, settings, observer=Observer(trace=True)) for ids in prompts]
    together = generate_batch(model, [Job(ids, KeyDiff(budget=24), settings, observer=Observer(trace=True))
                                      for ids in prompts])
    for a, b in zip(alone, together, strict=True):
        assert b.tokens == a.tokens and len(a.tokens) == 12
        assert held_positions(b.trace) == held_positions(a.trace)


@pytest.mark.parametrize("selection", ["keep", "none"])
def test_a_padded_view_without_kv_stores_the_rows_the_full_view_stores(selection: str) -> None:
    """`unpack(kv=False)` (a selection that reads no K/V): the view's keys and values are stand-ins of the padded shape
    (b, h_kv, L, d), and `pack` takes the kept rows from the flat K/V: the same storage, byte for byte, as the view
    that padded K/V. By hand: heads of 3 and 2 tokens (rows 0-2 and 3-4 of 6 appended, then kept), the second kept
    selection drops head 0's middle token and head 1's first; "none": nothing kept, the flat storage back as it was."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for kv in (True, False):
        layer = EvictingLayer(0)
        layer.reuse_slots = True
        gen.manual_seed(0)
        layer.update(torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 2, 6, 4, generator=gen))
        layer.keep(torch.tensor([[[0, 2, 5], [1, 4, 0]]]), torch.tensor([[[True, True, True], [True, True, False]]]))
        assert layer.ragged and layer.flat.sizes == [3, 2]
        layer.unpack(kv=kv)
        assert layer.keys.shape == (1, 2, 3, 4) and layer.positions.tolist() == [[[0, 2, 5], [1, 4, -1]]]
        if selection == "keep":
            layer.keep(torch.tensor([[[0, 2], [1, 0]]]), torch.tensor([[[True, True], [True, False]]]))
        layer.pack()
        layers.append(layer)
    full, lean = layers
    held = [[0, 5], [4]] if selection == "keep" else [[0, 2, 5], [1, 4]]
    assert [v.tolist() for v in lean.flat.views(lean.positions)] == held
    for name in ("keys", "values", "positions"):
        assert [v.tolist() for v in lean.flat.views(getattr(lean, name))] == \
               [v.tolist() for v in full.flat.views(getattr(full, name))], name


@pytest.mark.parametrize("policy", ["sagekv", "adakv", "criticalkv"])
def test_per_head_selections_pad_no_kv(monkeypatch, policy: str) -> None:
    """SAGE-KV's slide reads positions and its pinned state, and the per-head selections (AdaKV's, CriticalKV's on
    AdaKV, SAGE-KV's) read the keys only through attention, which attends each head's own keys (`needs_kv` False):
    `FlatHeads.pad` never copies a (rows, head_dim) array, in the prompt or while decoding (it copied K and V of every
    evicted layer before), and the tokens are those of the same run with K/V padded for every selection."""
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0)
    attention.install(model)
    make = {"sagekv": lambda: SageKV(budget=40), "adakv": lambda: AdaKV(budget=40, window=4, kernel=3),
            "criticalkv": lambda: CriticalKV(budget=40, base="adakv", window=4, kernel=3)}[policy]
    settings = GenerationSettings(block=16, max_new_tokens=6)
    prompt = random_prompt(100, 0)
    padded_2d: list[int] = []
    pad = FlatHeads.pad
    head_dim = model.config.hidden_size // model.config.num_attention_heads  # 64; windows of 4 rows: 2 * 4 columns

    def spy(self: FlatHeads, flat: torch.Tensor, fill: float, segments: list[int] | None = None) -> torch.Tensor:
        if flat.dim() == 2 and flat.shape[-1] == head_dim:  # K or V (the window ring's rows have g * w columns)
            padded_2d.append(flat.shape[0])
        return pad(self, flat, fill, segments)

    monkeypatch.setattr(FlatHeads, "pad", spy)
    lean = generate(model, make(), prompt, settings)
    assert len(lean.tokens) == 6 and lean.peak_kv_tokens <= 40 + 16
    assert padded_2d == []
    monkeypatch.setattr(type(make()), "needs_kv", lambda self, layer: True)
    full = generate(model, make(), prompt, settings)
    assert padded_2d, "the padded K/V of every selection"
    assert full.tokens == lean.tokens
