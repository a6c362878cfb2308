"""The verdicts results/README.md states, generated from the committed CSVs (no sentence of a verdict is typed by
hand), and their checker.

    python scripts/verdicts.py            rewrite every block of results/README.md between its markers
    python scripts/verdicts.py --check    exit 1 (and say why) where a block differs from what the CSVs give now, or
                                          a row's verdict, numbers or Holm p contradict its test

A block sits between `<!-- verdicts:NAME:begin -->` and `<!-- verdicts:NAME:end -->`; NAME picks its source and
rows (BLOCKS below). Each verdict is one table row built from one paired test (a `Test`): who, budget, score, n,
diff with its 95 % interval, the raw p, the Holm-adjusted p and the verdict, "resolved: X higher" where the
interval excludes 0 and the adjusted p < 0.05, else "not resolved". Holm families: for a paired.csv block, the rows
of that block (kvbench-report's paired.csv corrects nothing); for a claims block, every paired test of that
claims.md (scripts/claims_table.py's claims_tests.csv, whose p_holm the checker recomputes). Claim rows say
holds / reversed / not resolved as scripts/claims_table.py defines them, recomputed here from the claim's tests.
A planned-comparisons block (an evidence folder's `tests.csv`, written by scripts/power_plan.py --tests) shows each
file's rows as one Holm family; the checker recomputes Holm over each file.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: kvbench from this checkout

from kvbench.metrics.stats import ALPHA, holm  # noqa: E402


def _side_by_side() -> ModuleType:
    """scripts/claims_side_by_side.py (a script, not a package module): its comparison of two models' verdicts."""
    spec = importlib.util.spec_from_file_location("claims_side_by_side", Path(__file__).resolve().parent /
                                                  "claims_side_by_side.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


side_compare = _side_by_side().compare

LOGPROB = "answer_logprob"
TEST_HEAD = ["a", "b", "N", "score", "n", "diff [95 % CI]", "p", "Holm p", "verdict", "n needed (uncorrected)"]
PLANNED_HEAD = TEST_HEAD[:9]  # a planned comparison: no "n needed" (tests.md gives the smallest resolvable diff)
CLAIM_TEST_HEAD = ["#", "winner", "rival", "N", "score", "n", "diff [95 % CI]", "p", "Holm p", "verdict"]
CLAIM_HEAD = ["#", "claim", "0/100 score", "graded score"]
SIDE_HEAD = ["claim", "SmolLM2-135M 0/100", "SmolLM2-135M graded", "Qwen2.5-1.5B 0/100", "Qwen2.5-1.5B graded",
             "0/100: the two models", "graded: the two models"]


@dataclass(frozen=True)
class Test:
    """One paired test as a README row shows it: a vs b (diff = a - b) at budget N on one score."""

    a: str
    b: str
    budget: str
    score: str
    n: int
    diff: float
    lo: float
    hi: float
    p: float
    q: float  # Holm-adjusted p
    need: str = ""  # paired.csv's n_required
    claim: str = ""  # claims blocks: the claim's number

    def flipped(self) -> "Test":
        return Test(self.b, self.a, self.budget, self.score, self.n, -self.diff, -self.hi, -self.lo, self.p, self.q,
                    self.need, self.claim)


def verdict(t: Test, alpha: float = ALPHA) -> str:
    """The verdict a row must state: resolved (interval excludes 0 and Holm p < alpha) with the higher side."""
    if t.q < alpha and t.lo > 0:
        return f"resolved: {t.a} higher"
    if t.q < alpha and t.hi < 0:
        return f"resolved: {t.b} higher"
    return "not resolved"


def num(x: float) -> str:
    x = round(x, 6) + 0.0  # no "-0.00" for a flipped zero
    return f"{x:+.2f}" if x == 0 or abs(x) >= 0.005 else f"{x:+.1e}"


def pval(x: float) -> str:
    return f"{x:.2g}"


def test_row(t: Test) -> list[str]:
    cells = [t.a, t.b, t.budget, t.score, str(t.n), f"{num(t.diff)} [{num(t.lo)}, {num(t.hi)}]", pval(t.p),
             pval(t.q), f"**{verdict(t)}**"]
    need = "resolved before Holm" if t.need == "resolved" else t.need
    return [t.claim, *cells] if t.claim else [*cells, need if verdict(t) == "not resolved" else "-"]


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows)]


# --- paired.csv blocks -------------------------------------------------------------------------------------------

def budget_of(settings: str) -> str:
    m = re.search(r"\bN=(\S+)", settings)
    return m.group(1) if m else "-"


