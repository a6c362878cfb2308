"""RULER (NVIDIA/RULER @ c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a), generated at run time with the evaluated model's
tokenizer. Generation rules: benchmarks.md §2.2-§2.4 and docs/ruler.md; metrics: kvbench.metrics.ruler.

For each (length, task) the official generator script runs in a fresh process seeded with `random.seed(42)` and
`np.random.seed(42)`; here each (length, task) gets its own `random.Random(seed)` / `np.random.RandomState(seed)`,
which produce the same streams, and every probe of the haystack-size search draws from them in the official order.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import random
import re
import string
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, read_text
from kvbench.tasks.haystack import (chat_wrapper, encode_prompt, filler_text, haystack_label, prefix_token_count,
                                    read_haystack_dir)
from kvbench.tasks.haystack import sentence_splitter as pick_splitter

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------------------------------
# Word lists (wonderwords 2.2.0 assets)

def _wonderwords(name: str) -> list[str]:
    # wonderwords 2.2.0 reads its lists with the deprecated importlib.resources.open_text, on import too.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from wonderwords import random_word
        except ImportError:
            raise TaskError("RULER needs the `wonderwords==2.2.0` package (its word lists)") from None
        return random_word._get_words_from_text_file(name)


class SortedKeySpace(Sequence[str]):
    """`sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))` without building its millions of strings.

    Strings of two adjectives interleave only when one adjective extends the other by "-..." ("blue" and
    "blue-eyed"); such families are merged and sorted explicitly, every other adjective is one contiguous block
    "<adj>-<noun in sorted order>". Indexing is exact, so `random.choice` draws the official key.
    """

    def __init__(self, adjs: Sequence[str], nouns: Sequence[str]) -> None:
        adjs = sorted(set(adjs))
        self._nouns = sorted(set(nouns))
        root: dict[str, str] = {}
        for a in adjs:  # sorted: a prefix adjective is seen before its extensions
            parents = [r for r in root if a.startswith(r + "-")]
            root[a] = root[min(parents, key=len)] if parents else a
        families: dict[str, list[str]] = {}
        for a, r in root.items():
            families.setdefault(r, []).append(a)
        blocks: list[tuple[str, Any]] = []
        for r, members in families.items():
            if len(members) == 1:
                blocks.append((f"{r}-{self._nouns[0]}", r))
            else:
                merged = sorted({f"{m}-{n}" for m in members for n in self._nouns})
                blocks.append((merged[0], merged))
        blocks.sort(key=lambda b: b[0])
        self._blocks = [b for _, b in blocks]
        self._starts: list[int] = []
        total = 0
        for b in self._blocks:
            self._starts.append(total)
            total += len(self._nouns) if isinstance(b, str) else len(b)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        b, j = self._blocks[k], i - self._starts[k]
        return f"{b}-{self._nouns[j]}" if isinstance(b, str) else b[j]


@functools.lru_cache(maxsize=1)
def niah_keys() -> SortedKeySpace:
    return SortedKeySpace(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))


@functools.lru_cache(maxsize=1)
def cwe_vocab() -> tuple[str, ...]:
    return tuple(sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                            + _wonderwords("verblist.txt"))))


# ---------------------------------------------------------------------------------------------------------------
# Generation state shared by the generators

@dataclass
class _Ctx:
    tokenizer: Any
    max_len: int
    seed: int
    chat_pre: str
    chat_post: str
    rng: random.Random
    nprng: np.random.RandomState

    def ntok(self, text: str) -> int:
        """RULER's HF count: `tokenizer.tokenize(text)`, no special tokens added."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def template(self, kind: str) -> str:
        """Chat wrapper around the task template, then the answer prefix (prepare.py)."""
        esc = lambda s: s.replace("{", "{{").replace("}", "}}")  # noqa: E731
        t = TEMPLATES[kind]
        return esc(self.chat_pre) + t["template"] + esc(self.chat_post) + t["answer_prefix"]


@dataclass
class _Gen:
    text: str  # input + answer prefix: the prompt fed to the model
    answers: list[str]
    context: str  # the haystack part, for context_tokens


