"""The incremental observation window and the one-call ragged attention select and attend exactly as the plain
computations they replace.

- `window_attention(layer)` (SnapKV, PyramidKV, AdaKV and CriticalKV on either: the stashed queries' mean
  attention) keeps each stashed query's row of probabilities as per-token state and adds only the new queries' rows
  per forward. At every eviction of real `generate` runs (every affected policy, every protocol, blocks larger and
  smaller than the window, the graded branch's fork, context_only, bfloat16) its rows and its mean are checked
  against `query_attention` recomputed on the same layer, within the float32 bound derived in `_bound`, and the
  policy's selection against the one made on a copy of the layer that recomputes: the kept slots are identical.
- `ragged_attention` (AdaKV, SAGE-KV, CriticalKV on AdaKV) can attend all heads of a ragged layer in one masked call
  (`batched`, the CUDA default; measured slower on CPU, which keeps the per-head calls): checked against the per-head
  loop (padded slots: weight exactly 0).
- CriticalKV's value norms of a decoding step come from one batched product: the per-head loop's values within float32
  rounding; both read W_O from a per-head copy (`head_columns`), giving the very products of W_O's strided view.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

from kvbench.engine import attention
from kvbench.engine.attention import QUERY_CHUNK, explicit_attention, ragged_attention
from kvbench.engine.cache import EvictingCache, EvictingLayer
from kvbench.engine.generate import GenerationSettings, generate
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import Policy, query_attention
from kvbench.policies import criticalkv
from kvbench.policies.criticalkv import BATCHED_TOKENS, CriticalKV, head_columns
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.window import WindowRing, window_attention

from helpers import installed_model

pytestmark = pytest.mark.tiny_model("tiny-llama")  # the `model` fixture (conftest.py): 2 layers, 4 / 2 heads

EPS = torch.finfo(torch.float32).eps
IDS = torch.randint(8, 500, (70,), generator=torch.Generator().manual_seed(0)).tolist()

POLICIES: dict[str, Callable[[], Policy]] = {
    "snapkv": lambda: SnapKV(budget=24, window=4, kernel=3),  # avg pooling
    "pyramidkv": lambda: PyramidKV(budget=24, window=4, kernel=3),  # per-layer budgets, max pooling
    "adakv": lambda: AdaKV(budget=24, window=4, kernel=3),  # ragged layers
    "adakv_kvpress": lambda: AdaKV(budget=24, window=4, kernel=3, allocation="kvpress"),
    "criticalkv": lambda: CriticalKV(budget=24, window=4, kernel=3),
    "criticalkv_adakv": lambda: CriticalKV(base="adakv", budget=24, window=4, kernel=3, stage1_window="inside"),
}
# (protocol, block): blocks larger and smaller than the window (4), one forward, one forward then every step
PROTOCOLS = [("blockwise", 8), ("blockwise", 3), ("prefill_once", None), ("prefill_once_decode_evict", None)]


def _bound(layer: EvictingLayer) -> float:
    """Relative error allowed between a probability kept incrementally and the recomputed one (float32).

    The rows a decoding step adds come from a (g x d) by (d x n) product, the recomputation's from a (g*w x d) by
    (d x n) one: the BLAS kernel may order each logit's d-term sum differently, and two orders of a sum of d products
    each lie within gamma_d * sum|q_i k_i| of the exact value (gamma_d = d eps / (1 - d eps), the standard bound), so
    a logit moves by at most 2 gamma_d scaling max(|q| |k|^T). A probability exp(l - logsumexp) moves by at most twice
    that, relatively. Older rows are renormalised over fewer slots: one sum of at most n terms, one division, and the
    mean of at most w rows add (n + w + 4) eps. Measured: 1e-6 to 1e-5 here, where logits reach ~10-30.
    """
    q, k = layer.stash.queries.float().abs(), layer.keys.float().abs()  # (b, h_q, w, d), (b, h_kv, n, d)
    b, h_q, w, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    mags = torch.matmul(q.reshape(b, h_kv, h_q // h_kv * w, d), k.transpose(-1, -2)).max().item() * layer.scaling
    gamma = d * EPS / (1 - d * EPS)
    return 4 * gamma * mags + (n + w + 4) * EPS


def _assert_close_relative(got: torch.Tensor, want: torch.Tensor, rel: float) -> float:
    """Zero exactly where `want` is (masked keys, padding), relative error <= rel elsewhere; returns the largest."""
    zero = want == 0
    assert torch.equal(got[zero], want[zero])
    err = ((got - want).abs() / want.abs())[~zero].max().item() if (~zero).any() else 0.0
    assert err <= rel, (err, rel)
    return err


def stored_rows(layer: EvictingLayer) -> torch.Tensor:
    """(b, h_q, count, n) each stashed query's stored row renormalised over the slots held: what window_attention
    averages (the rows computed since the latest eviction are used as stored: they sum to 1 up to rounding)."""
    first, seen, w = layer.stash.first, layer.seen, layer.stash.window
    b, h_q = layer.stash.queries.shape[:2]
    h_kv, n = layer.keys.shape[1], layer.keys.shape[2]
    wp = WindowRing.of(layer).probs.view(b, h_kv, n, h_q // h_kv, w)
    rows = [wp[..., (p - WindowRing.of(layer).base) % w] for p in range(first, seen)]  # (b, h_kv, n, g) each
    rows = torch.stack(rows, dim=-1).permute(0, 1, 3, 4, 2).reshape(b, h_q, seen - first, n)
    return rows / rows.sum(dim=-1, keepdim=True)


class Checks:
    """Wraps `policy.select`: at every eviction, compares the layer's incremental window with `query_attention` and
    the selection with the one a recomputing copy of the layer makes, then selects on the layer itself."""

    def __init__(self, policy: Policy) -> None:
        self.calls = self.incremental = 0
        self.worst = 0.0
        select = policy.select

        def checked(layer: EvictingLayer) -> Any:
            ref = layer.fork()  # shares K/V; its own window state, which the next two lines switch off
            WindowRing.of(ref).probs, ref.stash.first = None, None  # no ring: window_attention recomputes every time
            want = select(ref)
            if layer.stash.queries is not None and layer.stash.first is not None:
                self.calls += 1
                ring = WindowRing.of(layer)
                self.incremental += ring.probs is not None and ring.rows > layer.stash.first
                probs = query_attention(layer)  # (b, h_q, w, n)
                rel = _bound(layer)
                got = window_attention(layer)  # brings the state up to date first
                self.worst = max(self.worst, _assert_close_relative(got, probs.mean(dim=-2), rel))
                if ring.probs is not None:  # rows are kept while decoding, and for blocks smaller than w
                    _assert_close_relative(stored_rows(layer), probs, rel)
            got = select(layer)
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got[0], want[0])
                assert (got[1] is None) == (want[1] is None)
                assert got[1] is None or torch.equal(got[1], want[1])
            return got

        policy.select = checked


@pytest.mark.parametrize("protocol,block", PROTOCOLS, ids=lambda x: str(x))
@pytest.mark.parametrize("name", list(POLICIES))
def test_incremental_window_selects_what_recomputing_selects(model, name: str, protocol: str,
                                                             block: int | None) -> None:
    policy = POLICIES[name]()
    checks = Checks(policy)
    settings = GenerationSettings(block=block, max_new_tokens=10, protocol=protocol)
    out = generate(model, policy, IDS, settings, answer_ids=IDS[:6])  # the graded branch runs on a fork
    assert checks.calls > 0 and len(out.tokens) == 10
    # every decoding step that evicts scores incrementally (prefill_once never evicts while decoding)
    assert (checks.incremental > 0) == (protocol != "prefill_once")


def test_context_only_and_bfloat16() -> None:
    model = installed_model("tiny-llama", dtype=torch.bfloat16)[0]
    for name in ("snapkv", "criticalkv_adakv"):
        policy = POLICIES[name]()
        checks = Checks(policy)
        settings = GenerationSettings(block=8, max_new_tokens=8, scenario="context_only", context_tokens=50)
        generate(model, policy, IDS, settings)  # evicts within the first 50 tokens only
        assert checks.calls > 0
        policy = POLICIES[name]()
        checks = Checks(policy)
        generate(model, policy, IDS, GenerationSettings(block=8, max_new_tokens=8), answer_ids=IDS[:4])
        assert checks.incremental > 0


def test_greedy_tokens_equal_the_recomputing_windows(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: the same answers and graded score as with window_attention recomputed at every call."""
    settings = GenerationSettings(block=8, max_new_tokens=12)
    got = {n: generate(model, POLICIES[n](), IDS, settings, answer_ids=IDS[:6]) for n in POLICIES}
    monkeypatch.setattr(WindowRing, "attention", lambda self, layer: query_attention(layer).mean(dim=-2))
    for n in POLICIES:
        want = generate(model, POLICIES[n](), IDS, settings, answer_ids=IDS[:6])
        assert got[n].tokens == want.tokens, n
        assert math.isclose(got[n].answer_logprob, want.answer_logprob, rel_tol=1e-6), n


