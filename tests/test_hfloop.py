"""HF's own loop in lockstep with a kvbench call (kvbench.bench.hfloop.Lockstep, kvbench-bench --hf-lockstep): the
order of the two sides' forwards, the call's clock stopped while HF steps, HF's tokens and sizes as in its own loop."""

from __future__ import annotations

import json

import pytest

from kvbench.bench import cli as bench
from kvbench.bench import measure, setup
from kvbench.bench.hfloop import Lockstep

PROMPT = list(range(10, 50))  # 40 tokens: 5 blocks of 8 at N = 16 on the 2-layer tiny model


@pytest.fixture()
def tiny():
    from kvbench.engine.cache import install
    from kvbench.models.tiny import build_tiny_model

    model, _ = build_tiny_model("tiny-llama")
    install(model)
    return model


def _ticking(model, log: list[str]):
    """A clock that moves only in forwards: 1 for each of kvbench's, 1000 for each of HF's (its cache a plain
    DynamicCache); each forward's side and query length logged."""
    from transformers import DynamicCache

    now = [0.0]

    def pre(_module, _args, kwargs):
        hf = type(kwargs["past_key_values"]) is DynamicCache
        now[0] += 1000.0 if hf else 1.0
        log.append(("H" if hf else "K") + str(kwargs["input_ids"].shape[1]))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    return lambda: now[0]


def test_hf_steps_between_the_calls_steps_and_the_calls_clock_stops_meanwhile(tiny) -> None:
    """4 new tokens: kvbench's 5 prompt blocks and its first decoding step, then HF's prompt forward (N = 16 tokens)
    and its first step, then each side's next step in turn; HF's last token's pick comes at `finish` (no forward).
    By the ticking clock: the call's prefill 5 and decoding 3 (its own forwards only), HF's decoding 3 x 1000 (its
    three steps; its prompt forward not in it)."""
    from kvbench.engine.generate import GenerationSettings, Observer, generate

    log: list[str] = []
    step = Lockstep(tiny, PROMPT, 16, 4, _ticking(tiny, log))
    res = generate(tiny, setup.make_policy("streamingllm", 16, 0), PROMPT,
                   GenerationSettings(block=8, max_new_tokens=4), observer=Observer(clock=step.clock,
                                                                                    on_step=step.on_step))
    assert log == ["K8"] * 5 + ["K1", "H16", "H1", "K1", "H1", "K1", "H1"]
    hf = step.finish()
    assert log[-1] == "H1" and len(log) == 12  # the last pick made no forward
    assert (res.prefill_s, res.decode_s) == (5.0, 3.0)
    assert hf["hf_decode_s"] == 3000.0 and hf["hf_decode_steps"] == 3 and hf["hf_layer_sizes"] is None
    # HF's tokens are its own loop's on the prompt's first N tokens
    assert hf["hf_tokens"] == measure.hf_generate(tiny, PROMPT[:16], 4)["tokens"]


def test_lockstep_holds_the_policys_per_layer_sizes_and_finishes_a_call_without_steps(tiny) -> None:
    """K-norm told to skip layer 0 leaves it whole: 40 prompt tokens + the step's (41) there, 17 in layer 1, so HF's
    prompt forward is over the 40 tokens, cut to [40, 16]; its loop then ends at 40 + 2 and 16 + 2 tokens after two
    steps. A call of one new token makes no decoding step: `finish` runs HF's whole loop at N (no forward after the
    prompt's)."""
    from kvbench.engine.generate import GenerationSettings, Observer, generate
    from kvbench.policies.knorm import KNorm

    for new, sizes, steps in ((3, [40, 16], 2), (1, None, 0)):
        step = Lockstep(tiny, PROMPT, 16, new, measure.CLOCKS["cpu"])
        generate(tiny, KNorm(budget=16, skip_layers=(0,)), PROMPT, GenerationSettings(block=8, max_new_tokens=new),
                 observer=Observer(clock=step.clock, on_step=step.on_step))
        hf = step.finish()
        assert hf["hf_layer_sizes"] == sizes and hf["hf_decode_steps"] == steps and len(hf["hf_tokens"]) == new
    assert step.loop.held()[0] == 16


def test_hf_lockstep_gives_every_kvbench_row_its_reference(tmp_path, one_thread) -> None:
    """--hf-lockstep: every kvbench row carries HF's decoding of each round (K-norm's at [40, 40], the tiny model's
    both layers whole), HF's rows none; with --hf-beside, or without the hf baseline, one line and exit 2."""
    from kvbench.models.tiny import builtin_dir

    out = tmp_path / "b.json"
    args = ["--model", str(builtin_dir("tiny-llama")), "--lengths", "40", "--budgets", "16", "--block", "8",
            "--new-tokens", "3", "--policies", "keydiff,knorm", "--clock", "cpu", "--no-syncs", "--out", str(out),
            "--quiet"]
    assert bench.main([*args, "--repeats", "2", "--hf-lockstep"]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("keydiff", "streamingllm", "knorm"):
        assert len(rows[name]["hf_decode_s_rounds"]) == 2 and rows[name]["hf_decode_steps"] == 3 - 1
        assert rows[name]["hf_reference"] == "lockstep"
    assert rows["knorm"]["hf_layer_sizes"] == [40, 40] and rows["keydiff"]["hf_layer_sizes"] is None
    assert "hf_decode_s_rounds" not in rows["hf-decode"]
    assert "HF's decoding in lockstep with every kvbench call" in out.with_suffix(".md").read_text()
    for bad in (["--hf-beside"], ["--baselines", "full"]):
        with pytest.raises(SystemExit) as e:
            bench.main([*args, "--hf-lockstep", *bad])
        assert e.value.code == 2


def test_run_bench_takes_a_known_reference_with_its_baseline() -> None:
    """An unknown reference, or a reference without the hf-decode baseline to pair it with, is one BenchError before
    anything is measured."""
    cfgs = measure.configurations(["keydiff"], [8], [24], 4, baselines=())
    for ref, words in (("after", "one of beside, lockstep"), ("lockstep", "needs the hf-decode baseline")):
        with pytest.raises(setup.BenchError, match=words):
            measure.run_bench(None, cfgs, new_tokens=2, repeats=1, hf_reference=ref)
