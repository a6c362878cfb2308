"""kvbench-bench --against (two tables compared policy by policy) with values worked out by hand, and --ops (aten
operations per block and step against HF's own forward) on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.bench.cli import main


def _table(path: Path, hf_prefill: float, rows: list[tuple[str, float, float, float]]) -> Path:
    out = [{"policy": "hf-decode", "prefill_s": hf_prefill, "decode_ms_per_token": 50.0}]
    out += [{"policy": p, "prefill_s": s, "decode_ms_per_token": ms, "decode_vs_hf": vs} for p, s, ms, vs in rows]
    path.write_text(json.dumps({"rows": out, "goals": []}))
    return path


def test_against_judges_the_hf_relative_ratios(tmp_path: Path) -> None:
    """Before: HF's prompt 2 s; A 10 s and 100 ms/tok at 1.00x HF's step; B 8 s, 90 ms/tok, 1.00x. Now the machine is
    twice as slow for HF's prompt (4 s): A 22 s (raw 2.2x, HF-relative 22/4 over 10/2 = 1.1: PASS at <= 1.10x), 100
    ms/tok at 1.05x HF's (1.05: PASS); B 16 s (1.0 HF-relative), 99 ms/tok at 1.2x HF's (1.2: MISS). C is in one table
    only: left out."""
    old = _table(tmp_path / "old.json", 2.0, [("a", 10.0, 100.0, 1.0), ("b", 8.0, 90.0, 1.0), ("c", 1, 1, 1)])
    new = _table(tmp_path / "new.json", 4.0, [("a", 22.0, 100.0, 1.05), ("b", 16.0, 99.0, 1.2)])
    assert main(["--against", str(old), str(new), "--out", str(tmp_path / "cmp.json"), "--quiet"]) == 0
    got = json.loads((tmp_path / "cmp.json").read_text())
    a, b = got["rows"]
    assert (a["prefill_ratio"], a["prefill_ratio_hf"], a["decode_ratio"], a["decode_ratio_hf"]) == (2.2, 1.1, 1.0,
                                                                                                     1.05)
    assert (b["prefill_ratio_hf"], b["decode_ratio"], b["decode_ratio_hf"]) == (1.0, 1.1, 1.2)
    assert [line.rsplit(":", 1)[1].split()[0] for line in got["goals"]] == ["PASS", "MISS"]


def test_against_two_tables_without_a_common_policy_is_one_line(tmp_path: Path, capsys) -> None:
    old = _table(tmp_path / "old.json", 2.0, [("a", 1.0, 1.0, 1.0)])
    new = _table(tmp_path / "new.json", 2.0, [("b", 1.0, 1.0, 1.0)])
    assert main(["--against", str(old), str(new), "--out", str(tmp_path / "x.json"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "kvbench-bench: error: the two tables share no policy"
    assert not (tmp_path / "x.json").exists()


def test_ops_counts_each_policy_against_the_same_hf_forward(tmp_path: Path) -> None:
    """StreamingLLM (sdpa) and H2O (its attention's probabilities computed explicitly, added into its state) on a
    2-layer model: both rows against the same HF block and step; H2O's step runs more operations; each goal line
    says PASS exactly when the larger of its two ratios is within its limit (1.10x for StreamingLLM, 1.25x for H2O).
    A decoding step's functions: each policy's own file among its files, H2O's step one function more at least (its
    `on_attention`), the reading line PASS exactly when at most 25 functions in at most 4 files."""
    out = tmp_path / "ops.json"
    assert main(["--arch", "tiny-llama", "--layers", "2", "--ops", "--policies", "streamingllm,h2o", "--budgets",
                 "32", "--block", "16", "--baselines", "none", "--out", str(out), "--quiet"]) == 0
    got = json.loads(out.read_text())
    s, h = sorted(got["rows"], key=lambda r: r["policy"] != "streamingllm")
    assert s["hf_block_ops"] == h["hf_block_ops"] and s["hf_step_ops"] == h["hf_step_ops"]
    assert h["step_ops"] > s["step_ops"]
    aten = sorted((g for g in got["goals"] if "aten ops" in g), key=lambda g: not g.startswith("streamingllm"))
    read = sorted((g for g in got["goals"] if "decoding step calls" in g), key=lambda g: not g.startswith("stream"))
    for r, line, reading, limit in zip((s, h), aten, read, (1.10, 1.25)):
        assert r["step_ratio"] == round(r["step_ops"] / r["hf_step_ops"], 3)
        assert ("PASS" in line) == (max(r["block_ratio"], r["step_ratio"]) <= limit)
        assert f"policies/{r['policy']}.py" in r["step_files"] and "engine/cache.py" in r["step_files"]
        assert f"calls {r['step_functions']} kvbench functions in {len(r['step_files'])} files" in reading
        assert ("PASS" in reading) == (r["step_functions"] <= 25 and len(r["step_files"]) <= 4)
    assert h["step_functions"] > s["step_functions"]


def test_against_a_missing_table_is_one_line(tmp_path: Path, capsys) -> None:
    old = _table(tmp_path / "old.json", 2.0, [("a", 1.0, 1.0, 1.0)])
    with pytest.raises(SystemExit) as e:  # it was a FileNotFoundError's traceback
        main(["--against", str(old), str(tmp_path / "none.json"), "--out", str(tmp_path / "x.json"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == f"kvbench-bench: error: --against: no such table: {tmp_path / 'none.json'}"
    assert not (tmp_path / "x.json").exists()