def _layer_with_window(seed: int = 0, n: int = 20, w: int = 4) -> EvictingLayer:
    """A decoding uniform layer of n tokens whose last w queries are stashed (window w), scaling 0.3."""
    g = torch.Generator().manual_seed(seed)
    layer = EvictingLayer(0)
    layer.scaling, layer.softcap, layer.decoding = 0.3, None, True
    for q in (n - 1, 1):  # a block, then one decoding step: stashed as the wrapper does
        layer.update(torch.randn(1, 2, q, 8, generator=g), torch.randn(1, 2, q, 8, generator=g))
        layer.stash.add(torch.randn(1, 4, q, 8, generator=g), layer.seen, w)
    return layer


def test_a_decoding_step_adds_one_row_and_renormalises_the_others() -> None:
    layer = _layer_with_window()
    window_attention(layer)  # 4 new queries: computed as query_attention computes them, and stored
    assert WindowRing.of(layer).probs.shape == (1, 2, 20, 8)  # g * w = 2 * 4 per token and KV head
    assert torch.equal(window_attention(layer), query_attention(layer).mean(dim=-2))  # nothing new: same values
    stored = WindowRing.of(layer).probs
    layer.keep(torch.tensor([[[0, 2, 3, 5, 7, 11, 12, 15, 16, 17, 18, 19]] * 2]))  # evicts 8 slots
    g = torch.Generator().manual_seed(7)
    layer.update(torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g))
    layer.stash.add(torch.randn(1, 4, 1, 8, generator=g), layer.seen, 4)
    # pruning and the new token's entries wait for the next call: one copy then
    assert WindowRing.of(layer).probs is stored
    got = window_attention(layer)
    assert WindowRing.of(layer).probs.shape[2] == 13 and WindowRing.of(layer).rows == 21
    probs = query_attention(layer)
    rel = _bound(layer)
    _assert_close_relative(got, probs.mean(dim=-2), rel)
    _assert_close_relative(stored_rows(layer), probs, rel)
    # the newest query's row is stored as computed: query_attention's arithmetic on that one query
    slot = (20 - WindowRing.of(layer).base) % 4
    stored = WindowRing.of(layer).probs.view(1, 2, 13, 2, 4)[..., slot].permute(0, 1, 3, 2).reshape(1, 4, 13)
    assert torch.equal(stored, WindowRing._query_rows(layer, layer.stash.queries[:, :, -1:], 20)[:, :, 0])


