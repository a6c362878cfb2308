"""How much HF's decoding measured beside each call (kvbench-bench --hf-beside) or in lockstep with it (--hf-lockstep)
narrows the decoding goal's test: per policy of a bench JSON, the per-round ratios of its decoding per token over
HF's, against the hf-decode row's call of the same round and against the call's own reference, their spread (sample
sd) and the one-sided 95 % t bounds of their mean, as a markdown table.

    python scripts/beside_spread.py results/bench_smollm2/engine_4k_hf_beside.json [--out FILE.md]
    python scripts/beside_spread.py results/bench_smollm2/engine_4k_80b9b30.json [--out FILE.md]

Both columns come from the same calls of the policy; only the reference differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvbench.bench.goals import round_ratios
from kvbench.bench.setup import HF_DECODE
from kvbench.metrics.stats import one_sided_bounds


def spread_rows(rows: list[dict]) -> list[list[str]]:
    """One table row per policy row with references beside its calls over >= 2 rounds: name, rounds, then per
    reference (the round's hf-decode call, the call beside it) the ratios' sd and bounds (`goals.round_ratios`)."""
    hf = {r["budget"]: r for r in rows if r["policy"] == HF_DECODE}
    out = []
    for r in rows:
        if not r.get("hf_decode_s_rounds"):
            continue
        both = [round_ratios(r, hf.get(r["budget"]), beside) for beside in (False, True)]
        if None in both:
            continue
        cells = [r["policy"], str(len(both[0]))]
        for ratios in both:
            lo, hi = one_sided_bounds(ratios)
            cells += [f"{statistics.stdev(ratios):.3f}", f"{lo:.2f}x-{hi:.2f}x"]
        out.append(cells)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path,
                    help="a kvbench-bench JSON made with --hf-beside or --hf-lockstep and --repeats >= 2")
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default: print)")
    a = ap.parse_args(argv)
    try:
        rows = json.loads(a.bench.read_text())["rows"]
        table = spread_rows(rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"beside_spread: error: cannot read {a.bench}: {e}", file=sys.stderr)
        return 2
    if not table:
        print(f"beside_spread: error: {a.bench} has no rows measured with --hf-beside or --hf-lockstep over >= 2 "
              "rounds", file=sys.stderr)
        return 2
    # rows made before the references named themselves (hf_reference) were all beside
    lockstep = any(r.get("hf_reference") == "lockstep" for r in rows)
    own, how = (("HF's steps in lockstep with the call", "HF's decoding one step after each of the policy's steps "
                 "(`--hf-lockstep`)") if lockstep else
                ("HF's call beside it", "HF's call made right after the policy's own (`--hf-beside`)"))
    head = f"| policy | rounds | sd, vs the round's hf-decode call | 95 % bounds | sd, vs {own} | 95 % bounds |"
    lines = [f"Per-round ratios of decoding per token over HF's, from `{a.bench.name}`: against the round's hf-decode "
             f"call and against {how}; the same calls of each policy, two references. sd: sample standard deviation "
             "of the ratios; bounds: one-sided 95 % t bounds of their mean (`scripts/beside_spread.py`).", "", head,
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(c) + " |" for c in table]
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
