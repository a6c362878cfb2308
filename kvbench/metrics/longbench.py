"""LongBench v1 metrics and aggregation (THUDM/LongBench @ 2e00731, `LongBench/metrics.py` and `LongBench/eval.py`;
docs/longbench.md).

Every per-pair function has the official name and signature `f(prediction, ground_truth, **kwargs)` and returns
the official value (0-1) bit for bit, quirks included:

- qa_f1_score: ASCII punctuation only, Unicode `\\b` for articles, int 0 when nothing overlaps.
- qa_f1_zh_score: jieba tokens (on the raw text) normalised one by one; `《` is not punctuation but `》` is.
- rouge_score / rouge_zh_score: the `rouge` 1.0.1 package itself, as the official code calls it (ROUGE-L F, any
  exception gives 0.0), at the stack depth eval.py calls it from, so its recursive LCS backtrack overflows exactly
  where it does there.
- code_sim_score: first line without "`", "#", "//", then the `fuzzywuzzy` 0.18.0 package's `fuzz.ratio` / 100,
  with its matcher chosen explicitly: "difflib" (what the official requirements install) or "levenshtein"
  (python-Levenshtein).
- classification_score: the official list-removal-while-iterating loop, which skips the element after each
  removed one.
- count_score / retrieval_score / retrieval_zh_score: Unicode `\\d+`, string comparison.

`scorer` and `scorer_e` are eval.py's aggregation: the first-line rule for trec/triviaqa/samsum/lsht, max over
answers, a sequential sum with Python `round` (LongBench) or `np.mean` with NumPy rounding (LongBench-E buckets).
"""

from __future__ import annotations

import difflib
import math
import re
import string
import threading
import warnings
from collections import Counter
from typing import Any, Callable, Mapping, Sequence


FUZZ_BACKENDS = ("difflib", "levenshtein")
_FUZZ_LOCK = threading.Lock()

# --------------------------------------------------------------------------------------------------------------
# Normalisation and token F1

_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCT).split())


def _f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    num_same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if num_same == 0:
        return 0  # the official code returns the int 0 here
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_cut(text: str) -> list[str]:
    import jieba  # imported on use: jieba builds its dictionary lazily and logs to stderr when it does

    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    pred = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(prediction)) if len(t) > 0]
    gt = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(ground_truth)) if len(t) > 0]
    return _f1(pred, gt)


# --------------------------------------------------------------------------------------------------------------
# ROUGE-L and code edit similarity: the official metrics.py calls pltrdy `rouge` 1.0.1 and fuzzywuzzy 0.18.0, and so
# does this module, so their values (quirks included) are the packages' own.


class _RougeAtEvalPyDepth(threading.Thread):
    """metrics.py rouge_score (rouge 1.0.1's ROUGE-L F, summary level; 0.0 on any exception), called at the stack
    depth it has under `python eval.py`.

    rouge backtracks its LCS recursively, one Python frame per step, so whether a long sentence pair scores or
    overflows the recursion limit (RecursionError, which the official bare `except:` turns into 0.0) depends on how
    deep the stack already is. Under eval.py rouge_score is the third frame (<module> -> scorer -> rouge_score); a
    fresh thread's `run` is the third frame too (_bootstrap -> _bootstrap_inner -> run), so the limit falls where it
    falls for eval.py, whatever the caller's depth (a test runner, the report, a sweep)."""

    def __init__(self, prediction: str, ground_truth: str) -> None:
        super().__init__(daemon=True)
        self.args = (prediction, ground_truth)
        self.result = 0.0

    def run(self) -> None:
        from rouge import Rouge

        prediction, ground_truth = self.args
        try:
            scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
        except Exception:  # the official bare except
            self.result = 0.0
            return
        self.result = scores["rouge-l"]["f"]

    def score(self) -> float:
        self.start()
        self.join()
        return self.result


class _RougeZhAtEvalPyDepth(_RougeAtEvalPyDepth):
    """metrics.py rouge_zh_score: jieba words joined by single spaces, then rouge_score, one frame deeper."""

    def __init__(self, prediction: str, ground_truth: str) -> None:
        super().__init__(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))

    def run(self) -> None:
        super().run()


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _RougeAtEvalPyDepth(prediction, ground_truth).score()


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _RougeZhAtEvalPyDepth(prediction, ground_truth).score()


def _sequence_matcher(backend: str) -> type:
    if backend == "difflib":
        return difflib.SequenceMatcher
    if backend == "levenshtein":
        try:
            import Levenshtein  # noqa: F401  (fuzzywuzzy's StringMatcher is python-Levenshtein's ratio)
            from fuzzywuzzy.StringMatcher import StringMatcher
        except ImportError:
            raise ImportError("fuzz_backend=levenshtein needs python-Levenshtein "
                              "(pip install 'kvbench[levenshtein]')") from None
        return StringMatcher
    raise ValueError(f"unknown fuzz backend '{backend}'; choose one of: {', '.join(FUZZ_BACKENDS)}")