def test_a_freed_slot_leaves_each_row_sum_and_the_next_row_sums_itself() -> None:
    """Keys all zero: the query at position p gives each of the keys it sees (positions 0 .. p) 1 / (p + 1). Window 4
    (queries 16 .. 19 of 20 tokens). Freeing slot 5 in place (slot reuse) leaves row p the sum p / (p + 1); the next
    token (position 20, written into slot 5) adds a row of 20 keys at 1/20 each, and the older rows are renormalised
    to 1 / p over the p keys each still sees, so the window attention of a slot is the mean of those."""
    layer = EvictingLayer(0)
    layer.scaling, layer.softcap, layer.decoding, layer.reuse_slots = 0.3, None, True, True
    g = torch.Generator().manual_seed(4)

    def append(q: int) -> None:  # zero keys, random values and queries
        layer.update(torch.zeros(1, 2, q, 8), torch.randn(1, 2, q, 8, generator=g))
        layer.stash.add(torch.randn(1, 4, q, 8, generator=g), layer.seen, 4)

    append(19)
    append(1)
    ring = WindowRing.of(layer)
    window_attention(layer)  # the 4 rows computed and stored
    window_attention(layer)  # nothing new: their sums taken once
    assert ring.mass.shape == (1, 2, 2, 4)  # (b, h_kv, g, w): ring slot p - 16 holds query p
    layer.keep(torch.tensor([[[i for i in range(20) if i != 5]] * 2]))  # drops slot 5 in place
    assert layer.hole is not None and layer.keys.shape[2] == 20
    want = torch.tensor([p / (p + 1) for p in range(16, 20)]).expand(1, 2, 2, 4)
    torch.testing.assert_close(ring.mass, want, rtol=4 * EPS, atol=0)
    append(1)  # position 20, into slot 5
    got = window_attention(layer)  # (1, 4, 20): queries 17 .. 20
    torch.testing.assert_close(ring.mass[..., 0], torch.ones(1, 2, 2), rtol=32 * EPS, atol=0)  # the new row (slot 0)
    held = [i for i in range(20) if i != 5]
    expected = torch.zeros(20)
    for t in held:  # an old token: seen by the old queries at positions >= t, and by the new one
        expected[t] = (sum(1 / p for p in range(max(17, t), 20)) + 1 / 20) / 4
    expected[5] = (1 / 20) / 4  # the new token: only its own query sees it
    torch.testing.assert_close(got, expected.expand(1, 4, 20), rtol=64 * EPS, atol=0)


