"""The claims table: each seed paper's qualitative claim, the setting it was tested in, the numbers, and whether
it holds on the runs at hand (`kvbench-report CLAIM_RUNS --claims NIAH_GRID_RUNS RULER_RUNS --out OUT`); and two
models' claims tables side by side (`--beside OTHER/claims.csv --names OTHER THIS`).

CLAIM_RUNS is scripts/claims.sh's scratch directory (one sub-directory per claim); NIAH_GRID_RUNS and RULER_RUNS
hold the runs of scripts/niah_grid.sh and scripts/ruler_4k.sh (scratch or the committed results/*/runs/; "-" or a
directory that does not exist: none). A claim whose runs are missing is listed as "not run". Writes OUT/claims.md,
OUT/claims.csv and OUT/claims_tests.csv (every paired test with its raw and Holm-adjusted p).

Verdicts of "A beats B" claims come from paired comparisons at equal budget: the two runs' average score (NIAH:
the mean over all cells; RULER: the mean of the per-length task means) over the samples both ran, its 95 % paired
bootstrap interval and the paired test (exact McNemar for 0/100 scores, else sign flips; kvbench.metrics.stats).
A comparison is resolved when the interval excludes 0 and its Holm-adjusted p < 0.05. The Holm family (Holm 1979,
kvbench.metrics.stats.holm) is every paired test that enters a verdict of the one claims.md: each claim's
comparisons at every budget and against every rival, on the 0/100 score and on the graded score (the threshold
claim has no paired test); claims.md shows the raw and the adjusted p of each, and claims_tests.csv lists the
family, one row per test. "holds": resolved in the claimed direction at
every budget (and against every named rival); "reversed": resolved the other way at some budget; otherwise
"not resolved (n = ...)". The last column gives the smallest difference those n could resolve: with 0/100 scores
the exact McNemar test needs at least 6 discordant pairs all one way (2 * 0.5^6 = 0.031 < 0.05), so 100 * 6 / n
points. Where no two runs hold the same samples the verdict reads "no paired runs found" and the numbers are the
plain averages.

Side by side, claims are matched by their text. Two verdicts per model: on the 0/100 score ("holds?") and on the
graded score (the paired test on answer_logprob; the first words of its column). A verdict is *resolved* when it is
"holds" or "reversed" (a paired test that excludes 0 at p < 0.05), or for threshold claims "holds" / "does not
hold"; "not resolved", "mixed", "no paired runs found" and "not run" are not. Per score: both resolved the same way
= "agree", resolved opposite ways = "disagree", one resolved = "only <model>", neither = "neither resolves it".
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from kvbench.metrics.stats import PairedResult, holm, mcnemar_min_discordant, resolved
from kvbench.report.collect import Entry, ReportError, collect_entries
from kvbench.report.paired import compare_entries
from kvbench.report.samples import LOGPROB
from kvbench.run.labels import NA

# The model's name as its card spells it, for the title (a preset not listed here shows its preset name).
MODEL_TITLES = {"smollm2-135m": "SmolLM2-135M-Instruct", "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}
HEAD = ["claim", "paper", "setting", "numbers", "holds?", "smallest resolvable difference", "graded score"]
TESTS_HEAD = ["claim", "score", "budget", "winner", "rival", "n", "diff", "ci_low", "ci_high", "p_value", "p_holm",
              "resolved"]
_MEMO: dict[tuple[int, int, str | None], tuple[PairedResult, bool] | None] = {}
# Adjusted p of a result (Holm over the family); the identity until claims_table() has seen the family.
Adjust = Callable[[PairedResult], float]


def _raw(r: PairedResult) -> float:
    return r.p_value


def compare(a: Entry, b: Entry, score: str | None = None) -> tuple[PairedResult, bool] | None:
    """compare_entries, once per pair and score (claims_table() builds the table twice: to gather the Holm family,
    then with the adjusted p values)."""
    key = (id(a), id(b), score)
    if key not in _MEMO:
        _MEMO[key] = compare_entries(a, b, score=score)
    return _MEMO[key]


def adjusted(r: PairedResult, adjust: Adjust) -> PairedResult:
    return replace(r, p_value=adjust(r))


def p_text(r: PairedResult, adjust: Adjust) -> str:
    return f"p = {r.p_value:.2g}, Holm p = {adjust(r):.2g}"


_ENTRIES: dict[str, list[Entry]] = {}


def entries(root: Path) -> list[Entry]:
    """The entries below `root`, read once (the same objects on both passes of claims_table, so the memo of compare
    holds)."""
    if str(root) not in _ENTRIES:
        _ENTRIES[str(root)] = _read_entries(root)
    return _ENTRIES[str(root)]


def _read_entries(root: Path) -> list[Entry]:
    if not root.is_dir():
        return []
    try:
        return collect_entries(root)[0]
    except Exception:  # noqa: BLE001 - an unreadable directory counts as missing
        return []


def pick(es: list[Entry], policy: str, task: str | None = None, **settings: Any) -> dict[Any, Entry]:
    """Entries of `policy` (and `task`) whose settings match, by budget."""
    out = {}
    for e in es:
        if e.policy != policy or (task and e.task != task):
            continue
        if all(str(e.settings.get(k)) == str(v) for k, v in settings.items()):
            out[e.budget] = e
    return out


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def verdict(wins: list[int]) -> str:
    """Threshold claims (not "A beats B"): wins per budget, +1 (met), -1 (not met)."""
    if not wins:
        return "not run"
    if all(w > 0 for w in wins):
        return "holds"
    if any(w > 0 for w in wins):
        return "mixed"
    return "does not hold"


def paired_verdict(results: list[PairedResult | None], adjust: Adjust = _raw) -> str:
    """results: winner - rival per (budget, rival); None where the two runs cannot be paired. Resolved on the
    adjusted p (`adjust`)."""
    found = [r for r in results if r is not None]
    if not found:
        return "no paired runs found"
    signs = [resolved(adjusted(r, adjust)) for r in found]
    if any(s < 0 for s in signs):
        return "reversed"
    if len(found) == len(results) and all(s > 0 for s in signs):
        return "holds"
    ns = "/".join(str(n) for n in dict.fromkeys(r.n for r in found))
    missing = "" if len(found) == len(results) else f"; {len(results) - len(found)} comparison(s) without paired runs"
    return f"not resolved (n = {ns}{missing})"


def resolvable(results: list[tuple[PairedResult, bool] | None]) -> str:
    """The smallest difference the claim's smallest n could resolve (0/100 scores: exact McNemar, every
    discordant pair in the claimed direction)."""
    found = [r for r in results if r is not None]
    if not found:
        return "-"
    n = min(r.n for r, _ in found)
    if not all(binary for _, binary in found):
        return f"n = {n} (graded scores: no closed-form bound)"
    k = mcnemar_min_discordant()
    if n < k:
        return f"needs n >= {k} (n = {n})"
    return f"{100 * k / n:.0f} points ({k} of n = {n} samples one way)"


def setting_text(e: Entry) -> str:
    s = e.settings
    proto = s.get("protocol")
    block = s.get("block")
    if proto is None:  # a kvbench without the protocol setting: block=null is one forward + one eviction
        proto = "one forward, one eviction, evict while decoding (block=null)" if block is None else \
            f"block-wise B={block}"
    elif block not in (None, NA):
        proto += f" B={block}"
    return str(proto)


def grid_text(e: Entry) -> str:
    """The task grid a run covered, from its config (so QUICK runs say what they really ran)."""
    s = e.settings
    if e.task == "niah":
        lengths, depths = json.loads(s.get("task.context_lengths", "[]")), json.loads(s.get("task.depths", "[]"))
        return f"NIAH {'/'.join(map(str, lengths))} tokens x depths {'/'.join(f'{d:g}' for d in depths)} %"
    if e.task == "ruler":
        tasks, lengths = json.loads(s.get("task.tasks", "[]")), json.loads(s.get("task.lengths", "[]"))
        named = ", ".join(tasks) if len(tasks) <= 3 else f"{len(tasks)} tasks"
        return (f"RULER {'/'.join(map(str, lengths))} tokens, {named}, "
                f"{s.get('task.num_samples')} sample(s) per task")
    return ""


def pairwise(name: str, paper: str, what: str, winner: dict[Any, Entry], others: dict[str, dict[Any, Entry]],
             extra: str = "", full: Entry | None = None, adjust: Adjust | None = None,
             tests: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """One claim's row. `adjust`: the Holm-adjusted p of each result (default: Holm over this claim's own tests);
    `tests`: where each paired test is appended (one claims_tests.csv row, p_holm and resolved filled by
    claims_table)."""
    if adjust is None:
        own: list[dict[str, Any]] = []
        pairwise(name, paper, what, winner, others, extra, full, _raw, own)
        ps = holm([t["result"].p_value for t in own])
        table = {id(t["result"]): q for t, q in zip(own, ps)}
        adjust = lambda r: table[id(r)]  # noqa: E731
    tests = [] if tests is None else tests
    budgets = sorted(b for b in winner if all(b in o for o in others.values()))
    if not budgets:
        return {"claim": name, "paper": paper, "setting": what, "numbers": "-", "holds?": "not run",
                "smallest resolvable difference": "-", "graded score": "-"}
    parts, results = [], []
    for b in budgets:
        w = winner[b]
        line = [f"N={b}: {w.policy} {fmt(w.average)}"]
        for label, o in others.items():
            r = compare(w, o[b])  # the average score, over the samples both ran
            results.append(r)
            text = f"{label} {fmt(o[b].average)}"
            if r is not None:
                p = r[0]
                tests.append({"claim": name, "score": w.average_key, "budget": b, "winner": w.policy, "rival": label,
                              "result": p})
                text += f" (diff {p.diff:+.1f} [{p.ci_low:+.1f}, {p.ci_high:+.1f}], {p_text(p, adjust)}, n = {p.n})"
            line.append(text)
        parts.append(", ".join(line))
    setting = f"{grid_text(winner[budgets[0]]) or what}; {setting_text(winner[budgets[0]])}"
    numbers = "; ".join(parts)
    if full is not None:
        numbers += f"; {full_on_same(full, winner[budgets[0]])}"
    if extra:
        numbers += f"; {extra}"
    return {"claim": name, "paper": paper, "setting": setting, "numbers": numbers or "-",
            "holds?": paired_verdict([None if r is None else r[0] for r in results], adjust),
            "smallest resolvable difference": resolvable(results),
            "graded score": graded(name, winner, others, budgets, adjust, tests)}


def full_on_same(full: Entry, w: Entry) -> str:
    """The full cache's mean score over the samples `w` ran (its ceiling on those very samples: a grid's full-cache
    run may cover more cells than a claim's slice)."""
    ids = [i for i in w.records if i in full.records]
    if not ids:
        return f"full cache {fmt(full.average)} (all its samples)"
    mean = sum(float(full.records[i]["score"]) for i in ids) / len(ids)
    return f"full cache {fmt(mean)} on the same {len(ids)} samples"


