"""kvbench-bench: row schema, bounded peak KV tokens, hand-computed KV bytes, baselines, config-file models, bad input.

Tiny model (tiny-llama: 2 layers, 2 KV heads, head_dim 64, float32) and very short prompts; no wall-clock assertions.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvbench import bench

N, B, NEW = 16, 8, 3
LENGTHS = (40, 72)
# K and V, 2 layers, batch 1, 2 KV heads, head_dim 64, 4 bytes per float32
BYTES_PER_TOKEN = 2 * 2 * 1 * 2 * 64 * 4


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    threads = torch.get_num_threads()
    rc = bench.main(["--arch", "tiny-llama", "--lengths", ",".join(map(str, LENGTHS)), "--budgets", str(N),
                     "--block", str(B), "--new-tokens", str(NEW), "--repeats", "2", "--policies", "keydiff",
                     "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    assert torch.get_num_threads() == threads  # --threads applies to the run only
    assert out.with_suffix(".md").read_text().count("| keydiff ") == len(LENGTHS)
    return json.loads(out.read_text())


def test_rows_schema_and_baselines(rows) -> None:
    assert [(r["policy"], r["prompt_tokens"]) for r in rows] == [
        (p, n) for n in LENGTHS for p in ("full", "streamingllm", "keydiff")]
    for r in rows:
        assert set(bench.ROW_FIELDS) <= set(r)
        assert r["prefill_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["evict_s"] >= 0
        assert r["repeats"] == 2 and r["decode_steps"] == NEW - 1
    full = [r for r in rows if r["policy"] == "full"]
    assert all(r["budget"] is None and r["block"] is None and r["evict_s"] == 0 for r in full)
    assert all(r["budget"] == N and r["block"] == B for r in rows if r["policy"] != "full")


def test_peak_kv_is_bounded_and_identical_across_lengths(rows) -> None:
    for policy in ("keydiff", "streamingllm"):
        peaks = [r["peak_kv_tokens"] for r in rows if r["policy"] == policy]
        assert peaks == [N + B] * len(LENGTHS)
        assert [r["kv_bytes_peak"] for r in rows if r["policy"] == policy] == [(N + B) * BYTES_PER_TOKEN] * 2
    for r in rows:
        if r["policy"] == "full":  # the whole prompt, then one token per decoding step but the last
            assert r["peak_kv_tokens"] == r["prompt_tokens"] + NEW - 1
            assert r["kv_bytes_peak"] == (r["prompt_tokens"] + NEW - 1) * BYTES_PER_TOKEN


def test_ratios_come_from_the_same_run(rows) -> None:
    by = {(r["policy"], r["prompt_tokens"]): r for r in rows}
    for n in LENGTHS:
        kd, floor, full = by["keydiff", n], by["streamingllm", n], by["full", n]
        assert kd["kv_vs_full"] == round((N + B) / (n + NEW - 1), 4)
        # the row's times are rounded to microseconds, its ratios to 1e-4
        assert kd["vs_floor"] == pytest.approx(kd["prefill_s"] / floor["prefill_s"] - 1, abs=2e-4)
        assert kd["evict_share"] == pytest.approx(kd["evict_s"] / kd["prefill_s"], abs=2e-4)
        assert floor["vs_floor"] == 0.0 and full["vs_floor"] is None


def test_configurations_add_baselines_once() -> None:
    cfgs = bench.configurations(["keydiff", "full", "streamingllm"], [8, 16], [100], 4)
    assert [(c.policy, c.budget, c.block) for c in cfgs] == [
        ("full", None, None, ), ("streamingllm", 8, 4), ("streamingllm", 16, 4), ("keydiff", 8, 4),
        ("keydiff", 16, 4)]
    cfgs = bench.configurations(["keydiff"], [8], [100, 200], 4, baselines=["full"], full_max_tokens=100)
    assert [(c.policy, c.prompt_tokens) for c in cfgs] == [("full", 100), ("keydiff", 100), ("keydiff", 200)]
    assert [c.policy for c in bench.configurations(["h2o"], [8], [100], 4, baselines=[])] == ["h2o"]


def test_bad_baselines_option(tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--baselines", "keydiff", "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2


@pytest.fixture
def one_thread():
    # Block forwards of a few tokens on a loaded machine: a second torch thread only adds waiting.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_model_from_config_file_with_layer_override(tmp_path, one_thread) -> None:
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=6, vocab_size=50000).save_pretrained(tmp_path)
    model, desc = bench.build_model(config=str(tmp_path / "config.json"), layers=1)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 1024
    assert model.config._attn_implementation == "kvbench_sdpa"
    assert "1 layers, hidden 128, 4/2 heads, head_dim 32" in desc
    rows = bench.run_bench(model, bench.configurations(["keydiff"], [8], [24], 4), new_tokens=2, repeats=1)
    kd = next(r for r in rows if r["policy"] == "keydiff")
    assert kd["peak_kv_tokens"] == 12 and kd["kv_bytes_peak"] == 12 * 2 * 1 * 2 * 32 * 4


def test_preset_names_a_builtin_architecture() -> None:
    assert bench._preset_builtin("tiny-llama3") == "tiny-llama3"
    assert bench._preset_builtin("llama3.2-3b") is None


@pytest.mark.parametrize("args, message", [
    (["--policies", "nosuch"], "unknown policy 'nosuch'"),
    (["--arch", "nosuch"], "unknown architecture 'nosuch'"),
    (["--policies", "keydiff", "--budgets", "1", "--policies", "snapkv"], "budget 1 must exceed"),
])
def test_bad_input_is_one_line(args, message, tmp_path, capsys) -> None:
    assert bench.main([*args, "--lengths", "16", "--out", str(tmp_path / "b.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbench-bench: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "b.json").exists()


def test_peak_memory_is_per_call() -> None:
    mem = bench.PeakMemory(torch.device("cpu"))
    if mem.method != "vmhwm_reset":
        pytest.skip("no resettable high-water mark (/proc/self/clear_refs) here")
    start = mem.start()
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    assert mem.rss_peak_mib() >= start + 250
    start = mem.start()  # the earlier peak must not leak into the next call's
    assert mem.rss_peak_mib() < start + 50


def test_evict_timer_counts_prefill_evictions_only() -> None:
    calls = []

    class Fake:
        def evict(self, layer, observe=None):
            calls.append((layer, observe))
            return True

    policy = Fake()
    timer = bench._EvictTimer(policy, torch.device("cpu"))
    assert policy.evict("a") is True and policy.evict("b", "obs") is True
    after_prefill = timer.prefill_s
    assert after_prefill > 0
    timer.on_logits(torch.zeros(1, 4))
    policy.evict("c")
    assert timer.prefill_s == after_prefill and calls == [("a", None), ("b", "obs"), ("c", None)]
