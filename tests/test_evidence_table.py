"""scripts/evidence_table.py: a claim's verdict on each evidence folder's planned tests, worked by hand."""

from __future__ import annotations

from helpers import load_script

et = load_script("evidence_table")


def _t(a: str, b: str, diff: float, lo: float, hi: float, holm: float, verdict: str, n: int = 106) -> dict:
    return {"a": a, "b": b, "budget": "512", "score": "answer_logprob", "n": str(n), "diff": str(diff),
            "ci_low": str(lo), "ci_high": str(hi), "p": "0.0002", "p_holm": str(holm), "verdict": verdict}


def test_a_rival_resolved_above_the_winner_reverses_the_claim() -> None:
    tests = [_t("keydiff", "tova", -0.472, -0.623, -0.321, 0.0008, "resolved: tova higher"),
             _t("keydiff", "snapkv", -0.05, -0.2, 0.1, 0.4, "not resolved")]
    cell = et.evidence_cell("keydiff", ("tova", "snapkv", "h2o"), tests)
    assert cell == ("**reversed**: vs tova (N=512): tova higher, -0.472 [-0.623, -0.321], n = 106, Holm p = 0.0008; "
                    "vs snapkv (N=512): not resolved, -0.050 [-0.200, +0.100], n = 106, Holm p = 0.4; vs h2o: not run")


def test_the_difference_is_turned_to_winner_minus_rival() -> None:
    # the folder compared random:knorm (diff = random - knorm = -0.152): for "knorm beats random" it is +0.152, and
    # the interval [-0.176, -0.129] becomes [+0.129, +0.176]
    tests = [_t("random", "knorm", -0.152, -0.176, -0.129, 0.0008, "resolved: knorm higher", n=100)]
    assert et.evidence_cell("knorm", ("random",), tests) == (
        "**holds**: vs random (N=512): knorm higher, +0.152 [+0.129, +0.176], n = 100, Holm p = 0.0008")


def test_holds_where_run_and_not_run() -> None:
    tests = [_t("hashevict", "tova", 0.2, 0.1, 0.3, 0.01, "resolved: hashevict higher")]
    assert et.evidence_cell("hashevict", ("tova", "h2o"), tests).startswith("**holds where run**: vs tova")
    assert et.evidence_cell("sagekv", ("streamingllm",), tests) == "not run"
    # an untested planned comparison (no paired runs: empty p) counts as not run
    untested = [{**_t("sagekv", "streamingllm", 0, 0, 0, 1, "no paired runs"), "p": ""}]
    assert et.evidence_cell("sagekv", ("streamingllm",), untested) == "not run"


def test_table_rows_and_pipes_escaped(tmp_path) -> None:
    claims = [{"claim": "CriticalKV's selection (attention x ||v W_O||) improves SnapKV", "holds?": "not resolved (n = 15)",
               "graded score": "reversed: N=512 ..."},
              {"claim": "StreamingLLM (sink + recent window) loses needles in the middle", "holds?": "holds: ...",
               "graded score": "-"}]
    text = et.build([claims], ["M"], [[_t("criticalkv", "snapkv", 0.1, 0.05, 0.15, 0.01, "resolved: criticalkv higher")]],
                    ["code"])
    rows = [ln for ln in text.splitlines() if ln.startswith("| CriticalKV") or ln.startswith("| StreamingLLM")]
    assert rows[0].startswith("| CriticalKV's selection (attention x \\|\\|v W_O\\|\\|) improves SnapKV | "
                              "not resolved (n = 15); graded: reversed | **holds**: vs snapkv")
    # (the depth claim reads depth-cell rows only: this column has none)
    assert rows[1] == ("| StreamingLLM (sink + recent window) loses needles in the middle | holds; graded: not run | "
                       "not run |")
    assert et.main(["--claims", str(tmp_path / "none.csv"), "--names", "M", "--tests", str(tmp_path / "t.csv"),
                    "--test-names", "c", "--out", str(tmp_path / "o.md")]) == 2


def test_a_zero_difference_reads_plus_zero_whichever_way_it_is_turned() -> None:
    # a 0/100 comparison with no discordant pair: diff 0 [0, 0], stored as rival - winner (flipped to -0.0)
    tests = [_t("adakv", "criticalkv", 0.0, 0.0, 0.0, 1, "not resolved", n=10)]
    assert et.evidence_cell("criticalkv", ("adakv",), tests) == (
        "**not resolved**: vs adakv (N=512): not resolved, +0.000 [+0.000, +0.000], n = 10, Holm p = 1")


def _write(path, rows: list[dict]) -> str:
    import csv

    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_two_folders_joined_in_one_column(tmp_path) -> None:
    # the designed grid's tests and K-norm's on the same grid: one column, each row with its own folder's Holm p
    claims = _write(tmp_path / "claims.csv", [
        {"claim": "Keeping the keys with the lowest L2 norm preserves retrieval", "holds?": "not resolved (n = 15)",
         "graded score": "not resolved (n = 15)"},
        {"claim": "SAGE-KV beats StreamingLLM", "holds?": "not resolved (n = 15)", "graded score": "-"}])
    grid = _write(tmp_path / "grid.csv", [_t("sagekv", "streamingllm", -31.2, -40.9, -21.5, 2.6e-08,
                                             "resolved: streamingllm higher", n=93)])
    knorm = _write(tmp_path / "knorm.csv", [_t("knorm", "random", 12.0, 4.0, 20.0, 0.004, "resolved: knorm higher",
                                               n=93)])
    out = tmp_path / "o.md"
    assert et.main(["--claims", claims, "--names", "M", "--tests", f"{grid}+{knorm}", "--test-names", "grid",
                    "--out", str(out)]) == 0
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| Keeping") or ln.startswith("| SAGE")]
    assert rows[0].endswith("| **holds**: vs random (N=512): knorm higher, +12.000 [+4.000, +20.000], n = 93, "
                            "Holm p = 0.004 |")
    assert rows[1].endswith("| **reversed**: vs streamingllm (N=512): streamingllm higher, -31.200 [-40.900, "
                            "-21.500], n = 93, Holm p = 2.6e-08 |")
    # the same comparison in both joined files is refused
    assert et.main(["--claims", claims, "--names", "M", "--tests", f"{grid}+{grid}", "--test-names", "grid",
                    "--out", str(out)]) == 2