def read_paired(path: Path) -> dict[tuple[str, str, str, str], dict[str, str]]:
    """paired.csv rows by (policy_a, policy_b, N, score), kept only where both sides ran the same budget (or one is
    the full cache)."""
    out = {}
    with path.open(encoding="utf-8") as f:
        for r in csv.DictReader(f):
            na, nb = budget_of(r["settings_a"]), budget_of(r["settings_b"])
            if na == nb or "-" in (na, nb):
                out[(r["policy_a"], r["policy_b"], na if na != "-" else nb, r["score"])] = r
    return out


def paired_test(r: dict[str, str], a: str, q: float = 1.0) -> Test:
    """The row as a Test with `a` first (paired.csv's order flipped where a is its policy_b)."""
    t = Test(r["policy_a"], r["policy_b"], budget_of(r["settings_a"]) if r["policy_a"] != "full" else
             budget_of(r["settings_b"]), r["score"], int(r["n"]), float(r["diff"]), float(r["ci_low"]),
             float(r["ci_high"]), float(r["p_value"]), q, r.get("n_required", ""))
    return t if t.a == a else t.flipped()


Selector = Callable[[tuple[str, str, str, str]], "str | None"]  # a paired.csv key -> the side shown first, or None


def vs_full(scores: tuple[str, ...]) -> Selector:
    def pick(k: tuple[str, str, str, str]) -> str | None:
        a, b, _, score = k
        return a if b == "full" and a != "full" and score in scores else None
    return pick


def between(first: str, others: tuple[str, ...], scores: tuple[str, ...]) -> Selector:
    def pick(k: tuple[str, str, str, str]) -> str | None:
        a, b, _, score = k
        return first if {a, b} & {first} and ({a, b} - {first}) & set(others) and score in scores else None
    return pick


def paired_tests(path: Path, select: Selector) -> list[Test]:
    rows = [(r, side) for k, r in read_paired(path).items() if (side := select(k))]
    qs = holm([float(r["p_value"]) for r, _ in rows])  # the family: this block's rows
    return [paired_test(r, side, q) for (r, side), q in zip(rows, qs)]


# --- claims blocks -----------------------------------------------------------------------------------------------

def read_claims(folder: Path) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    with (folder / "claims.csv").open(encoding="utf-8") as f:
        claims = list(csv.DictReader(f))
    with (folder / "claims_tests.csv").open(encoding="utf-8") as f:
        tests = list(csv.DictReader(f))
    return claims, tests


def claim_tests(folder: Path) -> list[Test]:
    claims, rows = read_claims(folder)
    number = {c["claim"]: str(i + 1) for i, c in enumerate(claims)}
    return [Test(r["winner"], r["rival"], r["budget"], r["score"], int(r["n"]), float(r["diff"]), float(r["ci_low"]),
                 float(r["ci_high"]), float(r["p_value"]), float(r["p_holm"]), claim=number[r["claim"]])
            for r in rows]


def claim_verdict(tests: list[Test], given: str) -> str:
    """holds / reversed / not resolved (n = ...) from a claim's tests on one score (scripts/claims_table.py's
    paired_verdict on the adjusted p); without tests, the claims.csv words (a threshold claim, or not run)."""
    if not tests:
        return given
    words = [verdict(t) for t in tests]
    if any(w == f"resolved: {t.b} higher" for w, t in zip(words, tests)):
        return "reversed"
    if all(w == f"resolved: {t.a} higher" for w, t in zip(words, tests)):
        return "holds"
    return "not resolved (n = " + "/".join(dict.fromkeys(str(t.n) for t in tests)) + ")"


def words(cell: str) -> str:
    """The verdict words of a claims.csv cell ("holds: N=512 vs ..." -> "holds"; "-" -> "not run")."""
    cell = (cell or "").strip()
    return "not run" if cell in ("", "-") else cell.split(":", 1)[0].strip()


def claim_verdicts(folder: Path) -> list[tuple[str, str, str, str]]:
    """(number, claim, 0/100 verdict, graded verdict) per claim, from its tests."""
    claims, _ = read_claims(folder)
    tests = claim_tests(folder)
    out = []
    for i, c in enumerate(claims):
        mine = [t for t in tests if t.claim == str(i + 1)]
        out.append((str(i + 1), c["claim"],
                    claim_verdict([t for t in mine if t.score != LOGPROB], words(c["holds?"])),
                    claim_verdict([t for t in mine if t.score == LOGPROB], words(c["graded score"]))))
    return out


# --- the blocks --------------------------------------------------------------------------------------------------