def signed(x: float) -> str:
    """A graded difference to 2 decimals, or in scientific notation where 2 decimals would show a resolved
    difference as +0.00."""
    return f"{x:+.2f}" if x == 0 or abs(x) >= 0.005 else f"{x:+.1e}"


def graded(name: str, winner: dict[Any, Entry], others: dict[str, dict[Any, Entry]], budgets: list[Any],
           adjust: Adjust, tests: list[dict[str, Any]]) -> str:
    """The same claim on the graded score (mean log-probability of the gold answer, nats): the paired difference
    winner - rival per budget and its verdict. It moves where the 0/100 score sits at a floor or a ceiling."""
    parts, results = [], []
    for b in budgets:
        for label, o in others.items():
            r = compare(winner[b], o[b], score=LOGPROB)
            results.append(None if r is None else r[0])
            if r is not None:
                p = r[0]
                tests.append({"claim": name, "score": LOGPROB, "budget": b, "winner": winner[b].policy,
                              "rival": label, "result": p})
                parts.append(f"N={b} vs {label}: {signed(p.diff)} [{signed(p.ci_low)}, {signed(p.ci_high)}], "
                             f"{p_text(p, adjust)}")
    if not any(r is not None for r in results):
        return "-"
    return f"{paired_verdict(results, adjust)}: " + "; ".join(parts)


