"""RULER's fixed data (NVIDIA/RULER @ c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a): the generators' templates, the 13
tasks of scripts/synthetic.yaml, their metrics, the needle and noise sentences and the needle depths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"


# scripts/data/synthetic/constants.py (TASKS): template, answer prefix and generation length of each generator.
TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                    "words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any "
                    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                    "the given documents. Only give me the answer and do not output any other words.\n\n"
                    "Question: {query}",
        "answer_prefix": " Answer:",
    },
}


# scripts/synthetic.yaml: the 13 tasks.
_NIAH = ("type_haystack", "type_needle_k", "type_needle_v", "num_needle_k", "num_needle_v", "num_needle_q")


TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah", dict(zip(_NIAH, ("noise", "words", "numbers", 1, 1, 1)))),
    "niah_single_2": ("niah", dict(zip(_NIAH, ("essay", "words", "numbers", 1, 1, 1)))),
    "niah_single_3": ("niah", dict(zip(_NIAH, ("essay", "words", "uuids", 1, 1, 1)))),
    "niah_multikey_1": ("niah", dict(zip(_NIAH, ("essay", "words", "numbers", 4, 1, 1)))),
    "niah_multikey_2": ("niah", dict(zip(_NIAH, ("needle", "words", "numbers", 1, 1, 1)))),
    "niah_multikey_3": ("niah", dict(zip(_NIAH, ("needle", "uuids", "uuids", 1, 1, 1)))),
    "niah_multivalue": ("niah", dict(zip(_NIAH, ("essay", "words", "numbers", 1, 4, 1)))),
    "niah_multiquery": ("niah", dict(zip(_NIAH, ("essay", "words", "numbers", 1, 1, 4)))),
    "vt": ("variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}


METRIC = {"niah": "string_match_all", "variable_tracking": "string_match_all",
          "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
          "qa": "string_match_part"}


NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


DEPTHS = [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