def test_a_rival_compared_at_two_budgets_shows_both_and_holds_only_if_both_do() -> None:
    # K-norm vs Random at N = 1536 (not resolved) and 1792 (resolved for K-norm): both listed; the claim is not
    # resolved on this score (it holds at one budget only)
    tests = [{**_t("knorm", "random", 0.082, -0.018, 0.184, 0.12, "not resolved", n=93), "budget": "1536"},
             {**_t("knorm", "random", 0.036, 0.008, 0.063, 0.026, "resolved: knorm higher", n=93), "budget": "1792"}]
    assert et.evidence_cell("knorm", ("random",), tests) == (
        "**not resolved**: vs random (N=1536): not resolved, +0.082 [-0.018, +0.184], n = 93, Holm p = 0.12; "
        "vs random (N=1792): knorm higher, +0.036 [+0.008, +0.063], n = 93, Holm p = 0.026")
    assert et.evidence_cell("knorm", ("random",), tests[1:]).startswith("**holds**")


def test_ruler_columns_serve_only_the_ruler_claim(tmp_path) -> None:
    # KeyDiff's claim on NIAH and on RULER: the NIAH grid's column serves the first, the RULER run's the second
    claims = _write(tmp_path / "claims.csv", [
        {"claim": "KeyDiff beats TOVA, SnapKV and H2O at equal budget", "holds?": "not resolved (n = 15)",
         "graded score": "-"},
        {"claim": "KeyDiff beats TOVA, SnapKV and H2O at equal budget (RULER)", "holds?": "not resolved (n = 10)",
         "graded score": "-"}])
    niah = _write(tmp_path / "niah.csv", [_t("keydiff", "tova", 12.0, 1.0, 23.0, 0.2, "not resolved", n=93)])
    ruler = _write(tmp_path / "ruler.csv", [_t("keydiff", "tova", 93.0, 79.0, 100.0, 0.001, "resolved: keydiff higher",
                                               n=14)])
    out = tmp_path / "o.md"
    assert et.main(["--claims", claims, "--names", "M", "--tests", niah, ruler, "--test-names", "grid", "ruler",
                    "--ruler", "2", "--out", str(out)]) == 0
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| KeyDiff")]
    assert rows[0].endswith("| **not resolved**: vs tova (N=512): not resolved, +12.000 [+1.000, +23.000], n = 93, "
                            "Holm p = 0.2; vs snapkv: not run; vs h2o: not run | - |")
    assert rows[1].endswith("| - | **holds where run**: vs tova (N=512): keydiff higher, +93.000 [+79.000, +100.000], "
                            "n = 14, Holm p = 0.001; vs snapkv: not run; vs h2o: not run |")
    assert et.main(["--claims", claims, "--names", "M", "--tests", niah, "--test-names", "grid", "--ruler", "2",
                    "--out", str(out)]) == 2


def _depth(budget: str, depth: int, diff: float, lo: float, hi: float, holm: float, verdict: str) -> dict:
    return {**_t("streamingllm", "full", diff, lo, hi, holm, verdict, n=31), "budget": budget,
            "score": f"L2000_D{depth}"}


def test_the_depth_claim_holds_where_an_earlier_needle_is_lost_and_the_last_is_not() -> None:
    tests = [_depth("512", 90, 0.0, 0.0, 0.0, 1, "not resolved"),
             _depth("512", 10, -71.0, -87.1, -54.8, 2.4e-06, "resolved: full higher"),
             _depth("512", 50, -80.6, -93.5, -64.5, 3.6e-07, "resolved: full higher"),
             _t("keydiff", "tova", 1.0, 0.5, 1.5, 0.01, "resolved: keydiff higher")]  # not a depth row: ignored
    assert et.depth_cell(tests) == (
        "**holds** (streamingllm - full): N=512: depth 10 %: lost, -71.000 [-87.100, -54.800], n = 31, Holm p = "
        "2.4e-06; depth 50 %: lost, -80.600 [-93.500, -64.500], n = 31, Holm p = 3.6e-07; depth 90 %: no loss "
        "resolved, +0.000 [+0.000, +0.000], n = 31, Holm p = 1")
    # a budget where no earlier needle is lost leaves the claim unresolved; a lost last needle reverses it
    calm = [_depth("1024", 10, 3.0, -9.0, 19.0, 1, "not resolved"),
            _depth("1024", 90, 3.0, 0.0, 9.7, 1, "not resolved")]
    assert et.depth_cell(tests + calm).startswith("**not resolved**")
    last_lost = [_depth("2048", 10, -50.0, -70.0, -30.0, 0.001, "resolved: full higher"),
                 _depth("2048", 90, -40.0, -60.0, -20.0, 0.002, "resolved: full higher")]
    assert et.depth_cell(tests + last_lost).startswith("**reversed**")
    assert et.depth_cell([tests[3]]) == "not run"