def per_token(label: str, e: Entry) -> str:
    """Eviction time per processed token (prompt + decoded: block-wise eviction runs after every prompt block and
    decoding step), so runs that decode different numbers of tokens compare; the totals beside it."""
    st = e.stats
    tokens = int(st.get("prompt_tokens", 0)) + int(st.get("new_tokens", 0))
    per = 1000 * float(st.get("evict_s", 0)) / tokens if tokens else 0.0
    return (f"{label} {per:.2f} ms per token ({st.get('evict_s', 0):.1f} s over {st.get('prompt_tokens')} prompt + "
            f"{st.get('new_tokens')} decoded tokens)")


def prompt_tokens(e: Entry) -> dict[str, int]:
    out = {}
    for p in e.paths:
        f = Path(p) / "predictions.jsonl"
        if f.is_file():
            for line in f.read_text().splitlines():
                r = json.loads(line)
                out[r["id"]] = r["prompt_tokens"]
    return out


def streaming_mid_context(grid: list[Entry]) -> dict[str, str]:
    rows = pick(grid, "streamingllm", "niah")
    parts, ok = [], []
    first = next(iter(rows.values()), None)
    for b, e in sorted(rows.items()):
        tokens = prompt_tokens(e)
        by_depth: dict[float, list[float]] = {}
        for k, v in e.scores.items():
            cell = e.layout["cells"].get(k)  # (context length, depth) of a NIAH cell score, from the run's layout
            if cell and tokens.get(k, 0) > b:  # only cells where the prompt exceeds the budget (something evicted)
                by_depth.setdefault(float(cell[1]), []).append(v)
        if not by_depth:
            continue
        def mean(ds: list[float]) -> float | None:
            vals = [v for d in ds for v in by_depth.get(d, [])]
            return sum(vals) / len(vals) if vals else None

        first_d, last_d = min(by_depth), max(by_depth)
        mid = mean([d for d in by_depth if first_d < d < last_d])
        end = mean([last_d])
        parts.append(f"N={b}: depth {first_d:g} % {fmt(mean([first_d]))}, between {fmt(mid)}, {last_d:g} % "
                     f"{fmt(end)} ({sum(len(v) for v in by_depth.values())} cells with prompt > N)")
        if mid is not None and end is not None:
            ok.append(1 if mid <= 20 and end >= mid + 50 else -1)
    return {"claim": "StreamingLLM (sink + recent window) loses needles in the middle of the context once the "
                     "prompt exceeds the budget, and keeps those at the end",
            "paper": "StreamingLLM (baseline in KeyDiff, SAGE-KV, K-norm)",
            "setting": (f"{grid_text(first)}; {setting_text(first)}; " if first else "NIAH grid; ") +
                       "holds if the depths between the first and the last score <= 20 and the last depth >= that "
                       "+ 50 (a threshold on cell means, not a paired test)",
            "numbers": "; ".join(parts) or "-", "holds?": verdict(ok), "smallest resolvable difference": "-",
            "graded score": "-"}