NIAH, RULER = ROOT / "results/niah_grid/paired.csv", ROOT / "results/ruler_4k/paired.csv"
CLAIMS, QWEN = ROOT / "results/claims", ROOT / "results/qwen2.5-coder-1.5b"
NIAH_POLICIES = ("streamingllm", "sagekv", "snapkv", "h2o_original", "adakv", "criticalkv", "tova", "pyramidkv",
                 "hashevict", "knorm", "random", "h2o")
BOTH = ("avg", LOGPROB)


def paired_block(path: Path, select: Selector, what: str) -> Callable[[], list[str]]:
    def make() -> list[str]:
        tests = paired_tests(path, select)
        shown = sorted(tests, key=lambda t: (t.score != "avg", t.budget, t.a, t.b))
        res = sum(verdict(t) != "not resolved" for t in tests)
        return [f"{what}: {res} of {len(tests)} comparisons resolved (from `{path.relative_to(ROOT)}`; Holm family: "
                f"the {len(tests)} rows below; avg = the 0/100 score, {LOGPROB} = the graded score in nats; n "
                f"needed: paired.csv's samples for the observed difference at alpha 0.05 and 80 % power, "
                f"uncorrected).", "", *table(TEST_HEAD, [test_row(t) for t in shown])]
    return make


def claims_block(folder: Path) -> Callable[[], list[str]]:
    def make() -> list[str]:
        tests = claim_tests(folder)
        rel = folder.relative_to(ROOT)
        return [f"From `{rel}/claims.csv` and `{rel}/claims_tests.csv` (Holm family: all {len(tests)} paired tests "
                f"of that claims.md):", "",
                *table(CLAIM_HEAD, [list(v) for v in claim_verdicts(folder)]), "",
                *table(CLAIM_TEST_HEAD, [test_row(t) for t in tests])]
    return make


def planned_tests(path: Path) -> list[Test]:
    """The rows of a power_plan.py --tests CSV that have a test (q: its Holm p over the file)."""
    with path.open(encoding="utf-8") as f:
        return [Test(r["a"], r["b"], r["budget"], r["score"], int(r["n"]), float(r["diff"]), float(r["ci_low"]),
                     float(r["ci_high"]), float(r["p"]), float(r["p_holm"])) for r in csv.DictReader(f) if r["p"]]


def planned_block(paths: tuple[Path, ...]) -> Callable[[], list[str]]:
    def make() -> list[str]:
        lines: list[str] = []
        for path in paths:
            tests = planned_tests(path)
            res = sum(verdict(t) != "not resolved" for t in tests)
            scores = ", ".join(dict.fromkeys(t.score for t in tests))
            lines += [f"`{path.relative_to(ROOT)}` ({scores}): {res} of {len(tests)} planned comparisons resolved "
                      f"(Holm family: these {len(tests)}).", "", *table(PLANNED_HEAD, [test_row(t)[:9] for t in tests]),
                      ""]
        return lines[:-1]
    return make


def side_block() -> list[str]:
    a = {c: (z, g) for _, c, z, g in claim_verdicts(CLAIMS)}
    b = {c: (z, g) for _, c, z, g in claim_verdicts(QWEN)}
    names = ("SmolLM2-135M", "Qwen2.5-1.5B")
    rows = []
    for claim in [c for c in a if c in b] + [c for c in a if c not in b] + [c for c in b if c not in a]:
        (za, ga), (zb, gb) = a.get(claim, ("not run", "not run")), b.get(claim, ("not run", "not run"))
        rows.append([claim, za, ga, zb, gb, side_compare(za, zb, names), side_compare(ga, gb, names)])
    return table(SIDE_HEAD, rows)


def _h2o_knorm(k: tuple[str, str, str, str]) -> str | None:
    pair = set(k[:2])
    if k[3] not in BOTH:
        return None
    return "h2o_original" if pair == {"h2o_original", "h2o"} else "knorm" if pair == {"knorm", "random"} else None


