"""`kvbench-bench --against OLD.json NEW.json`: one kvbench-bench table against an earlier one, policy by policy.

Per policy in both: its prompt time and its decoding time per token, earlier and now, and their ratio (now /
earlier); and the same ratios with each time over HF's measured in its own run (the prompt over the `hf-decode` row's
prompt forward, the decoding over HF's steps beside or in lockstep: `decode_vs_hf`), so that a move of the machine
between the two runs cancels. The goal lines judge the HF-relative ratios (the raw ones where a run had no HF
reference): neither more than `limit` above the earlier one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    return {r["policy"]: r for r in rows if r.get("decode_ms_per_token") is not None}


def _ratio(now: float | None, before: float | None) -> float | None:
    return None if now is None or not before else round(now / before, 3)


def against(old: Path, new: Path, limit: float = 1.10) -> tuple[list[dict[str, Any]], str, list[str]]:
    """(rows, markdown table, goal lines) for the policies both tables measured."""
    before, now = _rows(old), _rows(new)
    hf = [t.get("hf-decode", {}).get("prefill_s") for t in (before, now)]  # HF's prompt forward in each run
    rows = []
    for name in sorted(set(before) - {"hf-decode"} & set(now)):
        a, b = before[name], now[name]
        prompt = _ratio(b["prefill_s"], a["prefill_s"])
        decode = _ratio(b["decode_ms_per_token"], a["decode_ms_per_token"])
        prompt_hf = _ratio(b["prefill_s"] / hf[1], a["prefill_s"] / hf[0]) if all(hf) else None
        decode_hf = _ratio(b.get("decode_vs_hf"), a.get("decode_vs_hf"))
        rows.append({"policy": name, "prefill_s_before": a["prefill_s"], "prefill_s": b["prefill_s"],
                     "prefill_ratio": prompt, "prefill_ratio_hf": prompt_hf,
                     "decode_ms_before": a["decode_ms_per_token"], "decode_ms": b["decode_ms_per_token"],
                     "decode_ratio": decode, "decode_ratio_hf": decode_hf})
    head = ("| policy | prompt s (before) | prompt s | x | x (HF-relative) | decode ms/tok (before) | decode ms/tok | "
            "x | x (HF-relative) |\n|---|---|---|---|---|---|---|---|---|")
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")
    table = "\n".join([f"`{new.name}` against `{old.name}`; HF-relative: each time over HF's in its own run.", "",
                       head] + [
        f"| {r['policy']} | {r['prefill_s_before']:.2f} | {r['prefill_s']:.2f} | {fmt(r['prefill_ratio'])} | "
        f"{fmt(r['prefill_ratio_hf'])} | {r['decode_ms_before']:.1f} | {r['decode_ms']:.1f} | "
        f"{fmt(r['decode_ratio'])} | {fmt(r['decode_ratio_hf'])} |" for r in rows]) + "\n"
    lines = []
    for r in rows:
        judged = [r["prefill_ratio_hf"] or r["prefill_ratio"], r["decode_ratio_hf"] or r["decode_ratio"]]
        lines.append(f"{r['policy']}: prompt {fmt(judged[0])}x, decoding {fmt(judged[1])}x the earlier table's "
                     f"(HF-relative where measured): {'PASS' if max(judged) <= limit else 'MISS'} against <= {limit}x")
    return rows, table, lines
