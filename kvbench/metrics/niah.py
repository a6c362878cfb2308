"""Needle-in-a-Haystack scorers (the official tester uses an LLM judge; these are the label-based replacements).

- substring: 1 if the expected answer span occurs in the prediction, else 0. Case-insensitive; runs of whitespace
  are collapsed to one space on both sides first, so a line break inside the model's answer does not matter.
  This is the "recall accuracy" used for NIAH heatmaps in KV-cache papers.
- rouge1x10: ROUGE-1 F-measure x 10 of the prediction against the needle, as in FranxYao's
  Long-Context-Data-Engineering and NVIDIA kvpress (`rouge_score.RougeScorer(['rouge1'], use_stemmer=True)`).
  Tokenization follows rouge_score (lowercase, every non [a-z0-9] char is a separator); the Porter stemmer is
  NOT applied (rouge_score/nltk are not dependencies), so inflected variants of needle words do not match.
"""

from __future__ import annotations

import re
from collections import Counter

_WS = re.compile(r"\s+")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def _norm(s: str) -> str:
    return _WS.sub(" ", s).strip().lower()


def substring_match(prediction: str, answer: str) -> float:
    """1.0 if the whitespace-normalised, lower-cased answer occurs in the prediction, else 0.0."""
    a = _norm(answer)
    return 1.0 if a and a in _norm(prediction) else 0.0


def rouge_tokens(text: str) -> list[str]:
    """rouge_score's default tokenizer without stemming."""
    return [t for t in _NON_ALNUM.sub(" ", text.lower()).split() if t]


def rouge1x10(prediction: str, needle: str) -> float:
    """ROUGE-1 F (target = needle, prediction = model output) times 10, in [0, 10]."""
    target, pred = Counter(rouge_tokens(needle)), Counter(rouge_tokens(prediction))
    overlap = sum((target & pred).values())
    precision = overlap / max(sum(pred.values()), 1)
    recall = overlap / max(sum(target.values()), 1)
    if precision + recall == 0:
        return 0.0
    return 10 * 2 * precision * recall / (precision + recall)
