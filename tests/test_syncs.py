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
    """40 prompt tokens, N = 16, B = 8, 4 new tokens: 3 complete decoding steps, each reading its token and nothing
    else. The engine's CUDA timers wrap every decoding eviction (2 per step) and are counted apart."""
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
    """Per-head budgets (AdaKV, CriticalKV on AdaKV, SAGE-KV) change head sizes at every decoding eviction. The
    policies decide on host counts (the layer's head sizes, the protected counts) and pad their selection to the
    view's width, so they read nothing; the new sizes, which the flat per-head storage needs on the host, are read
    with the next token in the same `tolist` (engine/generate.py): one read per step. The prompt's evictions read
    each block's sizes once for all layers (2 layers here: at most one read per prompt forward)."""
    c = count_host_syncs(model, make(), IDS, 8, 4, protocol=protocol)
    assert c.per_step == [1, 1, 1]
    assert _per_file(c.by_site, 3) == {"kvbench/engine/generate.py": 1.0}
    forwards = 40 // 8 if protocol == "blockwise" else 1
    assert c.prefill <= count_host_syncs(model, Full(), IDS, 8, 4, protocol=protocol).prefill + forwards
    policy = make()
    assert count_host_syncs(model, policy, IDS, 8, 4, protocol="prefill_once").per_step == [1, 1, 1]


def test_per_head_layers_are_ragged_while_decoding(model) -> None:
    """The counts above are for layers really stored per head: AdaKV's decoding leaves heads of different sizes, known
    on the host after every step."""
    from kvbench.engine.cache import EvictingCache
    from kvbench.engine.generate import GenerationSettings, generate

    seen: list[EvictingCache] = []
    real_init = EvictingCache.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        seen.append(self)

    EvictingCache.__init__ = spy
    try:
        generate(model, AdaKV(budget=16, window=4, kernel=3), IDS, GenerationSettings(block=8, max_new_tokens=4))
    finally:
        EvictingCache.__init__ = real_init
    layers = seen[0].evicting_layers()
    assert any(layer.ragged for layer in layers) and not any(layer.pending() for layer in layers)
    for layer in layers:
        sizes = layer.head_lengths()
        assert sum(sizes) <= 16 * len(sizes)  # the layer total within h_kv * N
        if layer.ragged:
            assert layer.lengths.flatten().tolist() == sizes
