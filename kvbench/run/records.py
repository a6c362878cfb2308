"""A run's records, torch-free: predictions.jsonl read and appended one whole line at a time, the speed and memory
summary of metrics.json `stats`, and its eviction diagnostics over samples. The report reads committed runs through
this module alone, so it needs no torch (tests/test_report_torch_free.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_records(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """Finished records of a predictions file, in file order.

    A torn or unreadable line ends the file: it and everything after it are cut off (a killed run leaves at most
    its last line torn); `repair=False` only reads (reports must not modify a run that may still be going).
    A repeated id keeps its first record (appends are one line per finished sample, so a
    repeat can only come from outside interference; the first record is the one a clean run would hold).
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    records, good, seen = [], 0, set()
    for line in data.split(b"\n"):
        end = good + len(line) + 1
        if end > len(data):  # no newline: the write was interrupted
            break
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        if not isinstance(record, dict) or "id" not in record:
            break
        if record["id"] not in seen:
            seen.add(record["id"])
            records.append(record)
        good = end
    if repair and good < len(data):
        with path.open("r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One complete line per write, flushed to disk, so a kill never leaves a half record behind a good one."""
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    with path.open("ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())



def summarize(records: list[dict[str, Any]], budget: int | None, evicts: bool) -> dict[str, Any]:
    """Speed and memory over all samples (KeyDiff App. B.3 compression ratio: mean of min(1, N / L_i))."""
    prompt = sum(r["prompt_tokens"] for r in records)
    prefill = sum(r["prefill_s"] for r in records)
    steps = sum(r["decode_steps"] for r in records)
    decode = sum(r["decode_s"] for r in records)
    batched = [r for r in records if "batch" in r]
    ratio = [min(1.0, budget / r["prompt_tokens"]) if (evicts and budget) else 1.0 for r in records]
    return {
        "samples": len(records),
        "prompt_tokens": prompt,
        "new_tokens": sum(r["new_tokens"] for r in records),
        "prefill_s": round(prefill, 4),
        "decode_s": round(decode, 4),
        "prefill_tokens_per_s": round(prompt / prefill, 2) if prefill else None,
        "decode_tokens_per_s": round(steps / decode, 2) if decode and steps else None,
        "evict_s": round(sum(r["evict_s"] for r in records), 4),
        "peak_kv_tokens": max((r["peak_kv_tokens"] for r in records), default=0),
        "kv_bytes_peak": max((r["kv_bytes_peak"] for r in records), default=0),
        "compression_ratio": round(sum(ratio) / len(ratio), 6) if ratio else None,
        # Outputs that collapsed (empty, whitespace, one token or n-gram repeated); a record without the flag (made by
        # hand, in tests) counts as not degenerate.
        "degenerate": sum(1 for r in records if r.get("degenerate")),
        # batched runs (samples, or a shared group's runs as rows): the largest batch and the most K+V bytes its rows
        # held together
        **({"batch_size": max(r["batch"]["size"] for r in batched),
            "batch_kv_bytes_peak": max(r["batch"]["kv_bytes_peak"] for r in batched)} if batched else {}),
        # samples whose first prompt forwards came from a shared trunk (their prefill time: a share of it)
        **({"trunk_samples": trunk} if (trunk := sum(1 for r in records if r.get("trunk_tokens"))) else {}),
    }


def aggregate_diagnostics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's eviction diagnostics (kvbench.policies.diagnostics) over its records: the mean of the per-sample means,
    per-layer means over the samples that evicted there, the events and the largest value of any."""
    out: dict[str, Any] = {}
    for rec in records:
        for name, d in (rec.get("diagnostics") or {}).items():
            acc = out.setdefault(name, {"means": [], "layers": {}, "events": 0, "max": None})
            if d.get("mean") is not None:
                acc["means"].append(d["mean"])
            if d.get("max") is not None:
                acc["max"] = d["max"] if acc["max"] is None else max(acc["max"], d["max"])
            for li, v in d.get("per_layer", {}).items():
                acc["layers"].setdefault(li, []).append(v)
            acc["events"] += d.get("events", 0)
    return {name: {"mean": sum(a["means"]) / len(a["means"]) if a["means"] else None,
                   "per_layer": {li: sum(v) / len(v) for li, v in sorted(a["layers"].items(), key=lambda x: int(x[0]))},
                   "samples": len(a["means"]), "events": a["events"], "max": a["max"]}
            for name, a in out.items()}
