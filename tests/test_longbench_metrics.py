"""LongBench metrics and eval.py aggregation: expected values worked out by hand from the official metrics.py / eval.py rules."""

from __future__ import annotations

import math
import sys

import pytest

from kvbench.metrics import METRICS, get_metric
from kvbench.metrics import longbench as lb


# ---- qa_f1_score ------------------------------------------------------------------------------------------------

def test_qa_f1_normalisation_and_f1():
    # "the cat sat." -> "cat sat" (punctuation, article); "a cat" -> "cat": p = 1/2, r = 1, f1 = 2/3.
    assert lb.qa_f1_score("The Cat sat.", "a cat") == 2 / 3
    assert lb.normalize_answer("The  Cat, sat.") == "cat sat"
    # Articles only as whole words: "another", "anthem", "thee" survive.
    assert lb.normalize_answer("another anthem thee an") == "another anthem thee"
    # str.split() splits on NBSP too: tokens [cat, dog] vs [dog] -> 2/3.
    assert lb.qa_f1_score("cat\u00a0dog", "dog") == 2 / 3


def test_qa_f1_zero_is_int_and_unicode_punct_survives():
    s = lb.qa_f1_score("dog", "cat")
    assert s == 0 and type(s) is int
    # Curly quotes are not ASCII punctuation: token "“cat”" != "cat".
    assert lb.qa_f1_score("\u201ccat\u201d", "cat") == 0
    # Empty after normalisation on both sides -> 0, not 1.
    assert lb.qa_f1_score("the", "the") == 0


def test_qa_f1_zh_jieba_and_asymmetric_brackets():
    # jieba: "《红楼梦》" -> 《 / 红楼梦 / 》; "》" is punctuation (dropped), "《" is not (kept):
    # tokens [《, 红楼梦] vs [红楼梦] -> p = 1/2, r = 1 -> 2/3.
    assert lb.qa_f1_zh_score("《红楼梦》", "红楼梦") == 2 / 3
    assert lb.normalize_zh_answer("》A，B") == "ab"
    # 我们/讨论/了/预算 vs 讨论/预算: 2 common, p = 2/4, r = 1 -> 2/3.
    assert lb.qa_f1_zh_score("我们讨论了预算", "讨论预算") == 2 / 3


# ---- rouge_score ------------------------------------------------------------------------------------------------

def _f(p: float, r: float) -> float:
    return 2.0 * ((p * r) / (p + r + 1e-8))


def test_rouge_identical_is_not_one():
    assert lb.rouge_score("a b c", "a b c") == _f(1.0, 1.0) == 2.0 * (1.0 / (2.0 + 1e-8))


def test_rouge_trailing_empty_word():
    # "Hello world. " -> sentences ["Hello world", ""] -> words {Hello, world, ""}: n = 3, m = 2, llcs = 2.
    assert lb.rouge_score("Hello world. ", "Hello world") == _f(2 / 3, 1.0)


def test_rouge_empty_inputs_and_case():
    for empty in ("", ".", "..."):
        assert lb.rouge_score(empty, "a b") == 0.0
        assert lb.rouge_score("a b", empty) == 0.0
    # Case-sensitive, no stemming: nothing in common.
    assert lb.rouge_score("Cat", "cat") == 0.0


def test_rouge_backtrack_tie_break_and_union():
    # ref sentences [a b], [b]; hyp [b a]. For (a b, b a) the tie T[1][2] = T[2][1] goes left and picks "b";
    # (b, b a) picks "b": union {b}, llcs = 1, m = n = 2 -> p = r = 1/2.
    assert lb.rouge_score("b a", "a b. b") == _f(0.5, 0.5)