# The paired blocks: (source, rows, the sentence above them).
PAIRED: dict[str, tuple[Path, Selector, str]] = {
    "niah_grid:vs_full": (NIAH, vs_full(BOTH), "Every policy against the full cache"),
    "niah_grid:keydiff": (NIAH, between("keydiff", NIAH_POLICIES, BOTH),
                          "KeyDiff against every other evicting policy at equal N"),
    "niah_grid:h2o_knorm": (NIAH, _h2o_knorm, "The original H2O against KeyDiff's H2O, and K-norm against Random"),
    "ruler_4k:vs_full": (RULER, vs_full(BOTH), "Every policy against the full cache"),
    "ruler_4k:keydiff": (RULER, between("keydiff", ("tova", "snapkv", "h2o", "streamingllm"), BOTH),
                         "KeyDiff against every other policy"),
}
# Evidence folders' planned comparisons (scripts/power_plan.py --tests), one Holm family per file.
PLANNED: dict[str, tuple[Path, ...]] = {
    "evidence_lm": (ROOT / "results/evidence_lm/tests.csv",),
    "evidence_lm_essays": (ROOT / "results/evidence_lm_essays/tests.csv",),
    "evidence_knorm": (ROOT / "results/evidence_knorm/grid/tests.csv",
                       ROOT / "results/evidence_knorm/grid/tests_graded.csv"),
    "evidence_code": (ROOT / "results/evidence_code/tests.csv",),
    "evidence_niah": (ROOT / "results/evidence_niah/tests.csv", ROOT / "results/evidence_niah/tests_graded.csv",
                      ROOT / "results/evidence_niah/tests_depth.csv"),
    "evidence_qwen": (ROOT / "results/evidence_qwen/lm/tests.csv", ROOT / "results/evidence_qwen/grid/tests.csv",
                      ROOT / "results/evidence_qwen/grid/tests_graded.csv",
                      ROOT / "results/evidence_qwen/grid/tests_depth.csv",
                      ROOT / "results/evidence_qwen/code/tests.csv"),
    "evidence_ruler": (ROOT / "results/evidence_ruler/final/tests.csv",
                       ROOT / "results/evidence_ruler/final/tests_graded.csv"),
    "evidence_ruler_qwen": (ROOT / "results/evidence_ruler_qwen/final/tests.csv",
                            ROOT / "results/evidence_ruler_qwen/final/tests_graded.csv"),
    "evidence_ruler_2k": (ROOT / "results/evidence_ruler_2k/final/tests.csv",
                          ROOT / "results/evidence_ruler_2k/final/tests_graded.csv"),
    "evidence_ruler_qwen_2k": (ROOT / "results/evidence_ruler_qwen_2k/final/tests.csv",
                               ROOT / "results/evidence_ruler_qwen_2k/final/tests_graded.csv"),
}
BLOCKS: dict[str, Callable[[], list[str]]] = {
    **{name: paired_block(*spec) for name, spec in PAIRED.items()},
    "claims": claims_block(CLAIMS),
    "qwen:claims": claims_block(QWEN),
    "side_by_side": side_block,
    **{f"{name}:tests": planned_block(paths) for name, paths in PLANNED.items()},
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- verdicts:{name}:begin -->", f"<!-- verdicts:{name}:end -->"


def blocks_in(text: str) -> dict[str, str]:
    """Every block's body (between its markers, without them) by name."""
    out = {}
    for m in re.finditer(r"<!-- verdicts:(\S+):begin -->\n(.*?)<!-- verdicts:\1:end -->", text, re.S):
        out[m.group(1)] = m.group(2)
    return out


def render(name: str) -> str:
    return "\n".join(BLOCKS[name]()) + "\n"


def write(readme: Path) -> None:
    text = readme.read_text(encoding="utf-8")
    for name in blocks_in(text):
        begin, end = markers(name)
        text = re.sub(re.escape(begin) + r"\n.*?" + re.escape(end), lambda _: f"{begin}\n{render(name)}{end}", text,
                      flags=re.S)
    readme.write_text(text, encoding="utf-8")


# --- the checker: every stated verdict against its test ----------------------------------------------------------

def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def body_rows(body: str, width: int) -> list[list[str]]:
    """The data rows of the tables of `body` with `width` columns (header and separator rows left out)."""
    out = []
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    for i, ln in enumerate(lines):
        c = cells(ln)
        if len(c) != width or set(ln) <= set("|-: ") or (i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ")):
            continue
        out.append(c)
    return out


def check_test_row(c: list[str], truth: dict[tuple[str, ...], Test], claims: bool) -> list[str]:
    """A stated row against the test it names: numbers, raw and Holm p and the verdict word."""
    if claims:
        key, stated = (c[0], c[1], c[2], c[3], c[4]), c[1:10]
    else:
        key, stated = ("", c[0], c[1], c[2], c[3]), c[:9]
    t = truth.get(key) or (truth[rev].flipped() if (rev := (key[0], key[2], key[1], key[3], key[4])) in truth
                           else None)
    if t is None:
        return [f"row {' | '.join(c)}: no such test in the source"]
    want = test_row(t)[1:10] if t.claim else test_row(t)[:9]
    return [] if stated == want else [f"row {' | '.join(c)}: its test says {' | '.join(want)}"]


def holm_errors(name: str, family: list[Test]) -> list[str]:
    """A line per test of `family` whose stated Holm p is not Holm's adjustment over the family."""
    return [f"{name}: {f'claim {t.claim} ' if t.claim else ''}{t.a} vs {t.b} N={t.budget} {t.score}: p_holm {t.q} is "
            f"not Holm's {q:.6f}" for t, q in zip(family, holm([t.p for t in family])) if abs(t.q - q) > 1e-5]


def file_section(body: str, path: Path) -> str | None:
    """The part of a planned block that `planned_block` wrote for `path`: from its "`path` (...)" line to the next
    file's."""
    head = f"`{path.relative_to(ROOT)}` "
    return next((part for part in re.split(r"(?m)^(?=`)", body) if part.startswith(head)), None)


def check(name: str, body: str, tests: list[Test] | None = None,
          claims: list[tuple[str, str, str, str]] | None = None) -> list[str]:
    """Errors of one block's body: a row whose numbers, p, Holm p or verdict is not its test's, a claim row whose
    verdict is not what its tests give. `tests` / `claims`: the truth (default: read from the block's source)."""
    errors = []
    if name == "side_by_side":
        a = {c.replace("|", "/"): (z, g) for _, c, z, g in claim_verdicts(CLAIMS)}  # as a table cell shows it
        b = {c.replace("|", "/"): (z, g) for _, c, z, g in claim_verdicts(QWEN)}
        for c in body_rows(body, len(SIDE_HEAD)):
            want = [*a.get(c[0], ("not run",) * 2), *b.get(c[0], ("not run",) * 2)]
            if c[1:5] != want:
                errors.append(f"side_by_side: {c[0]}: stated {c[1:5]}, the tests give {want}")
        return errors
    folder = {"claims": CLAIMS, "qwen:claims": QWEN}.get(name)
    paths = PLANNED.get(name.removesuffix(":tests")) if name.endswith(":tests") else None
    planned = paths is not None
    if tests is None and paths is not None:
        # Each file's rows against that file's tests only: two files may hold the same comparison (the LM score's
        # StreamingLLM vs the full cache and the NIAH grid's, both answer_logprob at N = 1024)
        for path in paths:
            family = planned_tests(path)
            errors += holm_errors(name, family)  # each file's p_holm must be Holm over that file
            section = file_section(body, path)
            if section is None:
                errors.append(f"{name}: no section for {path.relative_to(ROOT)}")
                continue
            errors += check(name, section, tests=family)
        return errors
    if tests is None:
        if folder is not None:
            tests = claim_tests(folder)
            errors += holm_errors(name, tests)  # claims_tests.csv's p_holm must be Holm over the whole file
        else:
            path, select, _ = PAIRED[name]
            tests = paired_tests(path, select)
    truth = {(t.claim, t.a, t.b, t.budget, t.score): t for t in tests}
    is_claims = folder is not None or any(t.claim for t in tests)
    width = len(CLAIM_TEST_HEAD if is_claims else PLANNED_HEAD if planned else TEST_HEAD)
    rows = body_rows(body, width)
    if not rows:
        errors.append(f"{name}: no verdict rows")
    for c in rows:
        errors += [f"{name}: {e}" for e in check_test_row(c, truth, is_claims)]
    if folder is not None or claims is not None:
        given = {v[0]: v for v in (claims if claims is not None else claim_verdicts(folder))}  # type: ignore[arg-type]
        for c in body_rows(body, len(CLAIM_HEAD)):
            mine = [t for t in tests if t.claim == c[0]]
            g = given.get(c[0], (c[0], c[1], "not run", "not run"))
            want = [claim_verdict([t for t in mine if t.score != LOGPROB], g[2]),
                    claim_verdict([t for t in mine if t.score == LOGPROB], g[3])]
            if c[2:4] != want:
                errors.append(f"{name}: claim {c[0]}: stated {c[2:4]}, its tests give {want}")
    return errors


def check_readme(readme: Path) -> list[str]:
    """Every block of `readme`: generated as the CSVs give it now, and every verdict its test's."""
    text = readme.read_text(encoding="utf-8")
    found = blocks_in(text)
    errors = [f"{name}: block missing from {readme.name}" for name in BLOCKS if name not in found]
    for name, body in found.items():
        if name not in BLOCKS:
            errors.append(f"{name}: unknown block")
            continue
        errors += check(name, body)
        if body != render(name):
            errors.append(f"{name}: differs from what scripts/verdicts.py writes from the committed CSVs")
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="check results/README.md instead of writing it")
    p.add_argument("--readme", type=Path, default=ROOT / "results/README.md")
    args = p.parse_args(argv)
    if args.check:
        errors = check_readme(args.readme)
        print("\n".join(errors) or "verdicts: every block as generated, every verdict its test's")
        return 1 if errors else 0
    write(args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
