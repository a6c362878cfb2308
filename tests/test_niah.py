"""NIAH: needle insertion (hand-computed), prompt/sample contract, scorers, aggregation and the heatmap."""

from __future__ import annotations

import re

import pytest

from kvbench.metrics import get_metric
from kvbench.metrics.niah import rouge1x10, rouge_tokens, substring_match
from kvbench.tasks.base import Sample, TaskEnv, TaskError
from kvbench.tasks.haystack import filler_text, read_haystack_dir
from kvbench.tasks.niah import NIAH, build_context, insert_needle_tokens


class CharTokenizer:
    """One token per character: insertion results can be worked out by hand."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


# --- insertion ---------------------------------------------------------------------------------------------------

P = 1  # the "." token


@pytest.mark.parametrize("depth, expected", [
    (0, [100, 101, 5, 6, P, 7, 8, P, 9, 10]),
    # int(8 * 0.5) = 4; token 3 (7) is not "." -> back off to 3, just after the "." at index 2
    (50, [5, 6, P, 100, 101, 7, 8, P, 9, 10]),
    # int(8 * 0.75) = 6; token 5 is "." -> insert at 6
    (75, [5, 6, P, 7, 8, P, 100, 101, 9, 10]),
    (100, [5, 6, P, 7, 8, P, 9, 10, 100, 101]),
])
def test_insert_needle_tokens(depth, expected):
    assert insert_needle_tokens([5, 6, P, 7, 8, P, 9, 10], [100, 101], depth, [P]) == expected


def test_insert_needle_no_period_goes_to_start():
    assert insert_needle_tokens([5, 6, 7, 8], [100], 50, [P]) == [100, 5, 6, 7, 8]


@pytest.mark.parametrize("depth, expected", [
    (0, "XYAa. Bb. Cc. Dd. "),
    # trimmed to 20 chars "Aa. Bb. Cc. Dd. Ee. ", then to 20 - 2 (buffer) - 2 (needle) = 16 chars;
    # int(16 * 0.5) = 8 -> char 7 is " " -> back off to 7, just after the "." of "Bb."
    (50, "Aa. Bb.XY Cc. Dd. "),
    (100, "Aa. Bb. Cc. Dd. XY"),
])
def test_build_context_hand_made_haystack(depth, expected):
    t = CharTokenizer()
    hay = t.encode("Aa. Bb. Cc. Dd. Ee. Ff. Gg.")
    assert build_context(t, hay, "XY", context_length=20, depth=depth, buffer=2) == expected


def test_build_context_needle_too_long_for_buffer():
    t = CharTokenizer()
    with pytest.raises(TaskError, match="no room for the needle"):
        build_context(t, t.encode("Aa. " * 10), "XYZ", context_length=5, depth=50, buffer=3)


# --- samples -----------------------------------------------------------------------------------------------------

def _env(tok, chat=True):
    return TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=8192, chat_template=chat)


def test_samples_chat_prompt_contract(tok):
    task = NIAH(context_lengths=[512, 1024], depths=[0, 50, 100])
    samples = list(task.samples(_env(tok)))
    assert [s.id for s in samples] == ["L512_D0", "L512_D50", "L512_D100", "L1024_D0", "L1024_D50", "L1024_D100"]
    needle = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    for s in samples:
        assert s.prompt.startswith("<s><|user|>\nYou are a helpful AI bot")
        assert s.prompt.endswith("<|assistant|>\nHere is the most relevant sentence in the context:")
        assert s.prompt.count(needle) == 1
        assert s.input_ids == tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert s.input_ids.count(tok.bos_token_id) == 1
        head, tail = tok.decode(s.input_ids[:s.context_tokens]), tok.decode(s.input_ids[s.context_tokens:])
        assert needle in head and "</context>" not in head
        assert tail.lstrip().startswith("</context>") and "What is the best thing" in tail
        # the context part is the trimmed haystack: at most length - buffer tokens (+ template head)
        assert s.context_tokens <= s.meta["context_length"]
        assert s.answers == ["eat a sandwich and sit in Dolores Park on a sunny day"]
    # needle position grows with depth within one length
    pos = [s.prompt.index(needle) for s in samples[:3]]
    assert pos[0] < pos[1] < pos[2]
    assert samples[0].prompt.index("<context>\n") + len("<context>\n") + 1 == pos[0]  # needle starts with "\n"


def test_samples_plain_prompt(tok):
    s = next(NIAH(context_lengths=[512], depths=[50]).samples(_env(tok, chat=False)))
    assert s.prompt.startswith("You are a helpful AI bot")
    assert s.prompt.endswith("findings\n\nHere is the most relevant sentence in the context:")
    assert s.input_ids[0] == tok.bos_token_id
    assert s.input_ids == tok(s.prompt)["input_ids"]


def test_haystack_dir_sorted_concatenation(tmp_path, tok):
    (tmp_path / "b.txt").write_text("Second file. ", encoding="utf-8")
    (tmp_path / "a.txt").write_text("First file. ", encoding="utf-8")
    (tmp_path / "ignored.md").write_text("Not a haystack.", encoding="utf-8")
    assert read_haystack_dir(tmp_path) == "First file. Second file. "
    s = next(NIAH(context_lengths=[300], depths=[0], haystack_dir=str(tmp_path)).samples(_env(tok)))
    assert "First file. Second file. First file." in s.prompt  # whole passes repeated until long enough


def test_bad_inputs(tmp_path):
    with pytest.raises(TaskError, match="substring, rouge1x10"):
        NIAH(scorer="judge")
    with pytest.raises(TaskError, match=r"\[0, 100\]"):
        NIAH(depths=[50, 120])
    with pytest.raises(TaskError, match="not found"):
        read_haystack_dir(tmp_path / "missing")
    with pytest.raises(TaskError, match="no .txt files"):
        read_haystack_dir(tmp_path)


def test_filler_is_deterministic_prefix_stable_and_digit_free():
    long, short = filler_text(6000), filler_text(300)
    assert long.startswith(short) and len(short.split()) >= 300
    assert filler_text(6000) == long
    assert not re.search(r"\d", long)
    assert "San Francisco" not in long


# --- scorers -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pred, expected", [
    ("Eat a SANDWICH and sit in Dolores Park on a sunny day.", 1.0),
    ("The best thing is to eat a sandwich\nand sit in   Dolores Park on a sunny day", 1.0),
    ("eat a sandwich and sit in Dolores Park", 0.0),
    ("eat a sandwich and sit in DoloresPark on a sunny day", 0.0),
    ("", 0.0),
])
def test_substring(pred, expected):
    assert substring_match(pred, "eat a sandwich and sit in Dolores Park on a sunny day") == expected


def test_substring_empty_answer_never_matches():
    assert substring_match("anything", "  ") == 0.0


def test_rouge1x10_hand_worked():
    assert rouge_tokens("Cat-sat, ON the MAT!") == ["cat", "sat", "on", "the", "mat"]
    # target [the, cat, sat], prediction [the, cat]: P = 1, R = 2/3, F = 0.8
    assert rouge1x10("the cat", "The cat sat.") == pytest.approx(8.0)
    assert rouge1x10("dogs", "The cat sat.") == 0.0
    assert rouge1x10("", "The cat sat.") == 0.0
    assert get_metric("niah_rouge1x10") is rouge1x10
    assert get_metric("niah_substring") is substring_match


def test_task_score_scales(tok):
    s = Sample(id="L1_D0", input_ids=[1], answers=["eat a sandwich"], max_new_tokens=4)
    assert NIAH(answer="eat a sandwich").score(s, "I would eat a sandwich.") == 100.0
    r = NIAH(scorer="rouge1x10", needle="The cat sat.")
    assert r.score(s, "the cat") == pytest.approx(80.0)


# --- aggregation and heatmap -------------------------------------------------------------------------------------

def _records():
    scores = {(1024, 0): 100.0, (1024, 50): 0.0, (1024, 100): 100.0,
              (2048, 0): 100.0, (2048, 50): 100.0, (2048, 100): 0.0}
    return [{"id": f"L{L}_D{d}", "prediction": "", "answers": ["x"], "score": v,
             "meta": {"context_length": L, "depth": d}} for (L, d), v in scores.items()]


def test_aggregate_cells_and_avg():
    out = NIAH().aggregate(_records())
    assert out == {"L1024_D0": 100.0, "L1024_D50": 0.0, "L1024_D100": 100.0,
                   "L2048_D0": 100.0, "L2048_D50": 100.0, "L2048_D100": 0.0, "avg": 66.67}
    no_meta = [{k: v for k, v in r.items() if k != "meta"} for r in _records()]
    assert NIAH().aggregate(no_meta) == out


def test_finalize_writes_heatmap(tmp_path):
    task = NIAH(haystack="filler")
    recs = _records()
    extra = task.finalize(tmp_path, recs, task.aggregate(recs))
    png = tmp_path / "niah_heatmap.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("substring" in n for n in extra["notes"])
    assert any("built-in filler" in n for n in extra["notes"])


# --- independent samples: windows=per_sample ---------------------------------------------------------------------

def test_default_samples_unchanged_by_the_windows_option(tok):
    # sha256 of [id, input_ids, context_tokens, meta] of every sample, computed with the code before the `windows`
    # option existed (kvbench 95b38d5): the default (windows=shared) builds the same prompts byte for byte.
    import hashlib
    import json

    task = NIAH(context_lengths=[600, 1000], depths=[10, 90], samples_per_cell=3)
    got = [[s.id, s.input_ids, s.context_tokens, s.meta] for s in task.samples(_env(tok))]
    assert hashlib.sha256(json.dumps(got).encode()).hexdigest() == \
        "9f46977a306e4580fcca30cad29715fb444dad725b18cd037e8e222f84d3e7dc"
    assert task.provenance() == {"haystack": task.source().provenance, "samples_per_cell": 3, "needle_seed": 0}
    assert NIAH(context_lengths=[600], depths=[10], windows="shared").windows == "shared"


def test_plan_windows_hand_worked():
    from kvbench.tasks.niah import plan_windows

    # 10 tokens per pass, windows of 3: slots [0,3) [3,6) [6,9) are disjoint; the seeded draw orders them 1, 2, 0;
    # samples 4 and 5 take slots 3 and 4, which start at 9 and 12 mod 10 = 2 (wrapped: they overlap slot 0's).
    p = plan_windows(period=10, width=3, count=5, seed=0)
    assert (p.disjoint, p.slots, p.starts) == (3, (1, 2, 0, 3, 4), (3, 6, 0, 9, 2))
    assert p.describe() == {"mode": "per_sample", "window_tokens": 3, "haystack_tokens": 10, "disjoint_windows": 3,
                            "samples": 5, "wrapped_samples": 2}
    assert p.note().endswith("; 2 samples wrap and overlap other samples' windows")
    assert plan_windows(10, 3, 5, 0) == p and plan_windows(10, 3, 5, 1) != p  # deterministic, keyed by the seed
    assert plan_windows(10, 3, 2, 0).shared_samples == 0


def _context(s):
    return s.prompt.split("<context>\n", 1)[1].split("\n</context>", 1)[0]


def test_per_sample_windows_are_disjoint_and_deterministic(tok):
    task = NIAH(context_lengths=[600], depths=[10, 90], samples_per_cell=20, windows="per_sample")
    samples = list(task.samples(_env(tok)))
    again = list(NIAH(context_lengths=[600], depths=[10, 90], samples_per_cell=20,
                      windows="per_sample").samples(_env(tok)))
    assert [s.input_ids for s in samples] == [s.input_ids for s in again]
    assert len(samples) == 40 and len({s.id for s in samples}) == 40
    starts = sorted(s.meta["window"]["start"] for s in samples)
    assert all(b - a >= 600 for a, b in zip(starts, starts[1:]))  # windows of 600 tokens never overlap
    assert not any(s.meta["window"]["wrapped"] for s in samples)
    # Each context is cut from its own place in the essays: no two share their opening text.
    assert len({_context(s)[:80] for s in samples}) == 40
    hay = task.haystack_ids(tok, 1)
    for s in samples[:5]:  # the haystack around the needle is the essays' text from the window's start (mid-word)
        start, needle = s.meta["window"]["start"], task.needles()[s.meta["needle"]][0]
        assert _context(s).replace(needle, "").startswith(tok.decode(hay[start:start + 20])[:15])
    prov = task.provenance()["windows"]
    assert prov == {"mode": "per_sample", "window_tokens": 600, "haystack_tokens": 403101, "disjoint_windows": 671,
                    "samples": 40, "wrapped_samples": 0}


def test_per_sample_needle_at_the_requested_depth(tok):
    task = NIAH(context_lengths=[1000], depths=[0, 50, 100], samples_per_cell=2, windows="per_sample")
    for s in task.samples(_env(tok)):
        needle = task.needles()[s.meta["needle"]][0]
        ctx = _context(s)
        at = ctx.index(needle.strip())
        frac = len(tok.encode(ctx[:at], add_special_tokens=False)) / len(tok.encode(ctx, add_special_tokens=False))
        depth = s.meta["depth"]
        if depth == 0:
            assert at <= 1
        elif depth == 100:
            assert ctx.rstrip().endswith(needle.strip())
        else:  # just after the last "." before int(n * depth / 100): at most that far, starting a sentence
            assert 0.3 < frac <= 0.5 and ctx[:at].rstrip().endswith(".")


def test_per_sample_needles_cycle_past_thirteen(tok):
    task = NIAH(context_lengths=[300], depths=[50], samples_per_cell=30, windows="per_sample")
    samples = list(task.samples(_env(tok)))
    assert len(samples) == 30 and samples[29].id == "L300_D50_n29"
    assert [s.meta["needle"] for s in samples[:15]] == [*range(13), 0, 1]
    assert samples[13].answers == samples[0].answers and _context(samples[13]) != _context(samples[0])
    with pytest.raises(TaskError, match=r"from 1 to 13 \(more with windows=per_sample\), got 14"):
        NIAH(samples_per_cell=14)
    with pytest.raises(TaskError, match="positive integer, got 0"):
        NIAH(samples_per_cell=0, windows="per_sample")


def test_per_sample_windows_wrap_on_a_short_haystack(tmp_path, tok):
    (tmp_path / "a.txt").write_text("A short essay. It has few words. " * 20, encoding="utf-8")  # 660 bytes
    task = NIAH(context_lengths=[300], depths=[50], samples_per_cell=4, haystack_dir=str(tmp_path),
                windows="per_sample")
    samples = list(task.samples(_env(tok)))
    period = len(tok.encode(task.source().text, add_special_tokens=False))
    assert task.provenance()["windows"] == {"mode": "per_sample", "window_tokens": 300, "haystack_tokens": period,
                                            "disjoint_windows": period // 300, "samples": 4,
                                            "wrapped_samples": 4 - period // 300}
    assert [s.meta["window"]["wrapped"] for s in samples].count(True) == 4 - period // 300 > 0
    notes = task.finalize(tmp_path / "run", [], {})["notes"]
    assert any("samples wrap and overlap" in n for n in notes)


def test_bad_windows_option():
    with pytest.raises(TaskError) as e:
        NIAH(windows="independent")
    assert str(e.value) == "niah: unknown windows 'independent'; choose one of: shared, per_sample"
