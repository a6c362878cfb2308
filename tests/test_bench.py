"""kvbench-bench: row schema, bounded peak KV tokens, hand-computed KV bytes, baselines, config-file models, bad input.

Tiny model (tiny-llama: 2 layers, 2 KV heads, head_dim 64, float32) and very short prompts; no wall-clock assertions.
"""

from __future__ import annotations

import math

import json

import pytest
import torch

from kvbench.bench import cli as bench
from kvbench.bench import goals, measure, setup
from kvbench.engine.cache import IMPL

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
    return json.loads(out.read_text())["rows"]


def test_rows_schema_and_baselines(rows) -> None:
    assert [(r["policy"], r["prompt_tokens"]) for r in rows] == [
        (p, n) for n in LENGTHS for p in ("full", "streamingllm", "keydiff")]
    for r in rows:
        assert set(measure.ROW_FIELDS) <= set(r)
        assert r["prefill_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["evict_s"] >= 0
        assert r["repeats"] == 2 and r["decode_steps"] == NEW - 1
        assert r["evict_s"] >= 0 and r["evict_prefill_s"] >= 0 and r["evict_decode_s"] >= 0
        # the eviction medians are those of the rounds (2 rounds: the mean of the two)
        for part in ("evict_prefill_s", "evict_decode_s"):
            assert len(r[f"{part}_rounds"]) == 2
            assert r[part] == pytest.approx(sum(r[f"{part}_rounds"]) / 2, abs=2e-6)
    full = [r for r in rows if r["policy"] == "full"]
    assert all(r["budget"] is None and r["block"] is None and r["evict_s"] == 0 for r in full)
    assert all(r["evict_prefill_s"] == 0 and r["evict_decode_s"] == 0 for r in full)
    assert all(r["budget"] == N and r["block"] == B for r in rows if r["policy"] != "full")
    # one untimed count per (policy, budget): these loops read the greedy token and nothing else
    assert all(r["host_syncs_per_step"] == 1.0 and r["host_syncs_max_step"] == 1 for r in rows)
    assert all(list(r["host_sync_sites"].values()) == [1.0] for r in rows)


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
        assert kd["evict_share"] == pytest.approx(kd["evict_s"] / kd["total_s"], abs=2e-4)
        assert kd["prefill_evict_share"] <= 1 and kd["vs_hf_forward"] is None and kd["decode_vs_hf"] is None
        assert floor["vs_floor"] == 0.0 and full["vs_floor"] is None


def test_configurations_add_baselines_once() -> None:
    cfgs = measure.configurations(["keydiff", "full", "streamingllm"], [8, 16], [100], 4)
    assert [(c.policy, c.budget, c.block) for c in cfgs] == [
        ("full", None, None, ), ("streamingllm", 8, 4), ("streamingllm", 16, 4), ("keydiff", 8, 4),
        ("keydiff", 16, 4)]
    cfgs = measure.configurations(["keydiff"], [8], [100, 200], 4, baselines=["full"], full_max_tokens=100)
    assert [(c.policy, c.prompt_tokens) for c in cfgs] == [("full", 100), ("keydiff", 100), ("keydiff", 200)]
    assert [c.policy for c in measure.configurations(["h2o"], [8], [100], 4, baselines=[])] == ["h2o"]


def test_bad_baselines_option(tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--baselines", "keydiff", "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2


def test_together_goes_with_a_sweep(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--together", "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2 and "--together goes with --sweep" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_model_from_config_file_with_layer_override(tmp_path, one_thread) -> None:
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=6, vocab_size=50000).save_pretrained(tmp_path)
    model, desc = setup.build_model(config=str(tmp_path / "config.json"), layers=1)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 1024
    assert model.config._attn_implementation == IMPL  # the static slot cache's attention (kvbench.engine.cache)
    assert "1 layers, hidden 128, 4/2 heads, head_dim 32" in desc
    rows = measure.run_bench(model, measure.configurations(["keydiff"], [8], [24], 4), new_tokens=2, repeats=1)
    kd = next(r for r in rows if r["policy"] == "keydiff")
    assert kd["peak_kv_tokens"] == 12 and kd["kv_bytes_peak"] == 12 * 2 * 1 * 2 * 32 * 4


def test_warm_ups_run_hf_at_its_own_shape_on_a_gpu_only() -> None:
    # HF rows: hf-decode at N = 8 (its prompt is the first 8 tokens), hf-forward at each length; keydiff's first
    # configuration is (N 8, B 4, 24 tokens), warmed on min(24, 8 + 2 * 4) = 16 tokens with 2 new tokens.
    configs = measure.configurations(["keydiff"], [8], [24, 48], 4, baselines=["hf"])
    C = measure.Config
    short = (C("keydiff", 8, 4, 16), 2)
    assert measure.warm_ups(configs, 5, "cuda") == [
        (C("hf-decode", 8, None, 8), 5), (C("hf-forward", None, None, 24), 5), (C("hf-forward", None, None, 48), 5),
        short]
    # On a CPU one short call per policy: hf-decode on min(8, 8 + 128) = 8 tokens, hf-forward on min(24, 128).
    assert measure.warm_ups(configs, 5, "cpu") == [
        (C("hf-decode", 8, None, 8), 2), (C("hf-forward", None, None, 24), 2), short]


def test_preset_names_a_builtin_architecture() -> None:
    assert setup._preset_builtin("tiny-llama3") == "tiny-llama3"
    assert setup._preset_builtin("llama3.2-3b") is None


@pytest.mark.parametrize("args, message", [
    (["--policies", "nosuch"], "unknown policy 'nosuch'"),
    (["--arch", "nosuch"], "unknown architecture 'nosuch'"),
    (["--policies", "keydiff", "--budgets", "1", "--policies", "snapkv"], "budget 1 must exceed"),
    (["--device", "nope"], "unknown device 'nope'"),  # was a traceback (exit 1)
])
def test_bad_input_is_one_line(args, message, tmp_path, capsys) -> None:
    assert bench.main([*args, "--lengths", "16", "--out", str(tmp_path / "b.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbench-bench: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("option", ["--repeats", "--block", "--threads", "--new-tokens", "--layers"])
def test_zero_is_refused_not_read_as_the_presets(option, tmp_path, capsys) -> None:
    # 0 was a false value, so `a.repeats or preset` ran the preset's rounds (and block, threads) instead
    with pytest.raises(SystemExit) as e:
        bench.main([option, "0", "--lengths", "16", "--out", str(tmp_path / "b.json"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == ("kvbench-bench: error: --block, --new-tokens, --repeats, --threads and "
                                             "--layers must be positive")
    assert not (tmp_path / "b.json").exists()


def test_peak_memory_is_per_call() -> None:
    mem = measure.PeakMemory(torch.device("cpu"))
    if mem.method != "vmhwm_reset":
        pytest.skip("no resettable high-water mark (/proc/self/clear_refs) here")
    start = mem.start()
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    assert mem.rss_peak_mib() >= start + 250
    start = mem.start()  # the earlier peak must not leak into the next call's
    assert mem.rss_peak_mib() < start + 50


def test_generate_splits_eviction_time_into_prefill_and_decode() -> None:
    """A fake clock advanced only inside the policy's score (called once per eviction, for every evicting layer at
    once: kvbench/engine/cache.py `select` ranks all layers in one call): 1 s per call while the prompt is processed,
    100 s per call while decoding. 40 prompt tokens in blocks of 8 = 5 blocks, each followed by one eviction; 3 new
    tokens = 2 decoding steps, each followed by one eviction. The old engine evicted the prompt layer by layer (5 x 2
    calls); the static engine makes one call for both layers, hence 5 x 1 (and 2 x 1 while decoding)."""
    from kvbench.engine import generate as engine_generate
    from kvbench.engine.cache import install
    from kvbench.models.tiny import build_tiny_model
    from kvbench.policies.keydiff import KeyDiff

    clock = [0.0]

    class Ticking(KeyDiff):
        def score(self, view):
            clock[0] += 100.0 if view.decoding else 1.0
            return super().score(view)

    model, _ = build_tiny_model("tiny-llama")
    install(model)
    res = engine_generate.generate(model, Ticking(budget=16), list(range(10, 50)),
                                   engine_generate.GenerationSettings(block=8, max_new_tokens=3),
                                   observer=engine_generate.Observer(clock=lambda: clock[0]))
    assert res.decode_steps == 2
    assert res.evict_prefill_s == 5 * 1.0
    assert res.evict_decode_s == 2 * 100.0
    assert res.evict_s == res.evict_prefill_s + res.evict_decode_s
    assert res.prefill_s == 5 * 1.0 and res.decode_s == 2 * 100.0  # the same clock times the phases


def _row(policy: str, n: int, prefill: float, decode: float, evict_pre: float, evict_dec: float,
         rss: float = 500.0, kv: int = 2**20, budget: int = 64) -> dict:
    return {"policy": policy, "prompt_tokens": n, "budget": budget, "block": 16, "prefill_s": prefill,
            "decode_s": decode, "decode_steps": 10, "decode_ms_per_token": 100 * decode, "evict_prefill_s": evict_pre,
            "evict_decode_s": evict_dec, "total_s": prefill + decode, "evict_s": evict_pre + evict_dec,
            "evict_share": (evict_pre + evict_dec) / (prefill + decode), "kv_bytes_peak": kv,
            "peak_rss_mib": rss, "rss_start_mib": 400.0}


def test_goals_are_ratios_of_rows_of_one_run() -> None:
    rows = [
        {**_row(setup.HF_DECODE, 64, 0.5, 1.0, 0, 0), "budget": 64},  # 100 ms per token
        {**_row(setup.HF_FORWARD, 8000, 10.0, 2.0, 0, 0), "budget": None},
        _row("keydiff", 2000, 2.0, 1.01, 0.05, 0.05),  # 0.10 / 3.01 = 3.3 % evict, 1.01x decode
        _row("keydiff", 8000, 9.0, 1.01, 0.2, 0.1, rss=510.0),  # 0.90x HF forward, +10 MiB
        _row("snapkv", 2000, 2.0, 1.3, 0.3, 0.1),  # 0.4 / 3.3 = 12.1 % evict, 1.30x decode
        _row("snapkv", 8000, 11.0, 1.3, 0.8, 0.3, rss=530.0),  # 1.10x HF forward, +30 MiB
        _row("knorm", 2000, 2.0, 1.0, 0.05, 0.05, kv=2**20),
        _row("knorm", 8000, 16.0, 1.0, 0.05, 0.05, rss=540.0, kv=2**20 + 30 * 2**20),  # +40 MiB, KV +30 MiB
        _row("tova", 2000, 2.0, 1.05, 0.1, 0.1),  # 0.2 / 3.05 = 6.6 % evict; 1.05x decode: within 1.10x
        _row("hashevict", 2000, 2.0, 1.05, 0.05, 0.05),  # 1.05x decode: over the score-free policies' 1.02x
    ]
    goals.add_ratios(rows)
    by = {(g["goal"].split(" ")[0], g["policy"]): g for g in goals.goals(rows)}
    assert by["eviction", "keydiff"]["passed"] and not by["eviction", "snapkv"]["passed"]  # the 8 % limit
    assert by["eviction", "snapkv"]["detail"] == "2000: 12.1 %, 8000: 8.9 %"
    assert by["eviction", "tova"]["detail"] == "2000: 6.6 %" and by["eviction", "tova"]["passed"]
    assert by["decode", "keydiff"]["passed"] and not by["decode", "snapkv"]["passed"]
    assert by["decode", "keydiff"]["detail"] == "2000: 1.01x, 8000: 1.01x"
    assert by["decode", "tova"]["passed"] and not by["decode", "hashevict"]["passed"]  # 1.10x vs 1.02x limits
    assert by["decode", "hashevict"]["goal"] == "decode per token <= 1.02x HF's at cache size N"
    assert by["decode", "tova"]["goal"] == "decode per token <= 1.10x HF's at cache size N"
    assert by["prefill", "keydiff"]["detail"] == "8000: 0.90x" and by["prefill", "keydiff"]["passed"]
    assert not by["prefill", "snapkv"]["passed"]
    assert ("end", "keydiff") not in by  # KeyDiff is the reference
    assert by["end", "snapkv"]["detail"] == "2000: 1.10x, 8000: 1.23x" and by["end", "snapkv"]["passed"]
    assert not by["end", "knorm"]["passed"]  # 17.0 s vs KeyDiff's 10.01 s at 8000
    assert by["peak", "keydiff"]["passed"] and not by["peak", "snapkv"]["passed"]  # +10 / +30 MiB, KV flat
    assert by["peak", "knorm"]["passed"]  # +40 MiB, of which 30 MiB are the KV of its unbounded layers
    lines = goals.goal_lines(goals.goals(rows))
    assert [ln.split(":")[0] for ln in lines[:6]] == [
        "PASS  eviction <= 8 % of the run", "FAIL  eviction <= 8 % of the run", "PASS  eviction <= 8 % of the run",
        "PASS  eviction <= 8 % of the run", "PASS  eviction <= 8 % of the run",
        "PASS  decode per token <= 1.02x HF's at cache size N"]  # by goal, then by policy in run order
    # snapkv: all but end to end (4); knorm: prefill, end to end; hashevict: decode
    assert sum(ln.startswith("FAIL") for ln in lines) == 7


def test_a_compiled_rows_eviction_is_not_judged() -> None:
    """NAME+compiled evicts inside each forward's compiled graph, so its evict_s is 0 by construction, not a
    measurement: no eviction goal for it (it would read PASS at 0.0 %), and its table cells say "in graph"; the eager
    row beside it is judged as before (0.10 / 3.01 = 3.3 %)."""
    rows = [{**_row("keydiff", 2000, 2.0, 1.01, 0.05, 0.05), "peak_kv_tokens": 80},
            {**_row("keydiff+compiled", 2000, 2.0, 1.0, 0.0, 0.0), "peak_kv_tokens": 80}]
    goals.add_ratios(rows)
    evictions = [g for g in goals.goals(rows) if g["goal"].startswith("eviction")]
    assert [(g["policy"], g["detail"]) for g in evictions] == [("keydiff", "2000: 3.3 %")]
    table = goals.markdown_table(rows).splitlines()
    assert [[c.strip() for c in ln.split("|")[9:11]] for ln in table[2:]] == [["0.050+0.050", "3.3 %"],
                                                                             ["in graph", ""]]


def test_a_compiled_row_on_cuda_is_judged_by_the_cuda_graphs_torch_skipped() -> None:
    """On CUDA a compiled forward that torch does not make a CUDA graph launches every kernel: PASS with none
    skipped, FAIL with any; no line on a CPU (no CUDA graphs there) nor for an eager row."""
    def row(name: str, device: str, skips: int | None) -> dict:
        extra = {} if skips is None else {"cudagraph_skips": skips}
        return {**_row(name, 2000, 2.0, 1.0, 0.0, 0.0), "peak_kv_tokens": 80, "device": device, **extra}

    rows = [row("keydiff", "cuda:0", None), row("keydiff+compiled", "cuda:0", 0), row("snapkv+compiled", "cuda:0", 2),
            row("h2o+compiled", "cpu", 0)]
    goals.add_ratios(rows)
    lines = [(g["policy"], g["passed"], g["detail"]) for g in goals.goals(rows) if "CUDA graph" in g["goal"]]
    assert lines == [("keydiff+compiled", True, "2000: 0 skipped"), ("snapkv+compiled", False, "2000: 2 skipped")]


def test_the_decoding_goal_over_rounds_is_a_one_sided_t_bound_of_the_paired_ratios() -> None:
    # HF's decoding 3.0 s in each of 3 rounds (10 steps: 300 ms per token). Per-round ratios and their logs, worked by
    # hand (bounds exp(mean log -/+ t(0.95, 2) se), t = 2.920): tova 3.30, 3.40, 3.20 s -> 1.10, 1.1333, 1.0667, logs
    # 0.09531, 0.12516, 0.06454: mean 0.09500 (geometric mean 1.0997), sd 0.03031, se 0.01750: bounds exp(0.04390) =
    # 1.04x and exp(0.14610) = 1.16x, on both sides of 1.10x. h2o 3.00, 3.06, 3.03 -> 1.00, 1.02, 1.01: mean log
    # 0.00992, se 0.00572: 0.99x and 1.03x, within 1.10x. snapkv 3.60, 3.66, 3.63 -> 1.20, 1.22, 1.21: mean log
    # 0.19060 (1.21x), se 0.00477: bounds 1.19x and 1.23x, over it.
    def row(policy: str, rounds: list[float]) -> dict:
        median = sorted(rounds)[1]
        return {**_row(policy, 2000, 2.0, median, 0.05, 0.05), "decode_s_rounds": rounds}

    rows = [{**row(setup.HF_DECODE, [3.0, 3.0, 3.0]), "budget": 64}, row("tova", [3.30, 3.40, 3.20]),
            row("h2o", [3.00, 3.06, 3.03]), row("snapkv", [3.60, 3.66, 3.63])]
    goals.add_ratios(rows)
    lines = [ln for ln in goals.goal_lines(goals.goals(rows))
             if ln.split("  ")[1].startswith("decode") and not ln.startswith("HOLM")]
    assert lines == [
        "NOT RESOLVED  decode per token <= 1.10x HF's at cache size N: tova (2000: 1.10x, geometric mean 1.10x, "
        "one-sided 95 % bounds 1.04x and 1.16x over 3 paired rounds)",
        "PASS  decode per token <= 1.10x HF's at cache size N: h2o (2000: 1.01x, geometric mean 1.01x, one-sided 95 % "
        "bounds 0.99x and 1.03x over 3 paired rounds)",
        "FAIL  decode per token <= 1.10x HF's at cache size N: snapkv (2000: 1.21x, geometric mean 1.21x, one-sided "
        "95 % bounds 1.19x and 1.23x over 3 paired rounds)"]
    by = {g["policy"]: g["passed"] for g in goals.goals(rows) if g["goal"].startswith("decode")}
    assert by == {"tova": None, "h2o": True, "snapkv": False}


def test_a_decoding_line_says_when_a_layer_holds_more_than_n_plus_b() -> None:
    """K-norm leaves its first two layers whole: its peak (4127 tokens a head) is over N + B = 64 + 16 = 80, so its
    decoding is not at HF's cache size N there, and the line says so (after the bounds, over rounds); a bounded row
    (80) says nothing."""
    rows = [{**_row(setup.HF_DECODE, 64, 0.5, 1.0, 0, 0), "budget": 64},
            {**_row("knorm", 2000, 2.0, 1.05, 0.05, 0.05), "peak_kv_tokens": 4127},
            {**_row("streamingllm", 2000, 2.0, 1.0, 0.05, 0.05), "peak_kv_tokens": 80}]
    goals.add_ratios(rows)
    by = {g["policy"]: g["detail"] for g in goals.goals(rows) if g["goal"].startswith("decode")}
    assert by == {"knorm": "2000: 1.05x; some layer holds up to 4127 tokens a head, over N + B = 80, where HF's holds N",
                  "streamingllm": "2000: 1.00x"}
    rows[1]["decode_s_rounds"], rows[0]["decode_s_rounds"] = [1.05, 1.05], [1.0, 1.0]
    knorm = next(g for g in goals.goals(rows) if g["goal"].startswith("decode") and g["policy"] == "knorm")
    assert knorm["detail"].endswith("over 2 paired rounds; some layer holds up to 4127 tokens a head, over N + B = 80, "
                                    "where HF's holds N")


def test_a_decoding_line_says_when_hfs_reference_held_the_policys_per_layer_sizes() -> None:
    """With HF's decoding beside each call at the call's own per-layer sizes (`hf_layer_sizes`), the comparison is
    like for like: the line names the sizes' range instead of the over-N + B warning; without rounds beside it (the
    hf-decode row's own calls, at N) the warning stays."""
    rows = [{**_row(setup.HF_DECODE, 64, 0.5, 1.0, 0, 0), "budget": 64, "decode_s_rounds": [1.0, 1.0]},
            {**_row("knorm", 2000, 2.0, 1.05, 0.05, 0.05), "peak_kv_tokens": 2031, "decode_s_rounds": [1.05, 1.05],
             "hf_decode_s_rounds": [1.0, 1.0], "hf_decode_steps": 10, "hf_layer_sizes": [2000, 2000, 64, 64]}]
    goals.add_ratios(rows)
    line = next(g for g in goals.goals(rows) if g["goal"].startswith("decode"))
    assert line["detail"].endswith("over 2 calls each beside HF's; HF's beside each call held the policy's per-layer "
                                   "sizes (64-2000 tokens a head)")
    rows[1] = {k: v for k, v in rows[1].items() if k != "hf_decode_s_rounds"}
    line = next(g for g in goals.goals(rows) if g["goal"].startswith("decode"))
    assert line["detail"].endswith("over 2 paired rounds; some layer holds up to 2031 tokens a head, over N + B = 80, "
                                   "where HF's holds N")


def test_a_decoding_line_says_when_its_reference_was_in_lockstep() -> None:
    """The row's `hf_reference` (kvbench-bench --hf-lockstep) names how HF's reference was made; the test is the same
    (ratios 1.05 / 1.0 in both rounds: bounds 1.05x and 1.05x)."""
    rows = [{**_row(setup.HF_DECODE, 64, 0.5, 1.0, 0, 0), "budget": 64, "decode_s_rounds": [1.0, 1.0]},
            {**_row("knorm", 2000, 2.0, 1.05, 0.05, 0.05), "peak_kv_tokens": 2031, "decode_s_rounds": [1.05, 1.05],
             "hf_decode_s_rounds": [1.0, 1.0], "hf_decode_steps": 10, "hf_layer_sizes": [2000, 2000, 64, 64],
             "hf_reference": "lockstep"}]
    goals.add_ratios(rows)
    line = next(g for g in goals.goals(rows) if g["goal"].startswith("decode"))
    assert line["detail"] == ("2000: 1.05x, geometric mean 1.05x, one-sided 95 % bounds 1.05x and 1.05x over 2 calls "
                              "each in lockstep with HF's; HF's in lockstep with each call held the policy's "
                              "per-layer sizes (64-2000 tokens a head)")


def test_hf_layer_sizes_are_one_fewer_than_each_layer_held_at_its_first_decoding_step() -> None:
    # the first decoding step's token is counted in layer_tokens; HF's reference appends its own in its step
    assert measure.hf_layer_sizes([17, 17], 16) is None  # every layer at N: the plain reference
    assert measure.hf_layer_sizes([41, 17], 16) == [40, 16]
    assert measure.hf_layer_sizes([20, 14], 16) == [19, 13]  # a pyramid: more below, fewer above
    assert measure.hf_layer_sizes(None, 16) is None and measure.hf_layer_sizes([41, 17], None) is None


@pytest.mark.parametrize(("policy", "held"), [("streamingllm", [17, 17]), ("knorm", [41, 17]), ("adakv", None)])
def test_layer_tokens_are_what_each_layer_held_at_the_first_decoding_step(policy: str, held: list[int] | None) -> None:
    """40 prompt tokens in blocks of 8 at N = 16 on the 2-layer tiny model: an evicting layer holds 16 a head after
    the prompt, 17 with the first decoding step's token; K-norm told to skip layer 0 leaves it whole (40 + 1). AdaKV's
    ragged heads: the static engine reports each layer's fullest head (GenerationResult.layer_tokens; the old engine
    gave the layer's total over its heads), which its allocation decides, so that one is checked against the cache
    read at the first step, where its heads share at most 2 x 16 slots (the fullest holds at most 32 + 1).
    SlotCache.layer_tokens gives the same list to an Observer.on_step once the first decoding step is done, None
    before it. No decoding step: None."""
    from kvbench.engine import generate as engine_generate
    from kvbench.engine.cache import install
    from kvbench.models.tiny import build_tiny_model

    model, _ = build_tiny_model("tiny-llama")
    install(model)
    from kvbench.policies.adakv import AdaKV
    from kvbench.policies.knorm import KNorm

    for new in (3, 1):
        pol = {"knorm": lambda: KNorm(budget=16, skip_layers=(0,)),
               "adakv": lambda: AdaKV(budget=16, window=4, kernel=3),
               "streamingllm": lambda: setup.make_policy("streamingllm", 16, 0)}[policy]()
        steps: list[tuple[list[list[int]], list[int] | None]] = []  # (each layer's heads' tokens, layer_tokens)

        def on_step(cache) -> None:
            steps.append(([h[0].tolist() for h in cache.held()], cache.layer_tokens))

        res = engine_generate.generate(model, pol, list(range(10, 50)),
                                       engine_generate.GenerationSettings(block=8, max_new_tokens=new),
                                       observer=engine_generate.Observer(on_step=on_step))
        if new == 1:
            assert res.layer_tokens is None and len(steps) == 1 and steps[0][1] is None
            continue
        # the first pick's cache holds the prompt's tokens: the first decoding step adds one to every head
        after_prompt = [max(heads) + 1 for heads in steps[0][0]]
        if held is None:  # AdaKV
            assert all(sum(heads) <= 2 * 16 for heads in steps[0][0]) and all(n <= 33 for n in after_prompt)
            held = after_prompt
        assert res.layer_tokens == after_prompt == held
        assert [d for _, d in steps] == [None, held, held]  # 3 picks; known once the first step is done


def test_hfs_loop_at_per_layer_sizes_keeps_each_layers_latest_tokens() -> None:
    """hf_generate with layer_sizes [30, 12] after a 40-token forward, 3 new tokens (2 one-token steps): the layers
    end at 32 and 14 tokens a head, 46 tokens of K and V at 2 KV heads x 64 floats x 4 bytes x 2 (K, V) = 1024 bytes
    a token. Sizes for another number of layers, or over the prompt, are one error."""
    from kvbench.engine.cache import install
    from kvbench.models.tiny import build_tiny_model

    model, _ = build_tiny_model("tiny-llama")
    install(model)
    m = measure.hf_generate(model, list(range(10, 50)), 3, layer_sizes=[30, 12])
    assert m["decode_steps"] == 2 and len(m["tokens"]) == 3
    assert m["peak_kv_tokens"] == 32 and m["kv_bytes_peak"] == (32 + 14) * BYTES_PER_TOKEN // 2
    for bad in ([50, 12], [30]):
        with pytest.raises(setup.BenchError, match="cannot keep"):
            measure.hf_generate(model, list(range(10, 50)), 3, layer_sizes=bad)


def _p_under_3(ratios: list[float], line: float) -> float:
    """By hand, for three paired ratios: the one-sided p that their geometric mean is under `line`, a t test of their
    logs with 2 degrees of freedom, whose CDF is 1/2 + t / (2 sqrt(2 + t^2))."""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    t = (mean - math.log(line)) / (math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3))
    return 0.5 + t / (2 * math.sqrt(2 + t * t))


def test_the_decoding_lines_over_rounds_are_corrected_as_one_family_by_holm() -> None:
    # The rows of the test above, and h2o_original at 3.00, 3.06, 3.18 s: ratios 1.00, 1.02, 1.06, logs 0, 0.019803,
    # 0.058269: mean 0.026024, sd 0.029628, se 0.017106, upper bound exp(0.026024 + 2.920 x 0.017106) = 1.079x: PASS
    # at 95 % on its own. One-sided p values by hand on the logs against log 1.10 = 0.095310 (`_p_under_3`):
    p_h2o = _p_under_3([1.00, 1.02, 1.01], 1.10)  # under the line: t = -14.94, 0.00223
    p_snap = 1 - _p_under_3([1.20, 1.22, 1.21], 1.10)  # over it: t = 19.97, 0.00125
    p_orig = _p_under_3([1.00, 1.02, 1.06], 1.10)  # t = -4.050, 0.0279
    p_tova = _p_under_3([1.10, 3.40 / 3, 3.20 / 3], 1.10)  # geometric mean 1.0997, just under: t = -0.017, 0.494
    assert (round(p_h2o, 5), round(p_snap, 5), round(p_orig, 4), round(p_tova, 3)) == (0.00223, 0.00125, 0.0279, 0.494)
    # Holm over 4, by hand: snapkv 4 x 0.00125 = 0.0050, h2o 3 x 0.00223 = 0.0067, h2o_original 2 x 0.0279 = 0.056
    # (over 5 %: its PASS does not survive), tova 0.494
    def row(policy: str, rounds: list[float]) -> dict:
        return {**_row(policy, 2000, 2.0, sorted(rounds)[1], 0.05, 0.05), "decode_s_rounds": rounds}

    rows = [{**row(setup.HF_DECODE, [3.0, 3.0, 3.0]), "budget": 64}, row("tova", [3.30, 3.40, 3.20]),
            row("h2o", [3.00, 3.06, 3.03]), row("snapkv", [3.60, 3.66, 3.63]), row("h2o_original", [3.00, 3.06, 3.18])]
    goals.add_ratios(rows)
    results = goals.goals(rows)
    assert {g["policy"]: g["passed"] for g in results if g["goal"].startswith("decode")} == {
        "tova": None, "h2o": True, "snapkv": False, "h2o_original": True}
    adjusted = {"snapkv": 4 * p_snap, "h2o": 3 * p_h2o, "h2o_original": 2 * p_orig, "tova": p_tova}
    assert goals.holm_line(results) == (
        "HOLM  decode per token, the 4 lines over rounds as one family (family-wise 5 %, adjusted p): "
        f"PASS h2o ({adjusted['h2o']:.2g}); FAIL snapkv ({adjusted['snapkv']:.2g}); "
        f"not resolved tova ({adjusted['tova']:.2g}), h2o_original ({adjusted['h2o_original']:.2g})")
    assert [f"{adjusted[k]:.2g}" for k in ("snapkv", "h2o", "h2o_original", "tova")] == ["0.005", "0.0067", "0.056",
                                                                                          "0.49"]
    lines = goals.goal_lines(results)
    decode = [i for i, ln in enumerate(lines) if ln.split("  ")[1].startswith("decode") and not ln.startswith("HOLM")]
    assert lines[decode[-1] + 1] == goals.holm_line(results)  # right after the lines it corrects
    # one round: no p value, no family line
    assert goals.holm_line(goals.goals([{**r, "decode_s_rounds": r["decode_s_rounds"][:1]} for r in rows])) is None


def test_hf_beside_pairs_each_call_with_hfs_decoding_measured_right_after_it() -> None:
    # 10 decoding steps. The hf-decode row's own rounds 3.0, 3.0, 3.0 s (300 ms a token) would pair snapkv's
    # 3.00, 3.60, 3.30 s into ratios 1.00, 1.20, 1.10: mean 1.10, sd 0.10, bounds 1.10 -/+ 2.920 x 0.10 / sqrt(3) =
    # 0.93x and 1.27x, not resolved. HF's calls right beside snapkv's took 2.50, 3.00, 2.75 s (a slow middle stretch
    # for both): ratios 1.20, 1.20, 1.20, sd 0: both bounds 1.20x, over 1.10x; the row's ratio is its median 3.30 s
    # over the references' median 2.75 s: 1.20x.
    hf = {**_row(setup.HF_DECODE, 2000, 2.0, 3.0, 0, 0), "budget": 64, "decode_s_rounds": [3.0, 3.0, 3.0]}
    snap = {**_row("snapkv", 2000, 2.0, 3.30, 0.05, 0.05), "decode_s_rounds": [3.00, 3.60, 3.30]}
    beside = {**snap, "hf_decode_s_rounds": [2.50, 3.00, 2.75], "hf_decode_steps": 10}
    for rows in ([hf, snap], [hf, beside]):
        goals.add_ratios(rows)
    assert snap["decode_vs_hf"] == 1.1 and beside["decode_vs_hf"] == 1.2
    alone, paired = ([g for g in goals.goals(rs) if g["goal"].startswith("decode")][0] for rs in ([hf, snap],
                                                                                                   [hf, beside]))
    assert alone["passed"] is None and alone["detail"].endswith("bounds 0.94x and 1.28x over 3 paired rounds")
    assert paired["passed"] is False
    assert paired["detail"] == ("2000: 1.20x, geometric mean 1.20x, one-sided 95 % bounds 1.20x and 1.20x over 3 calls "
                                "each beside HF's")


def test_hf_beside_measures_hf_after_every_kvbench_call(tmp_path, one_thread) -> None:
    """--hf-beside: every kvbench row carries one HF decoding per round (HF's rows none), and bad combinations are
    one line, exit 2."""
    from kvbench.models.tiny import builtin_dir

    out = tmp_path / "b.json"
    args = ["--model", str(builtin_dir("tiny-llama")), "--lengths", "40", "--budgets", "16", "--block", "8",
            "--new-tokens", "3", "--policies", "keydiff", "--clock", "cpu", "--no-syncs", "--out", str(out), "--quiet"]
    with_knorm = ["keydiff,knorm" if a == "keydiff" else a for a in args]
    assert bench.main([*with_knorm, "--repeats", "2", "--hf-beside"]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("keydiff", "streamingllm", "knorm"):
        assert len(rows[name]["hf_decode_s_rounds"]) == 2 and rows[name]["hf_decode_steps"] == 3 - 1
    # K-norm leaves both layers of the tiny model whole (its first two): HF's reference beside it holds the 40-token
    # prompt in both, where beside KeyDiff (16 a layer) it is the plain one at N
    assert rows["knorm"]["hf_layer_sizes"] == [40, 40] and rows["keydiff"]["hf_layer_sizes"] is None
    assert "hf_decode_s_rounds" not in rows["hf-decode"] and "hf_decode_s_rounds" not in rows["hf-forward"]
    assert "HF's decoding measured again beside every kvbench call" in out.with_suffix(".md").read_text()
    for bad in (["--baselines", "full"], ["--batch", "1"]):
        with pytest.raises(SystemExit) as e:
            bench.main([*args, "--hf-beside", *bad])
        assert e.value.code == 2


def test_host_sync_goal_reads_the_worst_step_per_budget() -> None:
    def row(policy: str, n: int, mean: float | None, worst: int | None) -> dict:
        return {**_row(policy, n, 2.0, 1.0, 0.05, 0.05), "peak_kv_tokens": 80, "host_syncs_per_step": mean,
                "host_syncs_max_step": worst}

    rows = [row("keydiff", 2000, 1.0, 1), row("keydiff", 8000, 1.0, 1), row("adakv", 2000, 16.5, 17),
            row("tova", 2000, None, None)]
    goals.add_ratios(rows)
    lines = [ln for ln in goals.goal_lines(goals.goals(rows)) if "host syncs" in ln]
    assert lines == ["PASS  host syncs per decoding step <= 1 (the token): keydiff (N=64: 1.00 (max 1))",
                     "FAIL  host syncs per decoding step <= 1 (the token): adakv (N=64: 16.50 (max 17))"]  # tova: none
    table = goals.markdown_table(rows).splitlines()
    assert table[0].split("|")[-2].strip() == "syncs/step"
    assert [ln.split("|")[-2].strip() for ln in table[2:]] == ["1.00", "1.00", "16.50", ""]


def test_real_model_side_by_side_with_hf(tmp_path, one_thread) -> None:
    """--model with a local directory: its tokenizer makes the prompt, the hf rows run HF's own loop."""
    from kvbench.models.tiny import builtin_dir

    out = tmp_path / "b.json"
    rc = bench.main(["--model", str(builtin_dir("tiny-llama")), "--lengths", "40", "--budgets", "16", "--block",
                     "8", "--new-tokens", "3", "--repeats", "1", "--policies", "keydiff", "--clock", "cpu",
                     "--no-syncs", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    assert set(rows) == {"hf-decode", "hf-forward", "streamingllm", "keydiff"}
    assert rows["hf-decode"]["prompt_tokens"] == 16 and rows["hf-decode"]["peak_kv_tokens"] == 16 + 3 - 1
    assert rows["hf-forward"]["peak_kv_tokens"] == 40 + 3 - 1 and rows["hf-forward"]["evict_s"] == 0
    kd = rows["keydiff"]
    assert kd["decode_vs_hf"] == pytest.approx(kd["decode_ms_per_token"] / rows["hf-decode"]["decode_ms_per_token"],
                                               abs=2e-3)
    assert kd["vs_hf_forward"] == pytest.approx(kd["prefill_s"] / rows["hf-forward"]["prefill_s"], abs=2e-3)
    assert {g["policy"] for g in data["goals"]} == {"keydiff", "streamingllm"}
    assert all(r["clock"] == "cpu" and r["prefill_s"] > 0 and r["decode_s"] > 0 for r in data["rows"])
    assert all(r["host_syncs_per_step"] is None for r in data["rows"])  # --no-syncs: not counted, no goal line
    assert not any(g["goal"].startswith("host syncs") for g in data["goals"])
    md = out.with_suffix(".md").read_text()
    assert "Command: `kvbench-bench --model " in md and "## Goals" in md


def test_unknown_model_is_one_line(tmp_path, capsys) -> None:
    assert bench.main(["--model", "nosuch-model", "--lengths", "16", "--out", str(tmp_path / "b.json"),
                       "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvbench-bench: error: unknown model 'nosuch-model': neither a conf/model preset nor a model directory"
    assert not (tmp_path / "b.json").exists()


def test_batch_rows_per_workload_policy_and_k(tmp_path, one_thread) -> None:
    """--batch 1,2 on the NIAH-shaped workload (2 prompts of 2048 and 2035 tokens, 32 new tokens) with HF's batched
    generate beside: one row per (policy, K), K+V bytes worked out from tiny-llama's shape."""
    from kvbench.bench.batch import batch_goal_lines
    from kvbench.models.tiny import builtin_dir

    out = tmp_path / "b.json"
    rc = bench.main(["--model", str(builtin_dir("tiny-llama")), "--batch", "1,2", "--samples", "2", "--workloads",
                     "niah", "--policies", "keydiff", "--budgets", "64", "--block", "16", "--clock", "cpu",
                     "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {(r["policy"], r["batch"]): r for r in data["rows"]}
    assert set(rows) == {("keydiff", 1), ("keydiff", 2), ("hf", 1), ("hf", 2)}
    for r in rows.values():
        assert r["prompt_tokens"] == [2048, 2035] and r["new_tokens"] == 32 and r["samples"] == 2
        assert r["samples_per_hour"] == pytest.approx(2 / r["seconds"] * 3600, rel=1e-2)
    assert rows[("keydiff", 1)]["vs_batch1"] == 1.0 and rows[("keydiff", 1)]["same_as_batch1"] == 2
    # decoding's share of the eviction seconds: a part of them for kvbench's rows, none for HF's (it evicts nothing)
    assert all(0 < r["evict_decode_s"] < r["evict_s"] for k, r in rows.items() if k[0] == "keydiff")
    assert rows[("hf", 1)]["evict_decode_s"] is None
    # K+V of a batch: K samples x 2 layers x (K, V) x 2 heads x (N + B = 80 tokens) x 64 dims x 4 bytes
    assert rows[("keydiff", 1)]["kv_bytes_peak"] == 1 * 2 * 2 * 2 * 80 * 64 * 4
    assert rows[("keydiff", 2)]["kv_bytes_peak"] == 2 * 2 * 2 * 2 * 80 * 64 * 4
    # HF's full cache: both prompts left-padded to 2048, plus the 31 fed-back tokens
    assert rows[("hf", 2)]["kv_bytes_peak"] == 2 * 2 * 2 * 2 * (2048 + 31) * 64 * 4
    assert data["goals"] == batch_goal_lines(data["rows"])
    assert data["goals"][0].startswith("niah: keydiff batch 2 vs 1: ") and "PASS" not in data["goals"][0]
    md = out.with_suffix(".md").read_text()
    assert "| niah | 2035-2048 / 32 | keydiff | 64 | 2 | 2 |" in md


def test_a_bench_stopped_after_a_round_leaves_the_rounds_it_finished(tmp_path, one_thread, monkeypatch) -> None:
    """After every round but the last the output holds the rounds so far, whole: a call stopped by a time limit
    (here: the first call after round 1's files exist fails) leaves round 1, said so in the table's header; a run
    that finishes leaves its full table and no temporary file."""
    from kvbench.bench import batch
    from kvbench.models.tiny import builtin_dir

    out = tmp_path / "b.json"
    args = ["--model", str(builtin_dir("tiny-llama")), "--lengths", "40", "--budgets", "16", "--block", "8",
            "--new-tokens", "3", "--policies", "keydiff", "--baselines", "none", "--clock", "cpu", "--no-syncs",
            "--out", str(out), "--quiet"]

    def stopping(real):
        def call(*args, **kwargs):
            if out.exists():
                raise RuntimeError("stopped")
            return real(*args, **kwargs)
        return call

    with monkeypatch.context() as m:
        m.setattr(measure, "measure", stopping(measure.measure))
        with pytest.raises(RuntimeError, match="stopped"):
            bench.main([*args, "--repeats", "3"])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["policy"] == "keydiff" and row["repeats"] == 1 and len(row["prefill_s_rounds"]) == 1
    assert row["prefill_s"] == row["prefill_s_rounds"][0]
    md = out.with_suffix(".md").read_text()
    assert "medians of the first 1 of 3 interleaved rounds (the rest not measured)" in md
    assert bench.main([*args, "--repeats", "2"]) == 0
    assert json.loads(out.read_text())["rows"][0]["repeats"] == 2
    assert "medians of 2 interleaved rounds" in out.with_suffix(".md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.md"]
    out.unlink()
    batch_args = ["--model", str(builtin_dir("tiny-llama")), "--batch", "1,2", "--samples", "2", "--workloads",
                  "niah", "--policies", "streamingllm", "--budgets", "64", "--block", "16", "--baselines", "none",
                  "--clock", "cpu", "--repeats", "2", "--out", str(out), "--quiet"]
    with monkeypatch.context() as m:
        m.setattr(batch, "_kvbench", stopping(batch._kvbench))
        with pytest.raises(RuntimeError, match="stopped"):
            bench.main(batch_args)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["rounds"]) for r in rows] == [(1, 1), (2, 1)]
    assert "one round so far (of 2" in out.with_suffix(".md").read_text()


def test_batch_goal_lines_judge_batch_8_against_the_workload_goal() -> None:
    from kvbench.bench.batch import batch_goal_lines

    def row(workload: str, policy: str, k: int, speedup: float, same: int) -> dict:
        return {"workload": workload, "policy": policy, "batch": k, "vs_batch1": speedup, "samples": 8,
                "same_as_batch1": same}

    lines = batch_goal_lines([row("longbench", "keydiff", 1, 1.0, 8), row("longbench", "keydiff", 8, 1.61, 7),
                              row("niah", "snapkv", 1, 1.0, 8), row("niah", "snapkv", 8, 1.14, 8),
                              row("niah", "hf", 1, 1.0, 8), row("niah", "hf", 8, 2.0, 8)])
    assert lines == ["longbench: keydiff batch 8 vs 1: 1.61x samples per hour PASS (goal >= 1.6x; one round: no "
                     "interval); tokens identical to batch 1: K=8 7/8",
                     "niah: snapkv batch 8 vs 1: 1.14x samples per hour MISS (goal >= 1.35x; one round: no "
                     "interval); tokens identical to batch 1: K=8 8/8",
                     "niah: hf batch 8 vs 1: 2.00x samples per hour; tokens identical to batch 1: K=8 8/8"]


def test_batch_goal_line_gives_the_ceiling_that_free_decoding_would_reach() -> None:
    """KeyDiff's NIAH-shaped rows on the AMD EPYC: batch 1 took 98.3 s in all, batch 8's prompts alone 70.9 s, so even
    with its decoding free batch 8 could reach at most 98.3 / 70.9 = 1.3865 -> 1.39x, under the 1.35x line's reach
    only just; without prompt times (or without a batch-1 row) nothing is said."""
    from kvbench.bench.batch import batch_goal_lines

    one = {"workload": "niah", "policy": "keydiff", "batch": 1, "vs_batch1": 1.0, "samples": 8, "same_as_batch1": 8,
           "seconds": 98.3, "prefill_s": 74.7}
    eight = {**one, "batch": 8, "vs_batch1": 1.24, "seconds": 80.4, "prefill_s": 70.9}
    line = batch_goal_lines([one, eight])[0]
    assert line == ("niah: keydiff batch 8 vs 1: 1.24x samples per hour MISS (goal >= 1.35x; one round: no interval); "
                    "with its decoding free, batch 8 would reach at most 1.39x (its prompts 70.9 s against batch 1's "
                    "98.3 s in all); tokens identical to batch 1: K=8 8/8")
    assert "decoding free" not in batch_goal_lines([one, {**eight, "prefill_s": None}])[0]
    assert "decoding free" not in batch_goal_lines([eight])[0]


def test_batch_goals_over_rounds_are_corrected_as_one_family_by_holm() -> None:
    from kvbench.bench.batch import batch_goal_lines

    def row(policy: str, k: int, rounds: list[float]) -> dict:
        return {"workload": "niah", "policy": policy, "batch": k, "vs_batch1": sorted(rounds)[1], "samples": 8,
                "same_as_batch1": 8, "round_vs_batch1": rounds}

    # 3 rounds against 1.35x on their logs (against log 1.35 = 0.300105; `_p_under_3`), worked by hand: keydiff 1.40,
    # 1.42, 1.44: logs 0.33647, 0.35066, 0.36464, mean 0.350591, sd 0.014086, t = 6.208, p over the goal 0.01249; snapkv
    # 1.29, 1.31, 1.33: mean log 0.269949, sd 0.015269, t = -3.421, p under it 0.03793 (MISS on its own: upper bound
    # 1.344x); tova 1.30, 1.35, 1.40: geometric mean 1.3497, t = -0.021, p under 0.492 (not resolved). Holm over 3:
    # keydiff 3 x 0.01249 = 0.037 (kept), snapkv 2 x 0.03793 = 0.076 (not kept), tova 0.49
    p_kd, p_sn = 1 - _p_under_3([1.40, 1.42, 1.44], 1.35), _p_under_3([1.29, 1.31, 1.33], 1.35)
    p_tova = _p_under_3([1.30, 1.35, 1.40], 1.35)
    assert (round(p_kd, 5), round(p_sn, 5), round(p_tova, 3)) == (0.01249, 0.03793, 0.492)
    rows = [row("keydiff", 1, [1.0] * 3), row("keydiff", 8, [1.40, 1.42, 1.44]), row("snapkv", 1, [1.0] * 3),
            row("snapkv", 8, [1.29, 1.31, 1.33]), row("tova", 1, [1.0] * 3), row("tova", 8, [1.30, 1.35, 1.40])]
    lines = batch_goal_lines(rows)
    assert [ln.split(") ")[1].split(" (goal")[0] for ln in lines[:3]] == ["PASS at 95 %", "MISS at 95 %",
                                                                       "NOT RESOLVED at 95 %"]
    assert lines[3] == ("HOLM  batch goals, the 3 lines over rounds as one family (family-wise 5 %, adjusted p): "
                        f"PASS niah keydiff ({3 * p_kd:.2g}); not resolved niah snapkv ({2 * p_sn:.2g}), niah tova "
                        f"({p_tova:.2g})")
    assert f"{3 * p_kd:.2g}, {2 * p_sn:.2g}, {p_tova:.2g}" == "0.037, 0.076, 0.49"
    # one goal over rounds: no family line
    assert not any(ln.startswith("HOLM") for ln in batch_goal_lines(rows[:2]))


def test_batch_rounds_interleave_and_rows_give_medians_of_paired_ratios(monkeypatch) -> None:
    """rounds=3: each round runs every (policy, K) once, round r starting r places along the list; a row's time is
    the median of its rounds, its speed-up the median of the same-round ratios (worked by hand below), and its
    tokens are checked against every round's."""
    from kvbench.bench import batch

    times = {("keydiff", 1): [10.0, 12.0, 11.0], ("keydiff", 8): [8.0, 8.0, 10.0]}
    calls: list[tuple[str, int]] = []

    def fake(model, name, budget, block, prompts, new_tokens, k, clock, seed):
        calls.append((name, k))
        seconds = times[(name, k)][sum(c == (name, k) for c in calls) - 1]
        return {"seconds": seconds, "tokens": [[1, 2]] * 8, "prefill_s": seconds / 2, "decode_s": seconds / 4,
                "evict_s": 1.0, "evict_decode_s": 0.5, "kv_bytes_peak": 100 * k}

    monkeypatch.setattr(batch, "_kvbench", fake)
    monkeypatch.setattr(batch, "batch_prompts", lambda model, tok, length, count, seed: [[0] * length] * count)
    rows = batch.run_batch_bench(None, None, ["keydiff"], [8], ["niah"], 64, 16, None, False, 0, lambda: 0.0,
                                 rounds=3)
    assert calls == [("keydiff", 1), ("keydiff", 8), ("keydiff", 8), ("keydiff", 1), ("keydiff", 1), ("keydiff", 8)]
    one, eight = rows
    assert (one["rounds"], one["seconds"], one["vs_batch1"], one["round_vs_batch1"]) == (3, 11.0, 1.0, [1.0] * 3)
    # per round 10/8, 12/8, 11/10 = 1.25, 1.5, 1.1: median 1.25 (the ratio of the medians, 11/8, would be 1.375)
    assert eight["round_vs_batch1"] == [1.25, 1.5, 1.1] and eight["vs_batch1"] == 1.25
    assert eight["seconds"] == 8.0 and eight["samples_per_hour"] == 8 / 8.0 * 3600 and eight["prefill_s"] == 4.0
    assert eight["same_as_batch1"] == 8 and eight["repeatable"] and eight["kv_bytes_peak"] == 800
    line = batch.batch_goal_lines(rows)[0]
    # logs 0.22314, 0.40547, 0.09531: mean 0.24131 (geometric mean 1.27x), sd 0.15587, se 0.08999, t(0.95, 2) = 2.920:
    # bounds exp(-0.02147) = 0.98x and exp(0.50408) = 1.66x, on both sides of 1.35x
    assert line.startswith("niah: keydiff batch 8 vs 1: 1.25x samples per hour (median of 3 rounds: 1.25, 1.50, "
                           "1.10) NOT RESOLVED at 95 % (goal >= 1.35x; 3 rounds, geometric mean 1.27x, one-sided t "
                           "bounds 0.98x and 1.66x)")
    md = batch.batch_markdown(rows)
    assert md.splitlines()[0].endswith("| time by round (s) | vs K=1 by round |")
    assert md.splitlines()[-1].endswith("| 8.0, 8.0, 10.0 | 1.25, 1.50, 1.10 |")


# Worked by hand on the logs: mean m, se = sd / sqrt(n), one-sided 95 % bounds exp(m -/+ t(0.95, n - 1) se), t = 2.920
# (n = 3), 6.314 (n = 2). 1.45, 1.50, 1.55: m 0.40509 (1.50x), se 0.01925: 1.42, 1.59. 1.36, 1.39, 1.41 (every round
# over 1.35): m 0.32679 (1.39x), se 0.01050: 1.34, 1.43. 1.30, 1.31, 1.29: m 0.26234 (1.30x), se 0.00444: 1.28, 1.32.
# 1.2, 1.3: m 0.22234 (1.25x), se 0.04002: 0.97, 1.61.
@pytest.mark.parametrize("ratios,verdict,bounds", [
    ([1.45, 1.50, 1.55], "PASS at 95 %", "3 rounds, geometric mean 1.50x, one-sided t bounds 1.42x and 1.59x"),
    ([1.36, 1.39, 1.41], "NOT RESOLVED at 95 %", "3 rounds, geometric mean 1.39x, one-sided t bounds 1.34x and 1.43x"),
    ([1.30, 1.31, 1.29], "MISS at 95 %", "3 rounds, geometric mean 1.30x, one-sided t bounds 1.28x and 1.32x"),
    ([1.2, 1.3], "NOT RESOLVED at 95 %", "2 rounds, geometric mean 1.25x, one-sided t bounds 0.97x and 1.61x"),
    ([1.35], "PASS", "one round: no interval"), ([1.34], "MISS", "one round: no interval")])
def test_batch_goal_verdict_is_a_one_sided_t_bound_over_the_rounds(ratios: list[float], verdict: str,
                                                                    bounds: str) -> None:
    from kvbench.bench.batch import goal_verdict

    assert goal_verdict(ratios, 1.35)[0] == f"{verdict} (goal >= 1.35x; {bounds})"


def test_bad_workload_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--batch", "1,2", "--workloads", "ruler", "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2 and not (tmp_path / "b.json").exists()


def test_compiled_rows_beside_each_policy(tmp_path, one_thread, monkeypatch) -> None:
    """--compiled measures each policy twice, as one compiled graph per forward and its eviction (NAME+compiled,
    GenerationSettings.compile) and eager: each row's setting reaches the engine, the same tokens (compiled = eager's
    predictions), the same bounded peak N + B = 16 + 8 (the held tokens, not the capacity the compiled cache rounds
    up to 64), each with its own goal lines. (It replaces --chronological's NAME+chrono and the NAME+stackprefill
    rows: the static engine has neither a chronological layout nor a layer-by-layer prompt eviction.)"""
    seen: set[tuple[str, bool]] = set()
    real = measure.generate

    def recording(model, policy, ids, settings, **kw):
        seen.add((policy.name, settings.compile))
        return real(model, policy, ids, settings, **kw)

    monkeypatch.setattr(measure, "generate", recording)
    out = tmp_path / "b.json"
    assert bench.main(["--arch", "tiny-llama", "--lengths", "40", "--budgets", "16", "--block", "8", "--new-tokens", "4",
                       "--repeats", "1", "--policies", "keydiff", "--compiled", "--baselines", "none",
                       "--threads", "1", "--out", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    assert list(rows) == ["keydiff", "keydiff+compiled"]
    assert seen == {("keydiff", False), ("keydiff", True)}
    assert rows["keydiff"]["first_tokens"] == rows["keydiff+compiled"]["first_tokens"]
    assert rows["keydiff+compiled"]["peak_kv_tokens"] == rows["keydiff"]["peak_kv_tokens"] == 16 + 8
    # the compiled row's evictions run inside its graphs, so its eviction time is not measured (0): no eviction goal
    # for it (it used to read "PASS ... 0.0 %") and the table says where the time went; its other goals stand
    judged = {(g["goal"].split(" ")[0], g["policy"]) for g in data["goals"]}
    assert ("eviction", "keydiff") in judged and ("eviction", "keydiff+compiled") not in judged
    assert ("host", "keydiff+compiled") in judged and ("end", "keydiff+compiled") in judged
    line = next(ln for ln in out.with_suffix(".md").read_text().splitlines() if ln.startswith("| keydiff+compiled "))
    assert [c.strip() for c in line.split("|")[9:11]] == ["in graph", ""]


def test_bench_names_say_how_a_row_runs() -> None:
    # a plain name runs eager; +compiled as one compiled graph per forward (GenerationSettings.compile)
    assert setup.variant("keydiff+compiled") == ("keydiff", {"compile": True}) and setup.variant("h2o") == ("h2o", {})
    assert setup.base_name("keydiff+compiled") == "keydiff" and setup.base_name("keydiff") == "keydiff"
    with pytest.raises(setup.BenchError, match="unknown policy 'keydiff\\+chrono'"):  # the retired variants
        setup.make_policy("keydiff+chrono", 16, 0)


def test_the_help_names_no_retired_variant(capsys) -> None:
    # The static engine has no chronological layout, no slot-reuse switch, no per-sample eviction in a batch and no
    # layer-by-layer prompt eviction: kvbench-bench's help offers none of their variants (--batch's named +alone)
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "NAME+compiled" in text and "--compiled" in text
    for retired in ("+alone", "+chrono", "+slots", "+stackprefill", "--chronological", "slot reuse"):
        assert retired not in text, retired
