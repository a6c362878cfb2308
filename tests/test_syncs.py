"""Host syncs per decoding step (kvbench.bench.syncs): the counter on hand-made calls, then per-step counts of whole
generate calls on tiny-llama (2 layers), pinned by the file that asks for each value."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvbench.bench.syncs import SyncCounter, _is_sync, count_host_syncs
from kvbench.policies.adakv import AdaKV
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.full import Full
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.sagekv import SageKV


def test_counter_counts_each_kind_of_host_sync_once() -> None:
    x = torch.tensor([3.0, -1.0, 2.0, 0.0])
    y = x.clone()
    with torch.inference_mode(), SyncCounter() as c:  # as engine.generate runs (the aten op names depend on it)
        x.sum().item()
        int(x[0])
        float(x.max())
        bool((x > 0).any())
        x.tolist()
        x[x > 0]  # boolean-mask indexing: the result's size is the mask's count
        torch.nonzero(x)
        torch.where(x > 0)  # one argument: nonzero
        x.repeat_interleave(torch.tensor([1, 2, 1, 1]))  # tensor repeats: the size is their sum
        y[x > 0] = torch.zeros(2)  # index_put_ with a mask and tensor values
        # None of these needs a value on the host:
        y[x > 0] = 0.0  # one mask, a 0-d value: masked_fill
        x.repeat_interleave(2)
        torch.where(x > 0, x, -x)
        (x * 2 + x.max()).argmax()
        x[1:3], x[torch.tensor([0, 2])]
        torch.stack(torch.aminmax(x))
    assert [op for _, op, _ in c.events] == ["item", "item", "item", "item", "tolist", "index", "nonzero",
                                             "where", "repeat_interleave", "index_put_"]
    assert {site.rsplit(":", 1)[0].rsplit("/", 1)[-1] for _, _, site in c.events} == {"test_syncs.py"}
    assert torch.Tensor.tolist(x) == [3.0, -1.0, 2.0, 0.0]  # restored after the block
    with SyncCounter() as c2:
        pass
    assert c2.total == 0 and c.total == 10


def test_a_tolist_that_reads_through_an_aten_op_is_one_sync(monkeypatch) -> None:
    # On a GPU, Tensor.tolist copies to the host through an aten op (seen on an H100: the counter read 2 per step
    # where the engine made one tolist). Stand in for that on the CPU: a tolist that reads a value through an op.
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: [t.sum().item()] and original(t))
    x = torch.tensor([1.0, 2.0])
    with torch.inference_mode(), SyncCounter() as c:
        assert x.tolist() == [1.0, 2.0]
        x.max().item()  # a read outside a tolist still counts
    assert [op for _, op, _ in c.events] == ["tolist", "item"]


def test_device_to_host_copies_count_and_host_copies_do_not() -> None:
    """A copy to the host waits for the device. No GPU here: a `meta` tensor stands in for one (the rule only asks
    whether the source is off the CPU and the destination on it)."""
    aten, dev, host = torch.ops.aten, torch.empty(3, device="meta"), torch.empty(3)
    assert _is_sync(aten._to_copy.default, (dev,), {"device": torch.device("cpu")})
    assert _is_sync(aten.to.device, (dev, torch.device("cpu"), torch.float32), {})
    assert _is_sync(aten.copy_.default, (host, dev), {})
    assert not _is_sync(aten.copy_.default, (dev, host), {})  # host -> device: queued, nothing waits
    assert not _is_sync(aten._to_copy.default, (host,), {"device": torch.device("cpu")})
    assert not _is_sync(aten.to.dtype, (dev, torch.float16), {})


def _per_file(sites: dict[str, int], steps: int) -> dict[str, float]:
    out: Counter[str] = Counter()
    for site, k in sites.items():
        out[site.rsplit(":", 1)[0]] += k
    return {f: k / steps for f, k in out.items()}


IDS = torch.randint(8, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("policy", [Full(), KeyDiff(budget=16), CriticalKV(budget=16, window=4, kernel=3)],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once", "prefill_once_decode_evict"])
def test_uniform_policies_read_only_the_token(model, policy, protocol: str) -> None:
    """40 prompt tokens, N = 16, B = 8, 4 new tokens: 3 complete decoding steps (the 4th token's pick makes no forward),
    each reading its token and nothing else: the one read is `_pick`'s `argmax(...).tolist()` (engine/generate.py);
    the step's ids and positions go to the device from host lists (no read), its eviction's counts likewise, and
    select/evict mark slots free on the device.
    The engine's timer syncs (`sync`, a CUDA synchronise; nothing on a CPU) are counted apart: Batch.step times an
    eager eviction apart, with one on each side of it, so 2 per step when decoding evicts (blockwise,
    prefill_once_decode_evict with an evicting policy) and none otherwise (a step that only appends waits for
    nothing but its token)."""
    c = count_host_syncs(model, policy, IDS, 8, 4, protocol=protocol)
    assert c.per_step == [1, 1, 1] and c.mean == 1.0
    assert _per_file(c.by_site, 3) == {"kvbench/engine/generate.py": 1.0}
    evicts = policy.evicts and protocol != "prefill_once"
    assert c.timer_syncs == (2 * 3 if evicts else 0)


@pytest.mark.parametrize("make", [lambda: AdaKV(budget=16, window=4, kernel=3),
                                  lambda: AdaKV(budget=16, window=4, kernel=3, allocation="kvpress", n_sink=2),
                                  lambda: CriticalKV(budget=16, window=4, kernel=3, base="adakv"),
                                  lambda: SageKV(budget=16)], ids=["adakv", "adakv_kvpress_sinks", "criticalkv_adakv",
                                                                   "sagekv"])
@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once_decode_evict"])
def test_per_head_budgets_read_only_the_token(model, make, protocol: str) -> None:
    """Per-head budgets (AdaKV, CriticalKV on AdaKV, SAGE-KV) change head sizes at every decoding eviction. In the
    static cache a head's size is only which of its fixed slots hold a position: the policies' `counts` (L, b, h_kv)
    and the eviction's ranks stay on the device, so nothing is read but the token (`_pick`'s tolist,
    engine/generate.py): one read per step. The prompt's evictions read nothing either (the old engine read each
    block's sizes once for all layers: its flat per-head storage needed them on the host): the prompt's reads are
    Full's, i.e. the call's setup alone (transformers' `_get_logits_processor`, once per call, reads a value while
    building generate's processors; the layer sizes are read only for an Observer.on_step, not passed here)."""
    c = count_host_syncs(model, make(), IDS, 8, 4, protocol=protocol)
    assert c.per_step == [1, 1, 1]
    assert _per_file(c.by_site, 3) == {"kvbench/engine/generate.py": 1.0}
    assert c.prefill == count_host_syncs(model, Full(), IDS, 8, 4, protocol=protocol).prefill
    policy = make()
    assert count_host_syncs(model, policy, IDS, 8, 4, protocol="prefill_once").per_step == [1, 1, 1]


def test_per_head_layers_are_ragged_while_decoding(model) -> None:
    """The counts above are for heads really of different sizes: AdaKV's decoding leaves a layer's heads holding
    different numbers of tokens (read here from the cache an Observer.on_step is given before each pick, after the
    previous step's eviction), each layer within h_kv * N = 2 x 16 in all."""
    from kvbench.engine.generate import GenerationSettings, Observer, generate

    sizes: list[list[list[int]]] = []  # per pick: per layer, each KV head's tokens (batch row 0)

    def on_step(cache) -> None:
        sizes.append([heads[0].tolist() for heads in cache.held()])

    generate(model, AdaKV(budget=16, window=4, kernel=3), IDS, GenerationSettings(block=8, max_new_tokens=4),
             observer=Observer(on_step=on_step))
    assert len(sizes) == 4  # 4 picks: after the prompt, then after each of the 3 decoding steps' evictions
    assert any(len(set(heads)) > 1 for step in sizes[1:] for heads in step)
    assert all(sum(heads) <= 2 * 16 for step in sizes for heads in step)


def test_batch_rows_and_the_graded_branch_read_only_the_tokens(model) -> None:
    """Two runs as the rows of one cache (generate_batch; KeyDiff at N = 16 and N = 12, 4 new tokens each): one read
    per pick for both rows (`_pick` concatenates the rows' processed logits and reads the argmax once), 4 picks. A
    graded answer (teacher-forced through the fork of the cache) reads nothing per answer token: its tokens are the
    host's and its log-probabilities stay on the device until one `float` at the end. So the whole call reads, by the
    code path: 1 while setting up (transformers' `_get_logits_processor` for each row: 2 rows, 2 reads), 4 picks,
    1 `tolist` of the peaks and layer sizes at the end, and 1 `float` per row with an answer, whatever its length."""
    from kvbench.engine.generate import GenerationSettings, Job, generate_batch

    settings = GenerationSettings(block=8, max_new_tokens=4)

    def reads(answers: list[list[int] | None]) -> list[str]:
        jobs = [Job(IDS, KeyDiff(budget=n), settings, answer_ids=a) for n, a in zip((16, 12), answers)]
        with torch.inference_mode(), SyncCounter() as c:
            results = generate_batch(model, jobs)
        assert [len(r.tokens) for r in results] == [4, 4] and results[0].batch_size == 2
        return [op for _, op, _ in c.events]

    picks = ["tolist"] * 4
    assert reads([None, None]) == ["item", "item", *picks, "tolist"]  # setup (2 rows), picks, the end
    for answer in ([5, 6, 7], [5, 6, 7, 8, 9, 10]):
        assert reads([answer, None]) == ["item", "item", *picks, "tolist", "item"]
        assert reads([answer, answer]) == ["item", "item", *picks, "tolist", "item", "item"]
