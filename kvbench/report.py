"""Result tables: metrics.json files -> markdown (printed) tables."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "" if v is None else str(v)


def metrics_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    score_cols: list[str] = []
    for m in results:
        score_cols += [k for k in m.get("scores", {}) if k not in score_cols]
    head = ["policy", "budget", "block", *score_cols, "Avg", "prefill tok/s", "decode tok/s", "evict s",
            "peak KV tok", "KV MiB"]
    rows = []
    for m in results:
        st = m.get("stats", {})
        rows.append([m.get("policy"), m.get("budget"), m.get("block") if m.get("block") is not None else "full",
                     *[m["scores"].get(c) for c in score_cols], m.get("average"), st.get("prefill_tokens_per_s"),
                     st.get("decode_tokens_per_s"), st.get("evict_s"), st.get("peak_kv_tokens"),
                     (st.get("kv_bytes_peak") or 0) / 2**20])
    return head, [[_fmt(v) for v in r] for r in rows]


def print_metrics_table(results: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    head, rows = metrics_rows(results)
    text = tabulate(rows, headers=head, tablefmt="github")
    print(text)
    return text