def claims_table(claim_runs: Path, niah_runs: Path, ruler_runs: Path, out: Path) -> list[dict[str, str]]:
    """Build the rows twice: first to gather the family (every paired test a verdict reads), then with each
    test's Holm-adjusted p."""
    family: list[dict[str, Any]] = []
    build(claim_runs, niah_runs, ruler_runs, _raw, family)
    ps = holm([t["result"].p_value for t in family])
    table = {id(t["result"]): q for t, q in zip(family, ps)}
    tests: list[dict[str, Any]] = []
    rows, model = build(claim_runs, niah_runs, ruler_runs, lambda r: table[id(r)], tests)
    return write(rows, tests, table, model, out)


def build(claim_runs: Path, niah_runs: Path, ruler_runs: Path, adjust: Adjust,
          tests: list[dict[str, Any]]) -> tuple[list[dict[str, str]], Entry | None]:
    def pw(*args: Any, **kw: Any) -> dict[str, str]:
        return pairwise(*args, adjust=adjust, tests=tests, **kw)

    grid = entries(niah_runs)
    ruler = entries(ruler_runs)
    rows = []
    # KeyDiff: block-wise processing, equal budget, vs TOVA / SnapKV / H2O.
    kd = pick(grid, "keydiff", "niah")
    rows.append(pw(
        "KeyDiff beats TOVA, SnapKV and H2O at equal budget under block-wise prompt processing", "KeyDiff",
        "NIAH grid, average over all samples", kd,
        {p: pick(grid, p, "niah") for p in ("tova", "snapkv", "h2o")},
        full=next(iter(pick(grid, "full").values()), None)))
    if ruler:
        rows.append(pw(
            "KeyDiff beats TOVA, SnapKV and H2O at equal budget under block-wise prompt processing (RULER)", "KeyDiff",
            "RULER 4K, average", pick(ruler, "keydiff"),
            {p: pick(ruler, p) for p in ("tova", "snapkv", "h2o")},
            full=next(iter(pick(ruler, "full").values()), None)))
    rows.append(streaming_mid_context(grid))
    grid_full = next(iter(pick(grid, "full", "niah").values()), None)
    # K-norm vs random.
    kr = entries(claim_runs / "knorm_random")
    rows.append(pw(
        "Keeping the keys with the lowest L2 norm preserves retrieval better than random eviction at equal "
        "compression", "K-norm", "NIAH 2000 tokens, layers 0-1 not compressed for either policy",
        pick(kr, "knorm"), {"random": pick(kr, "random")}, full=grid_full))
    # CriticalKV on SnapKV and AdaKV.
    cs = entries(claim_runs / "criticalkv_snapkv")
    ca = entries(claim_runs / "criticalkv_adakv")
    rows.append(pw(
        "CriticalKV's selection (attention x ||v W_O||) improves SnapKV at equal budget", "CriticalKV",
        "NIAH 2000 tokens, max pooling, window 32", pick(cs, "criticalkv"), {"snapkv": pick(cs, "snapkv")},
        full=grid_full))
    rows.append(pw(
        "CriticalKV's selection improves AdaKV (per-head budgets) at equal budget", "CriticalKV",
        "NIAH 2000 tokens, max pooling, window 32", pick(ca, "criticalkv"), {"adakv": pick(ca, "adakv")},
        full=grid_full))
    # SAGE-KV vs StreamingLLM.
    ss = entries(claim_runs / "sagekv_streamingllm")
    rows.append(pw(
        "SAGE-KV (one attention-guided top-k selection per head group after the prompt) beats StreamingLLM at "
        "equal budget", "SAGE-KV", "NIAH 2000 tokens", pick(ss, "sagekv"),
        {"streamingllm": pick(ss, "streamingllm")}, full=grid_full))
    # HashEvict vs H2O (+ its eviction cost).
    hh = entries(claim_runs / "hashevict_h2o")
    he, h2 = pick(hh, "hashevict"), pick(hh, "h2o")
    cost = "; ".join(f"eviction time at N={b}: {per_token('hashevict', he[b])}, {per_token('h2o', h2[b])} "
                     f"(one run each, no test)" for b in sorted(he) if b in h2)
    rows.append(pw(
        "HashEvict (SimHash of keys vs the query's code) beats H2O at equal budget", "HashEvict",
        "RULER 4K niah_multikey_1 (a Figure 5 task of the paper); first 4 + latest 10 tokens protected for both",
        he, {"h2o": h2}, extra=cost, full=next(iter(pick(hh, "full").values()), None)))
    model = next((e for es in (grid, ruler, kr, cs) for e in es), None)
    return rows, model