def test_evictions_between_scorings_keep_the_window_aligned() -> None:
    """Two tokens appended without scoring, an eviction that keeps one of them in head 0 and both in head 1 (their
    entries are pending zeros, pruned lazily with the rest), one more token, then scoring."""
    layer = _layer_with_window(seed=3)
    window_attention(layer)
    g = torch.Generator().manual_seed(8)

    def append() -> None:
        layer.update(torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g))
        layer.stash.add(torch.randn(1, 4, 1, 8, generator=g), layer.seen, 4)

    append()
    append()
    layer.keep(torch.tensor([[[0, 1, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 21],
                              [1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 20, 21]]]))
    append()
    got = window_attention(layer)  # queries 19 (row kept from before) and 20, 21, 22 (new rows)
    assert WindowRing.of(layer).rows == 23 and WindowRing.of(layer).probs.shape[2] == 14
    probs = query_attention(layer)
    rel = _bound(layer)
    _assert_close_relative(got, probs.mean(dim=-2), rel)
    _assert_close_relative(stored_rows(layer), probs, rel)


def test_the_fork_keeps_its_own_window() -> None:
    layer = _layer_with_window(seed=1)
    before = window_attention(layer).clone()
    branch = layer.fork()
    g = torch.Generator().manual_seed(2)
    branch.update(torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g))
    branch.stash.add(torch.randn(1, 4, 1, 8, generator=g), branch.seen, 4)
    window_attention(branch)  # writes the branch's new row in place
    assert WindowRing.of(branch).probs.data_ptr() != WindowRing.of(layer).probs.data_ptr()
    assert torch.equal(window_attention(layer), before)


