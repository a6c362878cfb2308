"""Chronological vs stacked decoding, paired by round: the table of a `smollm2-4k-stack` part (scripts/bench_gpu.sh)
or any `kvbench-bench` run with rows NAME+chrono and NAME (one eviction per layer per decoding step, and every layer's
eviction in one call with slot reuse), over one or more runs of it.

For each policy: the decoding eviction per step (`evict_decode_s` / decoding steps) and the decoding time per token of
both ways, run by run; the per-round ratios chrono / stacked of the decoding seconds (the two ran one after the other
in each interleaved round, so a round pairs them), their geometric mean, and a one-sided t test on their logarithms
that the stacked way is faster (`metrics.stats.one_sided_p`), Holm-corrected over the policies (`metrics.stats.holm`).

    python scripts/stack_pairs.py results/bench_gpu/smollm2-4k-stack-h200.json \
        results/bench_gpu/smollm2-4k-stack-h200_r2.json --out results/bench_gpu/stack_pairs_h200.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvbench.metrics.stats import ALPHA, holm, one_sided_p

CHRONO = "+chrono"


def pairs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per policy with a NAME+chrono row and a NAME row in every run, in the first run's order."""
    by_run = [{r["policy"]: r for r in rows} for rows in runs]
    names = [p[:-len(CHRONO)] for p in by_run[0] if p.endswith(CHRONO) and p[:-len(CHRONO)] in by_run[0]]
    out = []
    for name in names:
        if not all(name in rr and name + CHRONO in rr for rr in by_run):
            raise ValueError(f"policy '{name}' lacks its {name}{CHRONO} or {name} row in a run")
        chrono, stacked = [rr[name + CHRONO] for rr in by_run], [rr[name] for rr in by_run]
        logs = [math.log(c / s) for cr, sr in zip(chrono, stacked)
                for c, s in zip(cr["decode_s_rounds"], sr["decode_s_rounds"])]
        p = one_sided_p(logs, 0.0)
        out.append({"policy": name,
                    "evict_ms": [[1000 * r["evict_decode_s"] / r["decode_steps"] for r in rs]
                                 for rs in (chrono, stacked)],
                    "decode_ms": [[r["decode_ms_per_token"] for r in rs] for rs in (chrono, stacked)],
                    "rounds": len(logs), "ratio": math.exp(sum(logs) / len(logs)),
                    "p": None if p is None else p[1]})
    tested = [e for e in out if e["p"] is not None]
    for e, adj in zip(tested, holm([e["p"] for e in tested])):
        e["holm"] = adj
    return out


def markdown(entries: list[dict[str, Any]], sources: list[str], way: str = "stacked") -> str:
    """The table; `way` names what the NAME rows do that the NAME+chrono rows do not (`--way`)."""
    runs = " / ".join(f"run {i + 1}" for i in range(len(sources)))

    def each(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    lines = [f"Chronological (`NAME{CHRONO}`) vs {way} (`NAME`) decoding, from {', '.join(sources)}; figures are "
             f"{runs} (each a run's median of its rounds); the ratio is the geometric mean of the per-round "
             f"chrono / {way} decoding seconds; p: one-sided t test on their logarithms ({way} faster), Holm over "
             f"the {len(entries)} policies.", "",
             f"| policy | decoding eviction ms/step, chrono | {way} | decoding ms/token, chrono | {way} | rounds | "
             f"ratio | p | Holm p | {way} faster at 95 % (Holm) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        p, h = e["p"], e.get("holm")
        verdict = "not tested" if h is None else ("yes" if h <= ALPHA else "not resolved")
        lines.append(f"| {e['policy']} | {each(e['evict_ms'][0])} | {each(e['evict_ms'][1])} | "
                     f"{each(e['decode_ms'][0])} | {each(e['decode_ms'][1])} | {e['rounds']} | {e['ratio']:.2f}x | "
                     f"{'-' if p is None else f'{p:.2g}'} | {'-' if h is None else f'{h:.2g}'} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path, help="kvbench-bench JSONs with NAME+chrono and NAME rows")
    ap.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    ap.add_argument("--way", default="stacked",
                    help="what the NAME rows do, for the table's words (default: stacked; e.g. 'free rows' for the "
                         "per-head policies, which never stack: their NAME+chrono rows store heads compact)")
    a = ap.parse_args(argv)
    try:
        runs = [json.loads(p.read_text(encoding="utf-8"))["rows"] for p in a.json]
        entries = pairs(runs)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        print(f"stack_pairs: cannot pair the runs' chrono and stacked rows: {e}", file=sys.stderr)
        return 2
    if not entries:
        print("stack_pairs: no policy has both a NAME+chrono and a NAME row", file=sys.stderr)
        return 2
    text = markdown(entries, [p.as_posix() for p in a.json], a.way)
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