@pytest.fixture
def eval_py_recursion_limit():
    """CPython's default recursion limit, as `python eval.py` runs under (torch.compile raises the process's limit, and
    a compiling test may have run in this worker before)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)


def test_rouge_recursion_limit_falls_where_it_does_under_eval_py(eval_py_recursion_limit):
    # A k-word identical single sentence needs k + 1 backtrack frames in rouge's recursive LCS; under `python eval.py`
    # (CPython 3.11, limit 1000) 991 frames pass, 992 raise RecursionError (-> 0.0, the official bare except).
    ok = " ".join(f"w{i}" for i in range(990))
    too_deep = " ".join(f"w{i}" for i in range(991))
    assert lb.rouge_score(ok, ok) == _f(1.0, 1.0)
    assert lb.rouge_score(too_deep, too_deep) == 0.0
    # rouge_zh_score goes through one more frame: 989 words pass, 990 fail.
    zh_ok = " ".join(f"w{i}" for i in range(989))
    assert lb.rouge_zh_score(zh_ok, zh_ok) == _f(1.0, 1.0)
    assert lb.rouge_zh_score(ok, ok) == 0.0
    # Splitting on "." keeps each sentence pair shallow: the same 991 words as two sentences score.
    halves = " ".join(f"w{i}" for i in range(495)) + ". " + " ".join(f"w{i}" for i in range(495, 991))
    assert lb.rouge_score(halves, halves) == _f(1.0, 1.0)


def test_rouge_limit_does_not_depend_on_the_callers_depth():
    # 200 frames deeper than the test (a report or a sweep calls from deep stacks) the same pair still scores.
    ok = " ".join(f"w{i}" for i in range(990))

    def deep(k: int) -> float:
        return lb.rouge_score(ok, ok) if k == 0 else deep(k - 1)

    assert deep(200) == _f(1.0, 1.0)


def test_rouge_zh_uses_jieba_words():
    # 我们/讨论/了/预算 vs 讨论/预算 (one sentence each; "。" does not split): llcs = 2, n = 4, m = 2.
    assert lb.rouge_zh_score("我们讨论了预算", "讨论预算") == _f(2 / 4, 1.0)


# ---- code_sim_score / fuzz_ratio --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["difflib", "levenshtein"])
def test_fuzz_ratio_rules(backend):
    pytest.importorskip("Levenshtein") if backend == "levenshtein" else None
    assert lb.fuzz_ratio("", "", backend) == 100  # equality is checked before emptiness
    assert lb.fuzz_ratio("", "a", backend) == 0
    assert lb.fuzz_ratio(None, "a", backend) == 0
    # 3 matching chars of 8: 2 * 3 / 8 = 0.75 (Indel: distance 2 of 8 -> 0.75).
    assert lb.fuzz_ratio("abcd", "abce", backend) == 75
    # 5 of 16: exactly 62.5 -> Python's half-even round -> 62.
    assert lb.fuzz_ratio("abcdefgh", "abcdeXYZ", backend) == 62


def test_fuzz_autojunk_difference_between_backends():
    pytest.importorskip("Levenshtein")
    gt = "x = 1 " * 84  # 504 chars: every char occurs > 1 + 504 // 100 times -> all junk for difflib
    assert lb.code_sim_score(" " + gt, gt, fuzz_backend="difflib") == 0.0
    # Indel distance 1 over 1009 chars -> 99.9 -> 100.
    assert lb.code_sim_score(" " + gt, gt, fuzz_backend="levenshtein") == 1.0


def test_code_sim_first_line_rule():
    assert lb.code_sim_score("# only a comment", "") == 1.0  # pred "" vs gt "" -> 100
    assert lb.code_sim_score("#x", "abc") == 0.0
    # Leading "\n" stripped, whitespace-only line not skipped.
    assert lb.code_sim_score("\n\n   \nx = 1", "   ") == 1.0
    assert lb.code_sim_score("```python\nreturn x\n", "return x") == 1.0
    assert lb.code_sim_score("s = 'http://a'\ny = 2", "y = 2") == 1.0
    with pytest.raises(ValueError, match="choose one of"):
        lb.code_sim_score("a", "b", fuzz_backend="rapidfuzz")


# ---- classification, count, retrieval ---------------------------------------------------------------------------

def test_classification_list_removal_skip():
    classes = ["AB", "A", "B", "ABC", "C"]
    # matches [AB, A, B, ABC, C]; removing AB skips A, removing B skips ABC, C is removed: [A, ABC] -> 1/2.
    assert lb.classification_score("ABC", "ABC", all_classes=classes) == 0.5
    assert lb.classification_score("Animal", "Animal", all_classes=["Animal", "Location"]) == 1.0
    assert lb.classification_score("Location", "Animal", all_classes=["Animal", "Location"]) == 0.0
    # Substring, case-sensitive: "animal" matches nothing.
    assert lb.classification_score("animal", "Animal", all_classes=["Animal"]) == 0.0


def test_count_and_retrieval():
    assert lb.count_score("There are 3 paragraphs, 3 unique, 12.5", "3") == 0.5  # [3, 3, 12, 5]
    assert lb.count_score("\uff13", "3") == 0.0  # full-width digit is extracted but never equal
    assert lb.count_score("012", "12") == 0.0
    assert lb.count_score("none", "3") == 0.0
    assert lb.retrieval_score("Paragraph 2, maybe 20", "Paragraph 2") == 0.5
    assert lb.retrieval_score("2", "Paragraph 2") == 1.0
    assert lb.retrieval_zh_score("答案是段落3，不是段落12", "段落3") == 0.5
    assert lb.retrieval_zh_score("段落3", "段落3") == 1.0


# ---- aggregation ------------------------------------------------------------------------------------------------

def test_scorer_first_line_rule_and_max_over_answers():
    classes = ["Animal", "Location"]
    assert lb.scorer("trec", ["\n\nAnimal\nLocation"], [["Animal"]], classes) == 100.0
    # Not a first-line dataset: both classes stay -> 1/2.
    assert lb.sample_score("lsht", "Animal\nLocation", ["Animal"], classes) == 1.0
    assert lb.classification_score("Animal\nLocation", "Animal", all_classes=classes) == 0.5
    # max over answers: "north" matches the second answer.
    assert lb.scorer("narrativeqa", ["north", "x"], [["south", "North."], ["y"]], None) == 50.0


def test_scorer_python_round_vs_scorer_e_numpy_round():
    # 107 of 4000 numbers equal the answer: per-sample 107/4000, 100 * that = 2.675 (stored as 2.67499...).
    pred = "1 " * 107 + "0 " * 3893
    assert lb.count_score(pred, "1") == 107 / 4000
    assert lb.scorer("passage_count", [pred], [["1"]], None) == 2.67  # Python round
    assert lb.scorer_e("passage_count", [pred], [["1"]], [10], None)["0-4k"] == 2.68  # NumPy round


def test_scorer_e_buckets_and_nan():
    preds, answers = ["3", "3", "2", "x"], [["3"], ["2"], ["2"], ["3"]]  # per-sample 1, 0, 1, 0
    got = lb.scorer_e("passage_count", preds, answers, [3999, 4000, 7999, 8000], None)
    assert got == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0}
    got = lb.scorer_e("passage_count", ["3"], [["3"]], [100], None)
    assert got["0-4k"] == 100.0 and math.isnan(got["4-8k"]) and math.isnan(got["8k+"])


def test_summary_scores():
    en = {d: 0.0 for d in lb.EN16}
    en.update({"narrativeqa": 30.0, "qasper": 60.0, "lcc": 50.0})
    got = lb.summary_scores(en)
    assert got["cat:single_doc_qa"] == 30.0  # (30 + 60 + 0) / 3
    assert got["cat:code"] == 25.0
    assert got["avg_leaderboard"] == (30.0 + 25.0) / 6
    assert got["avg_en16"] == 140.0 / 16
    assert "avg_zh_leaderboard" not in got
    partial = lb.summary_scores({"narrativeqa": 10.0, "trec": 20.0})
    assert partial == {"avg_selected": 15.0}


def test_metric_registry():
    for name in ("qa_f1_score", "qa_f1_zh_score", "rouge_score", "rouge_zh_score", "classification_score",
                 "retrieval_score", "retrieval_zh_score", "count_score", "code_sim_score"):
        assert METRICS[name] == f"longbench:{name}"
        assert get_metric(name) is getattr(lb, name)
    assert get_metric("longbench_scorer") is lb.scorer
    assert get_metric("longbench_scorer_e") is lb.scorer_e


def test_summary_scores_chinese_leaderboard():
    per = {d: float(i) for i, d in enumerate(lb.DATASET2METRIC)}  # 0..20 in the official order
    got = lb.summary_scores(per)
    # multifieldqa_zh 3, dureader 7, vcsum 11, lsht 15, passage_retrieval_zh 18, code (19 + 20) / 2 = 19.5.
    assert got["cat_zh:single_doc_qa"] == 3.0 and got["cat_zh:synthetic"] == 18.0
    assert "cat_zh:code" not in got  # the code category is the English one
    assert got["avg_zh_leaderboard"] == (3 + 7 + 11 + 15 + 18 + 19.5) / 6
    assert got["avg_selected"] == 210 / 21