def test_the_window_state_is_kept_only_while_decoding(model) -> None:
    """A prompt block of at least w tokens keeps no rows (the next block replaces them all): prefill_once holds none
    after its one eviction. The first decoding step that scores computes them once; later ones only their new row,
    and appends between two scorings cost nothing (the entries of appended tokens wait for the next scoring)."""
    policy = POLICIES["snapkv"]()
    cache = EvictingCache(model.config, policy)
    ids = torch.tensor([IDS])
    with attention.active(cache), torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)  # the whole prompt in one forward, then one eviction
        for layer in cache.evicting_layers():
            policy.evict(layer)
        assert all(WindowRing.of(layer).probs is None for layer in cache.evicting_layers())
        cache.start_decoding()
        model(input_ids=ids[:, :1], past_key_values=cache)
        for layer in cache.evicting_layers():
            policy.evict(layer)  # builds the rows of the 4 stashed queries
        stored = [WindowRing.of(layer).probs for layer in cache.evicting_layers()]
        for t in range(2):
            model(input_ids=ids[:, t:t + 1], past_key_values=cache)
    for layer, before in zip(cache.evicting_layers(), stored):
        assert before.shape[2] == 25 and WindowRing.of(layer).probs is before and layer.physical() == 26
        window_attention(layer)  # one copy: the 24 kept slots and the 2 appended; 2 new rows
        assert WindowRing.of(layer).probs.shape[2] == 26 and WindowRing.of(layer).rows == 73


# -- the ragged layers' attention in one call ------------------------------------------------------------------------