def _search(count: Callable[[int], int], inc: int, extra: int, max_len: int) -> int:
    """RULER's haystack-size search (since 56ea4ef): probe `inc` units for tokens/unit (bare count), then binary
    search [inc, max(int(max_len/tpu*3), 2*inc)] for the largest size with count + extra <= max_len. Each
    `count` call generates a full sample and so advances the RNG exactly as the official probes do."""
    tpu = count(inc) / inc
    lo, hi = inc, max(int(max_len / tpu * 3), inc * 2)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(mid) + extra <= max_len:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best if best is not None else inc


def _fit(gen: Callable[[int], _Gen], size: int, step: int, fits: Callable[[_Gen], bool], what: str,
         accept_smallest: bool = False) -> _Gen:
    """Per-sample retry: regenerate (fresh RNG draws) and shrink by `step` while over budget. At the smallest size
    the official loop retries forever; here it gives up after a few draws (a clear error), or, with
    `accept_smallest`, keeps the over-budget smallest sample."""
    tries_at_min = 0
    while True:
        g = gen(size)
        if fits(g):
            return g
        if size > step:
            size -= step
            continue
        if accept_smallest:
            log.warning("ruler: %s does not fit its budget even at the smallest size; using it anyway", what)
            return g
        tries_at_min += 1
        if tries_at_min >= 20:
            raise TaskError(f"ruler: cannot fit a {what} sample into the length budget with this tokenizer; "
                            "use a larger length")


# ---------------------------------------------------------------------------------------------------------------
# Generators