def write(rows: list[dict[str, str]], tests: list[dict[str, Any]], table: dict[int, float], model: Entry | None,
          out: Path) -> list[dict[str, str]]:
    out.mkdir(parents=True, exist_ok=True)
    head = HEAD
    with (out / "claims.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=head)
        w.writeheader()
        w.writerows(rows)
    with (out / "claims_tests.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(TESTS_HEAD)
        for t in tests:
            r, q = t["result"], table[id(t["result"])]
            w.writerow([t["claim"], t["score"], t["budget"], t["winner"], t["rival"], r.n, round(r.diff, 6),
                        round(r.ci_low, 6), round(r.ci_high, 6), round(r.p_value, 6), round(q, 6),
                        resolved(replace(r, p_value=q))])
    src = ((model.provenance or {}).get("model_source") or {}) if model else {}
    lines = [f"# The seed papers' claims on {MODEL_TITLES.get(model.model, model.model) if model else '?'}", "",
             f"Model: {model.model if model else '?'} ({src.get('package')} {src.get('package_version')}, "
             f"{src.get('quantization')} dequantized to {src.get('dequantized_to', 'float32')}); scores 0-100 "
             f"(NIAH: substring recall; RULER: string_match). N = budget in tokens per layer and KV head.", "",
             "A screening table: 10-15 samples per run, its NIAH samples sharing haystack windows and needles, its "
             "Holm family this table alone. It came before the designed runs and decides no claim: the claims' "
             "verdicts, one Holm family per model over the designed runs, are in results/evidence.md.", "",
             "Verdicts: paired comparisons at equal budget over the samples both runs hold (diff = claimed winner - "
             "rival, 95 % paired bootstrap interval, p from the exact McNemar test for 0/100 scores, else sign "
             "flips); resolved = the interval excludes 0 and the Holm-adjusted p < 0.05. holds = resolved for the "
             "claim at every budget; reversed = resolved against it at some budget; otherwise not resolved. The "
             "graded score column puts the same claim to the paired test on each sample's answer_logprob (mean "
             "log-probability per token of the gold answer, nats; higher is better).", "",
             f"Holm family: all {len(tests)} paired tests that enter a verdict of this table (every claim's "
             "comparisons at every budget and against every rival, on the 0/100 score and on the graded score; "
             "the threshold claim has none). Each shows its raw p and its Holm-adjusted p (Holm 1979); "
             "claims_tests.csv lists them one per row.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r[h].replace("|", "/") for h in head) + " |" for r in rows]
    (out / "claims.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return rows


RESOLVED = {"holds": 1, "reversed": -1, "does not hold": -1}


def verdict_words(text: str) -> str:
    """The verdict words of a claims.csv cell: "holds: N=512 vs ..." -> "holds"; "-" or "" -> "not run"."""
    text = (text or "").strip()
    if text in ("", "-"):
        return "not run"
    return text.split(":", 1)[0].strip()


def agreement(a: str, b: str, names: tuple[str, str]) -> str:
    """Whether two models' verdicts on one score agree (see the module's docstring)."""
    va, vb = RESOLVED.get(a.split(" (")[0]), RESOLVED.get(b.split(" (")[0])
    if a == b == "not run":
        return "not run"
    if "not run" in (a, b):
        return f"not run on {names[0] if a == 'not run' else names[1]}"
    if va is not None and vb is not None:
        return "agree" if va == vb else "disagree"
    if va is not None or vb is not None:
        return f"only {names[0] if va is not None else names[1]} resolves it"
    return "neither resolves it"


def read_claims(path: Path) -> dict[str, dict[str, str]]:
    if not path.is_file():
        raise ReportError(f"no claims table at {path} (kvbench-report --claims writes it)")
    with path.open(encoding="utf-8") as f:
        return {r["claim"]: r for r in csv.DictReader(f)}


def side_by_side(path_a: Path, path_b: Path, names: tuple[str, str], out: Path) -> str:
    """The markdown of two claims.csv files' verdicts side by side, written to `out`."""
    a, b = read_claims(path_a), read_claims(path_b)
    head = ["claim", f"{names[0]}: 0/100", f"{names[0]}: graded", f"{names[1]}: 0/100", f"{names[1]}: graded",
            "0/100 score", "graded score"]
    lines = [f"# The seed papers' claims on {names[0]} and {names[1]}", "",
             f"Verdicts from `{path_a}` and `{path_b}` (kvbench-report --claims: paired tests at equal budget; "
             "holds / reversed = resolved for / against the claim; the settings, n and numbers are in those "
             "tables). The last two columns compare the two models' verdicts on each score.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim in [c for c in a if c in b] + [c for c in b if c not in a] + [c for c in a if c not in b]:
        ra, rb = a.get(claim, {}), b.get(claim, {})
        ha, hb = verdict_words(ra.get("holds?", "")), verdict_words(rb.get("holds?", ""))
        ga, gb = verdict_words(ra.get("graded score", "")), verdict_words(rb.get("graded score", ""))
        row = [claim, ha, ga, hb, gb, agreement(ha, hb, names), agreement(ga, gb, names)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return text