def _ragged_layer(b: int, q: int, d: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> EvictingLayer:
    """A ragged layer (b, 3 KV heads holding 10, 4, 7 tokens; batch 1 holds 6, 9, 2) with a block of q appended."""
    g = torch.Generator().manual_seed(seed)
    layer = EvictingLayer(0)
    layer.update(torch.randn(b, 3, 12, d, generator=g).to(dtype), torch.randn(b, 3, 12, d, generator=g).to(dtype))
    counts = [[10, 4, 7], [6, 9, 2]][:b]
    idx = torch.zeros(b, 3, 10, dtype=torch.long)
    valid = torch.zeros(b, 3, 10, dtype=torch.bool)
    for i, row in enumerate(counts):
        for h, c in enumerate(row):
            idx[i, h, :c] = torch.randperm(12, generator=g)[:c].sort().values
            valid[i, h, :c] = True
    layer.keep(idx, valid)
    assert layer.ragged
    layer.update(torch.randn(b, 3, q, d, generator=g).to(dtype), torch.randn(b, 3, q, d, generator=g).to(dtype))
    return layer


def per_head_attention(query: torch.Tensor, layer: EvictingLayer, scaling: float,
                       softcap: float | None) -> torch.Tensor:
    """The per-(batch, KV head) loop, written out: each head's query group over its own keys."""
    b, h_q, q_len, _ = query.shape
    h_kv = layer.lengths.shape[1]
    g = h_q // h_kv
    out = layer.values.new_empty(b, q_len, h_q, layer.values.shape[-1])
    for i, (k, v) in enumerate(zip(layer.flat.views(layer.keys), layer.flat.views(layer.values))):
        bi, hi = divmod(i, h_kv)
        qi = query[bi:bi + 1, hi * g:(hi + 1) * g]
        out[bi, :, hi * g:(hi + 1) * g] = explicit_attention(qi, k[None, None], v[None, None], scaling, softcap)[0]
    return out


@pytest.mark.parametrize("q_len", [1, 2, QUERY_CHUNK + 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("b", [1, 2])
def test_ragged_attention_in_one_call_equals_the_per_head_loop(q_len: int, softcap: float | None, b: int) -> None:
    layer = _ragged_layer(b, q_len)
    query = torch.randn(b, 6, q_len, 8, generator=torch.Generator().manual_seed(3))  # g = 2
    want = per_head_attention(query, layer, 0.4, softcap)
    assert torch.equal(ragged_attention(query, layer, 0.4, softcap), want)  # the default on CPU: per head
    got = ragged_attention(query, layer, 0.4, softcap, batched=True)
    # The same logits; the softmax and the product with V run over the padded length instead of each head's:
    # sums of the same terms plus exact zeros, which the kernels may group differently (a few ulps of the output).
    torch.testing.assert_close(got, want, rtol=4 * EPS * 64, atol=4 * EPS)


@pytest.mark.parametrize("q_len,k", [(5, 3), (1, 1), (QUERY_CHUNK + 3, 2)])
@pytest.mark.parametrize("batched", [False, True])
def test_the_forwards_rows_are_the_window_attention_of_its_latest_queries(q_len: int, k: int, batched: bool) -> None:
    # A ragged layer's forward keeps the mean over its latest k queries of their probabilities per query head
    # (`rows`, Policy.attention_rows): what query_attention(mean=True) computes over the padded view with those k
    # queries stashed: the same products and softmax per head, the forward's over all its queries at once (the matrix
    # kernel may round a row differently by the rows beside it: here a few ulps on a 7-key head of width 8; none on
    # SmolLM2's shapes, results/bench_smollm2/engine_identity_*), up to rounding over the padding batched
    layer = _ragged_layer(2, q_len)
    query = torch.randn(2, 6, q_len, 8, generator=torch.Generator().manual_seed(3))  # g = 2
    out = ragged_attention(query, layer, 0.4, None, batched=batched, rows=k)
    assert torch.equal(out, ragged_attention(query, layer, 0.4, None, batched=batched))  # the output unchanged
    seen, rows, mean = layer.forward_rows
    assert (seen, rows, mean.shape) == (layer.seen, k, (2, 6, max(layer.head_sizes)))
    layer.scaling, layer.softcap = 0.4, None
    layer.stash.add(query[:, :, -k:], layer.seen, k)
    layer.unpack(kv=False)
    want = query_attention(layer, mean=True)  # (2, 6, L): 0 on padding
    assert (mean[~layer.valid.repeat_interleave(2, dim=1)] == 0).all()
    torch.testing.assert_close(mean, want, rtol=4 * EPS * 64 if batched else 4 * EPS, atol=4 * EPS)
    # by hand, one query (k = 1): head 0 of batch row 0 holds 10 tokens + the block; the last query sees them all
    if k == 1:
        keys = layer.head_keys()[0]
        torch.testing.assert_close(mean[0, 0, :keys.shape[0]], torch.softmax(0.4 * keys @ query[0, 0, -1], dim=-1))


def test_no_rows_when_the_last_chunk_holds_fewer_queries() -> None:
    layer = _ragged_layer(1, QUERY_CHUNK + 1)  # the last chunk: 1 query
    ragged_attention(torch.randn(1, 6, QUERY_CHUNK + 1, 8), layer, 0.4, None, rows=2)
    assert layer.forward_rows is None


def test_adakv_takes_the_forwards_rows_and_decodes_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # AdaKV's window from the forward's rows (a prompt block's, a decoding step's) against recomputing every one of
    # them: the same tokens. The rows a forward stored are always taken; both kinds are (a layer stored uniform, as
    # before its first selection, attends with sdpa and stores none: its window is computed)
    from kvbench.policies import window as window_mod

    model, _ = installed_model()
    prompt = list(range(3, 83))
    settings = GenerationSettings(block=16, max_new_tokens=6)
    calls: list[tuple[int, bool, bool]] = []  # (k, rows stored, taken)
    given = window_mod.forward_rows

    def spy(layer: Any, k: int) -> torch.Tensor | None:
        stored = layer.forward_rows is not None
        got = given(layer, k)
        calls.append((k, stored, got is not None))
        return got

    monkeypatch.setattr(window_mod, "forward_rows", spy)
    lean = generate(model, AdaKV(budget=24, window=4, kernel=3), prompt, settings)
    assert all(stored == taken for _, stored, taken in calls), calls
    assert {k for k, _, taken in calls if taken} == {1, 4}, calls  # a decoding step's row, a prompt block's window
    monkeypatch.setattr(window_mod, "forward_rows", lambda layer, k: None)
    assert generate(model, AdaKV(budget=24, window=4, kernel=3), prompt, settings).tokens == lean.tokens


def test_ragged_attention_in_bfloat16() -> None:
    layer = _ragged_layer(1, 3, dtype=torch.bfloat16)
    query = torch.randn(1, 6, 3, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = ragged_attention(query, layer, 0.4, None, batched=True)
    assert got.dtype == torch.bfloat16
    # float32 logits and softmax in both; the probabilities are rounded to bfloat16 before the product with V
    torch.testing.assert_close(got, per_head_attention(query, layer, 0.4, None), rtol=2 ** -7, atol=2 ** -8)


def test_padded_kv_and_the_scoring_view_pad_alike() -> None:
    layer = _ragged_layer(2, 3)
    keys, values = layer.padded_kv()
    sizes = layer.head_sizes
    layer.unpack()
    assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    assert layer.valid.sum(dim=-1).flatten().tolist() == sizes
    assert (layer.positions[~layer.valid] == -1).all() and (layer.keys[~layer.valid] == 0).all()
    layer.pack()
    assert layer.head_sizes == sizes


def test_padded_slots_get_exactly_zero_weight() -> None:
    """Padding filled with large finite garbage changes nothing: its weights are exactly 0."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([[9, 4, 6]])
    q_len, L = 3, 9
    keys, values = torch.randn(1, 3, L, 8, generator=g), torch.randn(1, 3, L, 8, generator=g)
    clean_k, clean_v = keys.clone(), values.clone()
    for h, n in enumerate(lengths[0].tolist()):
        keys[0, h, n:], values[0, h, n:] = 1e4, -1e4
        clean_k[0, h, n:], clean_v[0, h, n:] = 0.0, 0.0
    query = torch.randn(1, 6, q_len, 8, generator=g)
    got = explicit_attention(query, keys, values, 0.5, None, lengths=lengths, shortest=4)
    assert torch.equal(got, explicit_attention(query, clean_k, clean_v, 0.5, None, lengths=lengths, shortest=4))
    for h, n in enumerate(lengths[0].tolist()):  # and each head equals its own causal attention
        want = explicit_attention(query[:, 2 * h:2 * h + 2], keys[:, h:h + 1, :n], values[:, h:h + 1, :n], 0.5, None)
        torch.testing.assert_close(got[:, :, 2 * h:2 * h + 2], want, rtol=4 * EPS * 64, atol=4 * EPS)


# -- CriticalKV's value norms ----------------------------------------------------------------------------------------

class _Attn(torch.nn.Module):
    """An attention module as on_append reads it: only its output projection (hidden 40, 6 heads of d = 8)."""

    def __init__(self, hidden: int = 40) -> None:
        super().__init__()
        self.o_proj = torch.nn.Linear(6 * 8, hidden, bias=False)


@pytest.mark.parametrize("seed", range(4))
def test_criticalkv_value_norms_batched_equal_the_loop(seed: int) -> None:
    """The batched product (b * q <= BATCHED_TOKENS) against the per-head loop. Each projection entry is a sum of d
    products; two kernels' orders of it lie within 2 gamma_d sum|v||w| of each other (gamma_d = d eps / (1 - d eps)),
    so the L1 norm within the sum of those bounds over hidden, and the group mean adds a rounding of the mean."""
    torch.manual_seed(seed)  # the Linear's initial weights
    module = _Attn()
    policy = CriticalKV(budget=24, window=4, kernel=3)
    g = torch.Generator().manual_seed(6)
    w = module.o_proj.weight.detach()  # (hidden, h_q * d)
    gamma = 8 * EPS / (1 - 8 * EPS)
    for q in (1, 5, BATCHED_TOKENS, BATCHED_TOKENS + 1):
        values = torch.randn(1, 3, q, 8, generator=g)
        got = policy.on_append(None, module, values, values, None)["vnorm"]  # (1, 3, q)
        heads = [values[:, h // 2] @ w[:, h * 8:(h + 1) * 8].T for h in range(6)]  # (1, q, hidden) each
        want = torch.stack([p.abs().sum(dim=-1) for p in heads], dim=1).view(1, 3, 2, q).mean(dim=2)
        if q > BATCHED_TOKENS:
            assert torch.equal(got, want)  # the loop itself
            continue
        scale = torch.stack([(values[:, h // 2].abs() @ w[:, h * 8:(h + 1) * 8].abs().T).sum(dim=-1)
                             for h in range(6)], dim=1).view(1, 3, 2, q).mean(dim=2)
        assert ((got - want).abs() <= 2 * gamma * scale + 4 * EPS * want).all(), q


@pytest.mark.parametrize("b, q", [(1, 1), (2, 1), (1, 5), (1, BATCHED_TOKENS + 7), (2, BATCHED_TOKENS + 1)])
def test_criticalkv_head_columns_give_the_strided_products(b: int, q: int) -> None:
    """The norms from the per-head copy of W_O are, bit for bit, those computed through W_O's own strided view of each
    head's columns (what on_append read before the copy, and what the committed CriticalKV runs were made with): the
    same (q x d) by (d x hidden) products in both branches, batched (b * q <= BATCHED_TOKENS) and per head."""
    torch.manual_seed(3)
    module = _Attn(hidden=576)  # SmolLM2's hidden size: a real one's leading dimension for the strided view
    w = module.o_proj.weight.detach()  # (hidden, 6 * 8)
    values = torch.randn(b, 3, q, 8, generator=torch.Generator().manual_seed(q))
    got = CriticalKV(budget=24, window=4, kernel=3).on_append(None, module, values, values, None)["vnorm"]
    strided = w.view(576, 6, 8).permute(1, 2, 0)  # (h_q, d, hidden): head h's columns, in W_O's own memory
    if b * q <= BATCHED_TOKENS:
        v = values.permute(1, 0, 2, 3).reshape(3, 1, b * q, 8).expand(3, 2, b * q, 8).reshape(6, b * q, 8)
        proj = torch.bmm(v, strided)  # (h_q, b*q, hidden)
        norms = proj.abs().sum(dim=-1).view(6, b, q).permute(1, 0, 2)
    else:
        norms = torch.stack([(values[:, h // 2] @ w[:, h * 8:(h + 1) * 8].T).abs().sum(dim=-1) for h in range(6)],
                            dim=1)  # (b, h_q, q)
    assert torch.equal(got, norms.reshape(b, 3, 2, q).mean(dim=2))


def test_head_columns_kept_once_per_weight_for_every_policy() -> None:
    """The copy is made once per weight and read by every CriticalKV policy (a sweep's runs of one sample hold several
    at once); a weight changed in place is copied again (its values, not stale ones), and the copy leaves with its
    weight. Head h's columns by hand: column j of W_O belongs to head j // d."""
    import gc

    w = torch.arange(12.0).view(2, 6)  # hidden 2, h_q = 3 heads of d = 2
    first = head_columns(w, 2)  # (h_q, d, hidden)
    assert first.tolist() == [[[0.0, 6.0], [1.0, 7.0]], [[2.0, 8.0], [3.0, 9.0]], [[4.0, 10.0], [5.0, 11.0]]]
    assert head_columns(w, 2).data_ptr() == first.data_ptr()
    module = _Attn()
    kept = head_columns(module.o_proj.weight, 8).data_ptr()
    values = torch.randn(1, 3, 1, 8)
    for policy in (CriticalKV(budget=24, window=4, kernel=3), CriticalKV(budget=16, window=4, kernel=3)):
        policy.on_append(None, module, values, values, None)
    assert head_columns(module.o_proj.weight, 8).data_ptr() == kept  # both policies read the one copy
    w[0, 0] = 100.0
    assert head_columns(w, 2)[0, 0].tolist() == [100.0, 6.0]
    key = id(w)
    del w, first
    gc.collect()
    assert key not in criticalkv._HEAD_COLUMNS
