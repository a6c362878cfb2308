"""RULER's QA tasks: SQuAD and HotpotQA readers and the qa generator (gold documents among distractors).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from kvbench.tasks.base import TaskError, read_text
from kvbench.tasks.ruler.constants import TEMPLATES
from kvbench.tasks.ruler.synthetic import GenContext, Generated, fit_haystack, search_haystack


def read_squad(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """SQuAD v2.0 dev: answerable questions in file order; documents = sorted unique paragraphs."""
    data = load_json(path, "squad_path")
    try:
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {t: i for i, t in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                gold = index[p["context"]]
                for q in p["qas"]:
                    if not q.get("is_impossible", False):
                        qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                    "context": [gold], "more_context": [i for i in article if i != gold]})
    except (KeyError, TypeError) as e:
        raise TaskError(f"squad_path {path}: not a SQuAD v2.0 file (missing {e})") from None
    return qas, docs


def read_hotpotqa(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """HotpotQA dev distractor: documents = sorted unique "title\\nsentences"; gold = the question's 10 docs."""
    data = load_json(path, "hotpot_path")
    try:
        docs = sorted({f"{t}\n{''.join(s)}" for d in data for t, s in d["context"]})
        index = {t: i for i, t in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{t}\n{''.join(s)}"] for t, s in d["context"]]} for d in data]
    except (KeyError, TypeError, ValueError) as e:
        raise TaskError(f"hotpot_path {path}: not a HotpotQA distractor file ({e})") from None
    return qas, docs


def load_json(path: str | Path, what: str) -> Any:
    p = Path(path).expanduser()
    if not p.is_file():
        raise TaskError(f"{what} not found: {p}")
    try:
        return json.loads(read_text(p))
    except json.JSONDecodeError as e:
        raise TaskError(f"{what} {p}: not valid JSON ({e.msg})") from None


def gen_qa(c: GenContext, qas: list[dict[str, Any]], docs: list[str], num_samples: int) -> list[Generated]:
    rng, template = c.rng, c.template("qa")
    if num_samples > len(qas):
        raise TaskError(f"ruler qa: num_samples={num_samples} but the file has only {len(qas)} questions")

    # RULER's document list lives for the whole generator run. A request for all of it (n >= the number of
    # documents, e.g. a search probe at 128K tokens) shuffles that list itself, in place, so from then on the
    # document ids of every question point into the shuffled order. Kept: the official data has it.
    pool = list(docs)

    def gen(index: int, n: int) -> Generated:
        q = qas[index]
        gold, more = q["context"], q.get("more_context", [])
        if n < len(pool):
            if n - len(gold) > len(more):
                taken = set(gold + more)
                extra = [i for i in range(len(pool)) if i not in taken]
                ids = gold + more + rng.sample(extra, max(0, n - len(gold) - len(more)))
            else:
                ids = gold + rng.sample(more, n - len(gold))
            chosen = [pool[i] for i in ids]
        else:
            chosen = pool
        random.Random(c.seed).shuffle(chosen)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
        return Generated(template.format(context=context, query=q["query"]), list(q["outputs"]), context)

    ttg, inc = TEMPLATES["qa"]["tokens_to_generate"], 10
    size = search_haystack(lambda n: c.ntok(gen(0, n).text), inc, ttg, c.max_len)
    return [fit_haystack(lambda n, i=i: gen(i, n), size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "qa")
            for i in range(num_samples)]