def _niah(c: _Ctx, args: dict[str, Any], num_samples: int, essay_words: Callable[[int], list[str]],
          split_sents: Callable[[str], list[str]]) -> list[_Gen]:
    tth, tk, tv = args["type_haystack"], args["type_needle_k"], args["type_needle_v"]
    nq, nv = args["num_needle_q"], args["num_needle_v"]
    nk = max(args["num_needle_k"], nq)
    rng = c.rng
    keys_space = niah_keys() if "words" in (tk, tv) else None

    def rand(kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return rng.choice(keys_space)
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise TaskError(f"ruler: unknown needle type '{kind}'; choose one of: numbers, words, uuids")

    template, type_v = c.template("niah"), tv
    if nq * nv == 1:  # official singular rewrite, applied to the whole template (chat wrapper included)
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_v = tv[:-1]

    def gen(n: int) -> _Gen:
        keys, values, needles = [], [], []
        for _ in range(nk):
            keys.append(rand(tk))
            vals = []
            for _ in range(nv):
                vals.append(rand(tv))
                needles.append(NEEDLE.format(type_needle_v=tv, key=keys[-1], value=vals[-1]))
            values.append(vals)
        random.Random(c.seed).shuffle(needles)
        if tth == "essay":
            sents = split_sents(" ".join(essay_words(n)).strip())
            pos = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(pos)):
                parts.append(" ".join(sents[pos[i - 1]:pos[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if tth == "noise":
                sentences = [NOISE] * n
            else:
                sentences = [NEEDLE.format(type_needle_v=tv, key=rand(tk), value=rand(tv)) for _ in range(n)]
            for idx, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                sentences.insert(idx, needle)
            context = "\n".join(sentences)
        picked = rng.sample(range(nk), nq)
        queries = [keys[i] for i in picked]
        answers = [a for i in picked for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return _Gen(template.format(type_needle_v=type_v, context=context, query=query), answers, context)

    ttg = TEMPLATES["niah"]["tokens_to_generate"]
    inc = 500 if tth == "essay" else 25
    if tth != "essay" and c.max_len < 4096:
        inc = 5
    size = _search(lambda n: c.ntok(gen(n).text), inc, ttg, c.max_len)
    return [_fit(gen, size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "niah") for _ in range(num_samples)]


def vt_noise(n: int, chain_len: int) -> list[str]:
    """vt's noise haystack before the chain lines go in: `n` noise lines, or, when there are fewer lines than the
    chain has assignments, the lines cut into their sentences (each non-empty piece gets its "." back; the empty
    piece after the last "." stays), so that the chain still finds enough insertion points."""
    lines = [NOISE] * n
    if n < chain_len:
        lines = [p + "." if p.strip() else p for line in lines for p in line.split(".")]
    return lines


def _vt(c: _Ctx, args: dict[str, Any], num_samples: int) -> list[_Gen]:
    num_chains, num_hops = args["num_chains"], args["num_hops"]
    rng, nprng = c.rng, c.nprng
    raw = TEMPLATES["variable_tracking"]["template"] + TEMPLATES["variable_tracking"]["answer_prefix"]
    full = c.template("variable_tracking")

    def chains(is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k, hops = (3, min(10, num_hops)) if is_icl else (5, num_hops)
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        vars_ret, chains_ret = [], []
        for i in range(0, len(names) - hops, hops + 1):  # whole chains only (the official code would crash)
            v = names[i:i + hops + 1]
            vars_ret.append(v)
            first = "12345" if is_icl else str(nprng.randint(10000, 99999))
            chains_ret.append([f"VAR {v[0]} = {first}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(hops)])
        return vars_ret, chains_ret

    def gen(n: int, is_icl: bool = False) -> _Gen:
        vars_, chs = chains(is_icl)
        sentences = vt_noise(n, len(chs[0]))
        for ch in chs:
            positions = sorted(rng.sample(range(len(sentences)), len(ch)))
            for j, p in enumerate(positions):
                sentences.insert(p + j, ch[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        value = chs[0][0].split("=")[-1].strip()
        text = (raw if is_icl else full).format(context=context, query=value, num_v=num_hops + 1)
        return _Gen(text, vars_[0], context)

    # One-shot example: the bare task template (no chat wrapper), 500-token budget, nothing to generate.
    icl_size = _search(lambda n: c.ntok(gen(n, True).text), 5, 0, 500)
    icl_gen = _fit(lambda n: gen(n, True), icl_size, 5, lambda g: c.ntok(g.text) <= 500, "vt example",
                   accept_smallest=True)
    icl = icl_gen.text + " " + " ".join(icl_gen.answers) + "\n"
    icl_tokens = c.ntok(icl)

    ttg = TEMPLATES["variable_tracking"]["tokens_to_generate"]
    inc = 5 if c.max_len < 4096 else 10
    size = _search(lambda n: c.ntok(gen(n).text), inc, ttg + icl_tokens, c.max_len)
    cut_key = TEMPLATES["variable_tracking"]["template"][:20]

    def with_example(n: int) -> _Gen:
        # One attempt, as the official retry loop makes it: draw the sample, then new variable names and value for
        # the example, insert it before the task text; the fit is measured on this whole text.
        g = gen(n)
        ex = icl
        for item in ex.strip().split()[-num_hops - 1:]:
            ex = ex.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))).upper())
        ex = ex.replace("12345", str(nprng.randint(10000, 99999)))
        cut = g.text.index(cut_key)
        return _Gen(g.text[:cut] + ex + "\n" + g.text[cut:], g.answers, g.context)

    return [_fit(with_example, size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "vt")
            for _ in range(num_samples)]


def _cwe(c: _Ctx, args: dict[str, Any], num_samples: int, extra_words: Callable[[], list[str]]) -> list[_Gen]:
    freq_cw, freq_ucw, num_cw = args["freq_cw"], args["freq_ucw"], args["num_cw"]
    rng = c.rng
    words = list(cwe_vocab())
    random.Random(c.seed).shuffle(words)
    template = c.template("common_words_extraction")

    def example(n: int, cr: int, ucr: int) -> tuple[str, list[str]]:
        pool = words if n <= len(words) else extra_words()
        if n > len(pool):
            raise TaskError(f"ruler cwe: needs {n} distinct words but the vocabulary has {len(pool)}")
        full = rng.sample(pool, n)
        common, uncommon = full[:num_cw], full[num_cw:]
        lst = common * int(cr) + uncommon * int(ucr)
        random.Random(c.seed).shuffle(lst)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common

    def gen(n: int) -> _Gen:
        if c.max_len < 4096:
            ex_ctx, ex_ans = example(20, 3, 1)
            context, answers = example(n, 6, 1)
        else:
            ex_ctx, ex_ans = example(40, 10, 3)
            context, answers = example(n, freq_cw, freq_ucw)
        shot = template.format(context=ex_ctx, query="") + " " + " ".join(f"{i + 1}. {w}"
                                                                          for i, w in enumerate(ex_ans))
        return _Gen(shot + "\n" + template.format(context=context, query=""), answers, context)

    ttg, inc = TEMPLATES["common_words_extraction"]["tokens_to_generate"], 10
    tpw = c.ntok(gen(4096).text) / 4096
    lo, hi, best = inc, int(c.max_len // tpw) * 2, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if c.ntok(gen(mid).text) + ttg <= c.max_len:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    size = best if best is not None else inc
    return [_fit(gen, size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "cwe") for _ in range(num_samples)]


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (scipy.special.zeta in the official code); exact closed form at s = 2."""
    if s == 2.0:
        return math.pi ** 2 / 6
    try:
        from scipy.special import zeta

        return float(zeta(s))
    except ImportError:
        raise TaskError(f"ruler fwe: alpha={s} needs scipy (alpha=2.0 does not)") from None


def _fwe(c: _Ctx, args: dict[str, Any], num_samples: int) -> list[_Gen]:
    alpha, rng = float(args["alpha"]), c.rng
    ttg = TEMPLATES["freq_words_extraction"]["tokens_to_generate"]
    max_len = c.max_len - ttg
    vocab_size, inc, wordlen = max_len // 50, max_len // 32, 6
    template = c.template("freq_words_extraction")
    z = _zeta(alpha)

    def vocab() -> list[str]:
        v = ["".join(rng.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
        while len(set(v)) < vocab_size:
            v.append("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
        v = sorted(set(v))
        random.Random(c.seed).shuffle(v)
        v[0] = "..."
        return v

    def text_for(v: list[str], n: int) -> _Gen:
        ranks = np.arange(1, len(v) + 1)
        counts = (n * (ranks ** -alpha) / z).astype(int)
        lst = [w for w, k in zip(v, counts) for _ in range(k)]
        random.Random(c.seed).shuffle(lst)
        context = " ".join(lst)
        return _Gen(template.format(context=context, query=""), v[1:4], context)

    # Sizing: one vocabulary; grow the word count by `inc` while the text is still shorter than max_len (each
    # grown text measured), then step back once: the last size measured below max_len.
    v = vocab()
    n = max_len // wordlen
    while c.ntok(text_for(v, n).text) < max_len:
        n += inc
    n -= inc

    def sample() -> _Gen:
        # One vocabulary per sample, kept while the word count shrinks by `inc` until the text fits. The official
        # loop has no floor; once no word is left only the template remains, and if even that is too long it would
        # never end.
        v, m = vocab(), n
        g = text_for(v, m)
        while c.ntok(g.text) > max_len:
            if m <= 0:
                raise TaskError("ruler: cannot fit a fwe sample into the length budget with this tokenizer; "
                                "use a larger length")
            m -= inc
            g = text_for(v, m)
        return g

    return [sample() for _ in range(num_samples)]


def read_squad(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """SQuAD v2.0 dev: answerable questions in file order; documents = sorted unique paragraphs."""
    data = _load_json(path, "squad_path")
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
    data = _load_json(path, "hotpot_path")
    try:
        docs = sorted({f"{t}\n{''.join(s)}" for d in data for t, s in d["context"]})
        index = {t: i for i, t in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{t}\n{''.join(s)}"] for t, s in d["context"]]} for d in data]
    except (KeyError, TypeError, ValueError) as e:
        raise TaskError(f"hotpot_path {path}: not a HotpotQA distractor file ({e})") from None
    return qas, docs


def _load_json(path: str | Path, what: str) -> Any:
    p = Path(path).expanduser()
    if not p.is_file():
        raise TaskError(f"{what} not found: {p}")
    try:
        return json.loads(read_text(p))
    except json.JSONDecodeError as e:
        raise TaskError(f"{what} {p}: not valid JSON ({e.msg})") from None


def _qa(c: _Ctx, qas: list[dict[str, Any]], docs: list[str], num_samples: int) -> list[_Gen]:
    rng, template = c.rng, c.template("qa")
    if num_samples > len(qas):
        raise TaskError(f"ruler qa: num_samples={num_samples} but the file has only {len(qas)} questions")

    # RULER's document list lives for the whole generator run. A request for all of it (n >= the number of
    # documents, e.g. a search probe at 128K tokens) shuffles that list itself, in place, so from then on the
    # document ids of every question point into the shuffled order. Kept: the official data has it.
    pool = list(docs)

    def gen(index: int, n: int) -> _Gen:
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
        return _Gen(template.format(context=context, query=q["query"]), list(q["outputs"]), context)

    ttg, inc = TEMPLATES["qa"]["tokens_to_generate"], 10
    size = _search(lambda n: c.ntok(gen(0, n).text), inc, ttg, c.max_len)
    return [_fit(lambda n, i=i: gen(i, n), size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "qa")
            for i in range(num_samples)]


# ---------------------------------------------------------------------------------------------------------------

class Ruler(Task):
    name = "ruler"
    average_key = "avg"

    def __init__(self, tasks: Sequence[str] = tuple(TASKS), lengths: Sequence[int] = (4096,), num_samples: int = 25,
                 haystack_dir: str | None = None, squad_path: str | None = None, hotpot_path: str | None = None,
                 cwe_words_path: str | None = None, sentence_splitter: str = "auto", filler_seed: int = 0) -> None:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise TaskError(f"unknown RULER task(s) {unknown}; choose from: {', '.join(TASKS)}")
        if not tasks or not lengths:
            raise TaskError("ruler: tasks and lengths must be non-empty lists")
        if int(num_samples) < 1:
            raise TaskError(f"ruler: num_samples must be >= 1, got {num_samples}")
        self.tasks, self.lengths, self.num_samples = list(tasks), [int(x) for x in lengths], int(num_samples)
        self.haystack_dir, self.filler_seed = haystack_dir or None, int(filler_seed)
        self.paths = {"squad": squad_path or None, "hotpotqa": hotpot_path or None}
        self.cwe_words_path = cwe_words_path or None
        self.splitter = sentence_splitter
        if sentence_splitter not in ("auto", "nltk", "regex"):
            raise TaskError(f"unknown sentence_splitter '{sentence_splitter}'; choose one of: auto, nltk, regex")
        self._essay: list[str] | None = None

    # -- data sources ---------------------------------------------------------------------------------------------
    def skipped(self) -> dict[str, str]:
        """Tasks that cannot run with this configuration -> why (qa without its local data file)."""
        out = {}
        for t in self.tasks:
            kind, args = TASKS[t]
            if kind == "qa" and not self.paths[args["dataset"]]:
                key = "squad_path (SQuAD v2.0 dev-v2.0.json)" if args["dataset"] == "squad" else \
                    "hotpot_path (hotpot_dev_distractor_v1.json)"
                out[t] = f"skipped: set task.{key} to run it"
        return out

    def _essay_words(self, n: int) -> list[str]:
        """The first n words of the essay haystack (`re.sub(r"\\s+", " ", text).split(" ")`), repeated cyclically."""
        if self.haystack_dir:
            if self._essay is None:
                self._essay = re.sub(r"\s+", " ", read_haystack_dir(self.haystack_dir)).split(" ")
            words = self._essay
            return words[:n] if n <= len(words) else (words * -(-n // len(words)))[:n]
        # The built-in filler is an endless stream: take more of it instead of repeating.
        if self._essay is None or len(self._essay) < n:
            self._essay = re.sub(r"\s+", " ", filler_text(max(n, 2 * len(self._essay or [])),
                                                          seed=self.filler_seed)).split(" ")
        return self._essay[:n]

    def _cwe_extra_words(self) -> list[str]:
        if not self.cwe_words_path:
            raise TaskError("ruler cwe: this length needs more distinct words than wonderwords has; set "
                            "task.cwe_words_path to RULER's english_words.json")
        data = _load_json(self.cwe_words_path, "cwe_words_path")
        if not isinstance(data, dict):
            raise TaskError(f"cwe_words_path {self.cwe_words_path}: expected a JSON object of words")
        return list(data.values())

    def generate(self, task: str, length: int, env: TaskEnv) -> list[_Gen]:
        """The samples of one (task, length), seeded afresh like one official generator run."""
        kind, args = TASKS[task]
        pre, post = chat_wrapper(env.tokenizer, env.chat_template)
        c = _Ctx(env.tokenizer, int(length), env.seed, pre, post, random.Random(env.seed),
                 np.random.RandomState(env.seed))
        if kind == "niah":
            return _niah(c, args, self.num_samples, self._essay_words, pick_splitter(self.splitter)[1])
        if kind == "variable_tracking":
            return _vt(c, args, self.num_samples)
        if kind == "common_words_extraction":
            return _cwe(c, args, self.num_samples, self._cwe_extra_words)
        if kind == "freq_words_extraction":
            return _fwe(c, args, self.num_samples)
        qas, docs = (read_squad if args["dataset"] == "squad" else read_hotpotqa)(self.paths[args["dataset"]])
        return _qa(c, qas, docs, self.num_samples)

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        skipped = self.skipped()
        for t, why in skipped.items():
            log.warning("ruler %s %s", t, why)
        chat = bool(env.chat_template) and bool(getattr(env.tokenizer, "chat_template", None))
        for length in self.lengths:
            for task in self.tasks:
                if task in skipped:
                    continue
                kind = TASKS[task][0]
                key = TEMPLATES[kind]["answer_prefix"][:10]
                for i, g in enumerate(self.generate(task, length, env)):
                    ids = encode_prompt(env.tokenizer, g.text, chat)
                    ctx_end = g.text.rfind(g.context) + len(g.context)
                    cut = g.text.rfind(key)
                    yield Sample(
                        id=f"{task}_L{length}_{i}", input_ids=ids, answers=list(g.answers),
                        max_new_tokens=TEMPLATES[kind]["tokens_to_generate"],
                        context_tokens=prefix_token_count(env.tokenizer, g.text, chat, ctx_end, ids), prompt=g.text,
                        meta={"task": task, "length": length, "metric": METRIC[kind],
                              "answer_prefix": g.text[cut:] if cut >= 0 else ""})

    # -- scoring --------------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.metrics import get_metric

        return 100.0 * get_metric(sample.meta["metric"])(prediction, sample.answers)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        from kvbench.metrics import get_metric
        from kvbench.metrics.ruler import dataset_score

        per: dict[tuple[str, int], list[float]] = {}
        for r in records:
            m = r["meta"]
            # Recompute the 0-1 fractions from the text: RULER rounds only once, on the dataset mean.
            per.setdefault((m["task"], int(m["length"])), []).append(
                get_metric(m["metric"])(r["prediction"], r["answers"]))
        cell = {k: dataset_score(v) for k, v in per.items()}
        tasks = [t for t in self.tasks if any(k[0] == t for k in cell)] + sorted({k[0] for k in cell} - set(self.tasks))
        lengths = sorted({k[1] for k in cell})
        out: dict[str, float] = {}
        for t in tasks:
            vals = [cell[(t, L)] for L in lengths if (t, L) in cell]
            out[t] = round(sum(vals) / len(vals), 2)
        for L in lengths:
            vals = [cell[(t, L)] for t in tasks if (t, L) in cell]
            out[f"L{L}"] = round(sum(vals) / len(vals), 2)
        if len(lengths) > 1:
            for (t, L), v in sorted(cell.items()):
                out[f"{t}_L{L}"] = v
        out["avg"] = round(sum(out[f"L{L}"] for L in lengths) / len(lengths), 2) if lengths else 0.0
        return out

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        notes = [f"ruler: generation rules of NVIDIA/RULER@{RULER_COMMIT[:7]} (docs/ruler.md); seed per (task, length)"]
        if any(TASKS[t][1].get("type_haystack") == "essay" for t in self.tasks):
            notes.append(f"ruler essay haystack: {haystack_label(self.haystack_dir)}; sentence splitter: "
                         f"{pick_splitter(self.splitter)[0]}")
        for t, why in self.skipped().items():
            notes.append(f"ruler {t}: {why}; L* and avg exclude it")
        return {"notes": notes}