def fuzz_ratio(s1: str | None, s2: str | None, backend: str = "difflib") -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio` with its matcher chosen explicitly: fuzzywuzzy itself takes
    python-Levenshtein's StringMatcher when that is importable and difflib's SequenceMatcher otherwise, so the same
    prediction could score differently on two machines. "difflib" is what the official requirements install."""
    matcher = _sequence_matcher(backend)
    with warnings.catch_warnings():  # fuzzywuzzy warns on import when python-Levenshtein is absent: chosen above
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz
    with _FUZZ_LOCK:  # fuzz.ratio reads its module-level SequenceMatcher: set it for this call only
        saved = fuzz.SequenceMatcher
        fuzz.SequenceMatcher = matcher
        try:
            return fuzz.ratio(s1, s2)
        finally:
            fuzz.SequenceMatcher = saved


def code_sim_score(prediction: str, ground_truth: str, fuzz_backend: str = "difflib", **kwargs: Any) -> float:
    """metrics.py code_sim_score: the first line without "`", "#" or "//", then fuzz.ratio / 100."""
    pred = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            pred = line
            break
    return fuzz_ratio(pred, ground_truth, fuzz_backend) / 100


# --------------------------------------------------------------------------------------------------------------
# Classification, counting, retrieval


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    matches = [c for c in kwargs["all_classes"] if c in prediction]
    # Removing from the list being iterated skips the element after each removed one: official behaviour, kept.
    for t in matches:
        if t in ground_truth and t != ground_truth:
            matches.remove(t)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    right = sum(1 for num in numbers if str(num) == str(target))
    return 0.0 if len(numbers) == 0 else float(right / len(numbers))


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _fraction_equal(prediction, ground_truth)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


# --------------------------------------------------------------------------------------------------------------
# eval.py aggregation

DATASET2METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score, "hotpotqa": qa_f1_score, "2wikimqa": qa_f1_score, "musique": qa_f1_score,
    "dureader": rouge_zh_score, "gov_report": rouge_score, "qmsum": rouge_score, "multi_news": rouge_score,
    "vcsum": rouge_zh_score, "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "lsht": classification_score, "passage_count": count_score, "passage_retrieval_en": retrieval_score,
    "passage_retrieval_zh": retrieval_zh_score, "lcc": code_sim_score, "repobench-p": code_sim_score,
}
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
E_BUCKETS = ("0-4k", "4-8k", "8k+")

# Leaderboard categories (README "Avg" = mean of the category means; not computed by eval.py).
EN_CATEGORIES: dict[str, tuple[str, ...]] = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique"),
    "summarization": ("gov_report", "qmsum", "multi_news"),
    "few_shot": ("trec", "triviaqa", "samsum"),
    "synthetic": ("passage_count", "passage_retrieval_en"),
    "code": ("lcc", "repobench-p"),
}
ZH_CATEGORIES: dict[str, tuple[str, ...]] = {
    "single_doc_qa": ("multifieldqa_zh",), "multi_doc_qa": ("dureader",), "summarization": ("vcsum",),
    "few_shot": ("lsht",), "synthetic": ("passage_retrieval_zh",), "code": ("lcc", "repobench-p"),
}
EN16 = tuple(d for ds in EN_CATEGORIES.values() for d in ds)
# Table headers of the categories (the LongBench paper's Table 1 names).
CATEGORY_TITLES = {"single_doc_qa": "Single Doc. QA", "multi_doc_qa": "Multi Doc. QA",
                   "summarization": "Summarization", "few_shot": "Few-shot Learning", "synthetic": "Synthetic",
                   "code": "Code"}


def _metric_for(dataset: str) -> Callable[..., float]:
    if dataset not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench dataset '{dataset}'; choose one of: {', '.join(DATASET2METRIC)}")
    return DATASET2METRIC[dataset]


def first_line(prediction: str) -> str:
    """eval.py's rule for trec/triviaqa/samsum/lsht: only "\\n" is stripped and split on."""
    return prediction.lstrip("\n").split("\n")[0]


def sample_score(dataset: str, prediction: str, answers: Sequence[str], all_classes: Any,
                 fuzz_backend: str = "difflib") -> float:
    """eval.py's per-sample score (0-1): first-line rule where it applies, max of the metric over the answers."""
    metric = _metric_for(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = first_line(prediction)
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes, fuzz_backend=fuzz_backend))
    return score


