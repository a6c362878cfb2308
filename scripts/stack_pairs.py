"""Chronological vs stacked decoding, paired by round: the table of a `smollm2-4k-stack` part (scripts/bench_gpu.sh)
or any `kvbench-bench` run with rows NAME+chrono and NAME (one eviction per layer per decoding step, and every layer's
eviction in one call with slot reuse), over one or more runs of it. With --prefill: the prompt instead, NAME (each
layer's prompt eviction on its own) vs NAME+stackprefill (every layer's in one call), the table of a
`smollm2-4k-prefill-stack` part.

For each policy: the eviction per decoding step (`evict_decode_s` / decoding steps; with --prefill the prompt's
eviction, `evict_prefill_s`) and the decoding time per token (the prompt's seconds) of both ways, run by run; the
per-round ratios old / new way of the decoding (prompt) seconds (the two ran one after the other in each interleaved
round, so a round pairs them), their geometric mean, and a one-sided t test on their logarithms that the new way is
faster (`metrics.stats.one_sided_p`), Holm-corrected over the policies (`metrics.stats.holm`).

    python scripts/stack_pairs.py results/bench_gpu/smollm2-4k-stack-h200.json \
        results/bench_gpu/smollm2-4k-stack-h200_r2.json --out results/bench_gpu/stack_pairs_h200.md
    python scripts/stack_pairs.py --prefill results/bench_gpu/smollm2-4k-prefill-stack-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvbench.bench.setup import CHRONO, STACK_PREFILL  # the row suffixes kvbench-bench names its variants by
from kvbench.metrics.stats import ALPHA, holm, one_sided_p


def pairs(runs: list[list[dict[str, Any]]], prefill: bool = False) -> list[dict[str, Any]]:
    """One entry per policy with a marked row (NAME+chrono, or NAME+stackprefill with `prefill`) and a NAME row in
    every run, in the first run's order. `evict_ms` and `time_ms` hold [old way, new way] run by run: per decoding
    step and token, or (`prefill`) for the whole prompt; the old way is NAME+chrono, or NAME with `prefill`."""
    mark, phase = (STACK_PREFILL, "prefill") if prefill else (CHRONO, "decode")
    by_run = [{r["policy"]: r for r in rows} for rows in runs]
    names = [p[:-len(mark)] for p in by_run[0] if p.endswith(mark) and p[:-len(mark)] in by_run[0]]
    out = []
    for name in names:
        if not all(name in rr and name + mark in rr for rr in by_run):
            raise ValueError(f"policy '{name}' lacks its {name}{mark} or {name} row in a run")
        old, new = (name, name + mark) if prefill else (name + mark, name)
        olds, news = [rr[old] for rr in by_run], [rr[new] for rr in by_run]
        logs = [math.log(o / n) for orow, nrow in zip(olds, news)
                for o, n in zip(orow[f"{phase}_s_rounds"], nrow[f"{phase}_s_rounds"])]
        p = one_sided_p(logs, 0.0)
        per = (lambda r: 1) if prefill else (lambda r: r["decode_steps"])
        time = (lambda r: 1000 * r["prefill_s"]) if prefill else (lambda r: r["decode_ms_per_token"])
        out.append({"policy": name,
                    "evict_ms": [[1000 * r[f"evict_{phase}_s"] / per(r) for r in rs] for rs in (olds, news)],
                    "time_ms": [[time(r) for r in rs] for rs in (olds, news)],
                    "rounds": len(logs), "ratio": math.exp(sum(logs) / len(logs)),
                    "p": None if p is None else p[1]})
    tested = [e for e in out if e["p"] is not None]
    for e, adj in zip(tested, holm([e["p"] for e in tested])):
        e["holm"] = adj
    return out


def markdown(entries: list[dict[str, Any]], sources: list[str], way: str = "stacked", prefill: bool = False) -> str:
    """The table; `way` names what the new way's rows do that the old way's do not (`--way`); `prefill`: the prompt's
    pairs (`pairs(..., prefill=True)`)."""
    runs = " / ".join(f"run {i + 1}" for i in range(len(sources)))

    def each(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    if prefill:
        old, title = "per layer", f"The prompt's evictions per layer (`NAME`) vs {way} (`NAME{STACK_PREFILL}`)"
        evict, time, seconds = "prompt eviction ms", "prompt ms", "prompt"
    else:
        old, title = "chrono", f"Chronological (`NAME{CHRONO}`) vs {way} (`NAME`) decoding"
        evict, time, seconds = "decoding eviction ms/step", "decoding ms/token", "decoding"
    lines = [f"{title}, from {', '.join(sources)}; figures are {runs} (each a run's median of its rounds); the ratio is "
             f"the geometric mean of the per-round {old} / {way} {seconds} seconds; p: one-sided t test on their "
             f"logarithms ({way} faster), Holm over the {len(entries)} policies.", "",
             f"| policy | {evict}, {old} | {way} | {time}, {old} | {way} | rounds | "
             f"ratio | p | Holm p | {way} faster at 95 % (Holm) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        p, h = e["p"], e.get("holm")
        verdict = "not tested" if h is None else ("yes" if h <= ALPHA else "not resolved")
        lines.append(f"| {e['policy']} | {each(e['evict_ms'][0])} | {each(e['evict_ms'][1])} | "
                     f"{each(e['time_ms'][0])} | {each(e['time_ms'][1])} | {e['rounds']} | {e['ratio']:.2f}x | "
                     f"{'-' if p is None else f'{p:.2g}'} | {'-' if h is None else f'{h:.2g}'} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path, help="kvbench-bench JSONs with NAME+chrono and NAME rows")
    ap.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    ap.add_argument("--way", default="stacked",
                    help="what the NAME rows do, for the table's words (default: stacked; e.g. 'free rows' for the "
                         "per-head policies, which never stack: their NAME+chrono rows store heads compact)")
    ap.add_argument("--prefill", action="store_true",
                    help="pair the prompt instead: NAME (each layer's prompt eviction on its own) vs NAME+stackprefill")
    a = ap.parse_args(argv)
    try:
        runs = [json.loads(p.read_text(encoding="utf-8"))["rows"] for p in a.json]
        entries = pairs(runs, a.prefill)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        print(f"stack_pairs: cannot pair the runs' rows: {e}", file=sys.stderr)
        return 2
    if not entries:
        print(f"stack_pairs: no policy has both a NAME{STACK_PREFILL if a.prefill else CHRONO} and a NAME row",
              file=sys.stderr)
        return 2
    text = markdown(entries, [p.as_posix() for p in a.json], a.way, a.prefill)
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
