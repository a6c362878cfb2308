"""RULER's synthetic generators (niah, variable tracking, common and frequent words extraction), each with the
official haystack-size search: how many haystack units fit the length, probed in the official order.
"""

from __future__ import annotations

import logging
import random
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvbench.tasks.base import TaskError
from kvbench.tasks.ruler.constants import DEPTHS, NEEDLE, NOISE, TEMPLATES
from kvbench.tasks.ruler.words import cwe_vocab, niah_keys

log = logging.getLogger(__name__)


@dataclass
class GenContext:
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
class Generated:
    text: str  # input + answer prefix: the prompt fed to the model
    answers: list[str]
    context: str  # the haystack part, for context_tokens
    window_start: int | None = None  # windows=per_sample: the essay word the sample's haystack starts at


def search_haystack(count: Callable[[int], int], inc: int, extra: int, max_len: int) -> int:
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


def fit_haystack(gen: Callable[[int], Generated], size: int, step: int, fits: Callable[[Generated], bool], what: str,
         accept_smallest: bool = False) -> Generated:
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


def gen_niah(c: GenContext, args: dict[str, Any], num_samples: int, essay_words: Callable[[int, int], list[str]],
          split_sents: Callable[[str], list[str]], per_sample_windows: bool = False) -> list[Generated]:
    """`essay_words(n, start)`: n words of the essay haystack from word `start` on. The official generator gives
    every sample the haystack's first words (start 0), so a run's samples share their haystack; with
    `per_sample_windows` sample k's haystack starts where sample k-1's window ends (each window's size searched for
    its own stretch of text, as the official search sizes the first), so the windows are disjoint until they wrap
    around the essays; the RNG is put back after each of those searches, so the needles and values drawn are the
    ones drawn without windows until a sample has to be drawn again to fit its length."""
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

    start = 0  # the current sample's first essay word (per_sample_windows), 0 while the size is searched

    def gen(n: int) -> Generated:
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
            sents = split_sents(" ".join(essay_words(n, start)).strip())
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
        return Generated(template.format(type_needle_v=type_v, context=context, query=query), answers, context,
                         start if windowed else None)

    ttg = TEMPLATES["niah"]["tokens_to_generate"]
    inc = 500 if tth == "essay" else 25
    if tth != "essay" and c.max_len < 4096:
        inc = 5
    windowed = per_sample_windows and tth == "essay"

    def count(n: int) -> int:
        return c.ntok(gen(n).text)

    def fits(g: Generated) -> bool:
        return c.ntok(g.text) + ttg <= c.max_len

    size = search_haystack(count, inc, ttg, c.max_len)
    out = []
    for k in range(num_samples):
        if windowed and k:
            # the next stretch of the essays, sized for itself (another stretch has other tokens per word), with the
            # RNG put back after the search so the sample's draws are the ones it gets without windows
            start += size
            state = rng.getstate()
            size = search_haystack(count, inc, ttg, c.max_len)
            rng.setstate(state)
        out.append(fit_haystack(gen, size, inc, fits, "niah"))
    return out


def vt_noise(n: int, chain_len: int) -> list[str]:
    """vt's noise haystack before the chain lines go in: `n` noise lines, or, when there are fewer lines than the
    chain has assignments, the lines cut into their sentences (each non-empty piece gets its "." back; the empty
    piece after the last "." stays), so that the chain still finds enough insertion points."""
    lines = [NOISE] * n
    if n < chain_len:
        lines = [p + "." if p.strip() else p for line in lines for p in line.split(".")]
    return lines


def gen_vt(c: GenContext, args: dict[str, Any], num_samples: int) -> list[Generated]:
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

    def gen(n: int, is_icl: bool = False) -> Generated:
        vars_, chs = chains(is_icl)
        sentences = vt_noise(n, len(chs[0]))
        for ch in chs:
            positions = sorted(rng.sample(range(len(sentences)), len(ch)))
            for j, p in enumerate(positions):
                sentences.insert(p + j, ch[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        value = chs[0][0].split("=")[-1].strip()
        text = (raw if is_icl else full).format(context=context, query=value, num_v=num_hops + 1)
        return Generated(text, vars_[0], context)

    # One-shot example: the bare task template (no chat wrapper), 500-token budget, nothing to generate.
    icl_size = search_haystack(lambda n: c.ntok(gen(n, True).text), 5, 0, 500)
    icl_gen = fit_haystack(lambda n: gen(n, True), icl_size, 5, lambda g: c.ntok(g.text) <= 500, "vt example",
                   accept_smallest=True)
    icl = icl_gen.text + " " + " ".join(icl_gen.answers) + "\n"
    icl_tokens = c.ntok(icl)

    ttg = TEMPLATES["variable_tracking"]["tokens_to_generate"]
    inc = 5 if c.max_len < 4096 else 10
    size = search_haystack(lambda n: c.ntok(gen(n).text), inc, ttg + icl_tokens, c.max_len)
    cut_key = TEMPLATES["variable_tracking"]["template"][:20]

    def with_example(n: int) -> Generated:
        # One attempt, as the official retry loop makes it: draw the sample, then new variable names and value for
        # the example, insert it before the task text; the fit is measured on this whole text.
        g = gen(n)
        ex = icl
        for item in ex.strip().split()[-num_hops - 1:]:
            ex = ex.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))).upper())
        ex = ex.replace("12345", str(nprng.randint(10000, 99999)))
        cut = g.text.index(cut_key)
        return Generated(g.text[:cut] + ex + "\n" + g.text[cut:], g.answers, g.context)

    return [fit_haystack(with_example, size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len, "vt")
            for _ in range(num_samples)]


def gen_cwe(c: GenContext, args: dict[str, Any], num_samples: int, extra_words: Callable[[],
            list[str]]) -> list[Generated]:
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

    def gen(n: int) -> Generated:
        if c.max_len < 4096:
            ex_ctx, ex_ans = example(20, 3, 1)
            context, answers = example(n, 6, 1)
        else:
            ex_ctx, ex_ans = example(40, 10, 3)
            context, answers = example(n, freq_cw, freq_ucw)
        shot = template.format(context=ex_ctx, query="") + " " + " ".join(f"{i + 1}. {w}"
                                                                          for i, w in enumerate(ex_ans))
        return Generated(shot + "\n" + template.format(context=context, query=""), answers, context)

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
    return [fit_haystack(gen, size, inc, lambda g: c.ntok(g.text) + ttg <= c.max_len,
                         "cwe") for _ in range(num_samples)]


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1, scipy.special.zeta as in the official code (at s = 2 it equals pi^2 / 6 bit for bit)."""
    from scipy.special import zeta

    return float(zeta(s))


def gen_fwe(c: GenContext, args: dict[str, Any], num_samples: int) -> list[Generated]:
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

    def text_for(v: list[str], n: int) -> Generated:
        ranks = np.arange(1, len(v) + 1)
        counts = (n * (ranks ** -alpha) / z).astype(int)
        lst = [w for w, k in zip(v, counts) for _ in range(k)]
        random.Random(c.seed).shuffle(lst)
        context = " ".join(lst)
        return Generated(template.format(context=context, query=""), v[1:4], context)

    # Sizing: one vocabulary; grow the word count by `inc` while the text is still shorter than max_len (each
    # grown text measured), then step back once: the last size measured below max_len.
    v = vocab()
    n = max_len // wordlen
    while c.ntok(text_for(v, n).text) < max_len:
        n += inc
    n -= inc

    def sample() -> Generated:
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