def scorer(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]], all_classes: Any,
           fuzz_backend: str = "difflib") -> float:
    """eval.py `scorer`: round(100 * sequential sum / n, 2) with Python's round."""
    total_score = 0.0
    for prediction, ground_truths in zip(predictions, answers):
        total_score += sample_score(dataset, prediction, ground_truths, all_classes, fuzz_backend)
    return round(100 * total_score / len(predictions), 2)


def length_bucket(length: int) -> str:
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def scorer_e(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]], lengths: Sequence[int],
             all_classes: Any, fuzz_backend: str = "difflib") -> dict[str, float]:
    """eval.py `scorer_e`: per length bucket, round(100 * np.mean(scores), 2) with NumPy's rounding.

    An empty bucket gives NaN, as np.mean([]) does in the original (its RuntimeWarning is silenced here).
    """
    import numpy as np

    scores: dict[str, list[float]] = {b: [] for b in E_BUCKETS}
    for prediction, ground_truths, length in zip(predictions, answers, lengths):
        scores[length_bucket(length)].append(sample_score(dataset, prediction, ground_truths, all_classes,
                                                          fuzz_backend))
    out = {}
    for b, vals in scores.items():
        if not vals:
            out[b] = math.nan
            continue
        # round() on np.float64 is NumPy's rint(x * 100) / 100, which differs from Python's at .xx5 values.
        out[b] = float(round(100 * np.mean(vals), 2))
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def summary_recipe(datasets: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The leaderboard-style averages over `datasets` (their scores named by dataset) as a metrics.aggregate recipe,
    in summary_scores' order: only the averages all of whose datasets are among `datasets` (and a mean_of leaves
    one out when a part has no score), avg_selected over the datasets there are, in the order given. The Chinese
    leaderboard's code category is the English one (the same two datasets), so it names cat:code."""
    have = set(datasets)
    out: dict[str, dict[str, Any]] = {f"cat:{c}": {"mean_of": list(m)} for c, m in EN_CATEGORIES.items()
                                      if have.issuperset(m)}
    if len(out) == len(EN_CATEGORIES):
        out["avg_leaderboard"] = {"mean_of": [f"cat:{c}" for c in EN_CATEGORIES]}
    if have.issuperset(EN16):
        out["avg_en16"] = {"mean_of": list(EN16)}
    zh = {c: m for c, m in ZH_CATEGORIES.items() if any(d not in EN16 for d in m)}
    out.update({f"cat_zh:{c}": {"mean_of": list(m)} for c, m in zh.items() if have.issuperset(m)})
    if all(have.issuperset(m) for m in ZH_CATEGORIES.values()):
        out["avg_zh_leaderboard"] = {"mean_of": [f"cat_zh:{c}" if c in zh else f"cat:{c}" for c in ZH_CATEGORIES]}
    if datasets:
        out["avg_selected"] = {"mean_of": list(datasets), "skip_missing": True}
    return out


def summary_scores(per_dataset: dict[str, float]) -> dict[str, float]:
    """Leaderboard-style averages from per-dataset scores (eval.py's rounded values).

    Keys: `cat:<category>` (English category means), `avg_leaderboard` (mean of the six English category
    means, the README's "Avg"), `avg_en16` (plain mean over the 16 English datasets, what KV-cache papers
    report), `cat_zh:<category>` and `avg_zh_leaderboard` (Chinese leaderboard), each only when all of its
    datasets are present; `avg_selected` is the plain mean over whatever datasets are present. Computed through
    `summary_recipe`, the recipe a LongBench run writes into metrics.json `layout`.
    """
    from kvbench.metrics.aggregate import aggregate_scores

    return aggregate_scores([], summary_recipe(list(per_dataset)), known=per_dataset)


def records_score(records: Sequence[Mapping[str, Any]], dataset: str, fuzz_backend: str = "difflib") -> float:
    """eval.py's dataset score from predictions.jsonl records of one dataset, in their order (`scorer`; all_classes
    from the last record, as eval.py keeps the last row's)."""
    return scorer(dataset, [r["prediction"] for r in records], [r["answers"] for r in records],
                  (records[-1].get("meta") or {}).get("all_classes"), fuzz_backend=fuzz_backend)


def records_score_e(records: Sequence[Mapping[str, Any]], dataset: str, bucket: str,
                    fuzz_backend: str = "difflib") -> float:
    """eval.py's LongBench-E score of one length bucket from the records of one dataset (`scorer_e`; NaN when the
    bucket is empty)."""
    return scorer_e(dataset, [r["prediction"] for r in records], [r["answers"] for r in records],
                    [r["meta"]["length"] for r in records], (records[-1].get("meta") or {}).get("all_classes"),
                    fuzz_backend=fuzz_backend)[bucket]
