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
