"""Sweeps and reports: a 2x2 multirun on the tiny model gives a 4-row paper-shaped table; shards merge into the
unsharded result; the report layout (full row first, LongBench categories, summaries, plots); sweep pre-flight;
every experiment preset composes and names existing models, policies and tasks."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvbench.report.cli import main as report_main
from kvbench.report.cli import report
from kvbench.run import config
from kvbench.tasks.longbench import LongBench
from kvbench.tasks.niah import NIAH

from helpers import kvbench_main, run_config

ROOT = Path(__file__).resolve().parent.parent
FIDELITY = ["model=tiny-llama", "task=fidelity", "task.new_tokens=4", "progress=false"]


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_multirun_2x2_gives_a_4_row_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    res = kvbench_main("--multirun", *FIDELITY, "task.lengths=[128]", "policy=keydiff,streamingllm", "budget=64,128",
                       f"hydra.sweep.dir={sweep}")
    assert res.returncode == 0, res.stderr
    assert len(list(sweep.rglob("metrics.json"))) == 4
    report_main([str(sweep), "--no-plots"])
    printed = capsys.readouterr().out

    rows = _csv(sweep / "table.csv")
    assert list(rows[0]) == ["model", "policy", "budget", "block", "protocol", "top1", "kl_mean", "kl_max",
                             "match_len", "Avg"]
    # Sweep order (policy-major, as given on the command line), budgets ascending.
    assert [(r["model"], r["policy"], r["budget"], r["block"], r["protocol"]) for r in rows] == [
        ("tiny-llama", "keydiff", "64", "128", "blockwise"), ("tiny-llama", "keydiff", "128", "128", "blockwise"),
        ("tiny-llama", "streamingllm", "64", "128", "blockwise"),
        ("tiny-llama", "streamingllm", "128", "128", "blockwise")]
    for r in rows:  # fidelity's average is top1; scores are copied as stored (0-100), never rescaled
        # sweep subdir: <model>/<task>/<policy>_N<budget>_<protocol label (with the block for blockwise)>
        m = json.loads((sweep / "tiny-llama" / "fidelity" / f"{r['policy']}_N{r['budget']}_blockwise_B128" /
                        "metrics.json").read_text())
        assert float(r["Avg"]) == float(r["top1"]) == m["scores"]["top1"] == m["average"]
        assert float(r["kl_mean"]) == m["scores"]["kl_mean"]
    md = (sweep / "table.md").read_text()
    assert md in printed
    table = [line for line in md.split("## Scores")[1].split("##")[0].splitlines() if line.startswith("|")]
    assert table[0].split("|")[-2].strip() == "Avg" and len(table[2:]) == 4
    runs = _csv(sweep / "runs.csv")
    # Compression ratio (KeyDiff App. B.3): mean of min(1, N / prompt length); the prompt is 128 tokens.
    assert [float(r["compression"]) for r in runs] == [0.5, 1.0, 0.5, 1.0]
    assert all(r["commit"] and r["transformers"] and r["torch"] and r["model_path"] for r in runs)
    assert json.loads(runs[0]["task_provenance"])["lengths"] == [128]


def test_shards_merge_into_the_unsharded_result(tmp_path: Path) -> None:
    from kvbench.run.app import Session, run_one

    def cfg(shard: str | None) -> dict:
        return run_config(*FIDELITY, "task.lengths=[96,128,160]", "policy=keydiff", "budget=64", "block=32",
                          f"shard={shard or 'null'}")

    session = Session()
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    for i in (0, 1):
        run_one(cfg(f"{i}/2"), "keydiff", sharded / "job" / f"shard{i}of2", session)
    unsharded = run_one(cfg(None), "keydiff", whole, session)

    rep = report(sharded, plots=False, quiet=True)
    assert len(rep.rows) == 1 and rep.notes == []
    entry = rep.rows[0].entries["fidelity"]
    # Recomputed from the merged predictions through the task's aggregate: exactly the unsharded numbers.
    assert entry.scores == unsharded["scores"]
    assert entry.average == unsharded["average"]
    assert entry.stats["samples"] == 3 and entry.stats["prompt_tokens"] == 96 + 128 + 160
    assert entry.label == ""

    # A run made before a setting existed has no value for it in config.yaml and ran as the default of its day: a
    # shard without `scenario` merges with one that records the default (question_aware), and not with one that
    # records another value (context_only)
    import yaml

    cfg0, cfg1 = (sharded / "job" / f"shard{i}of2" / "config.yaml" for i in (0, 1))
    recorded0, recorded = (yaml.safe_load(c.read_text()) for c in (cfg0, cfg1))
    assert recorded["scenario"] == "question_aware"
    cfg1.write_text(yaml.safe_dump({k: v for k, v in recorded.items() if k != "scenario"}))
    cfg0.write_text(yaml.safe_dump({**recorded0, "scenario": "context_only"}))
    rep = report(sharded, plots=False, quiet=True)
    assert [r.entries["fidelity"].label for r in rep.rows] == ["(1/2 shards)", "(1/2 shards)"]
    cfg0.write_text(yaml.safe_dump(recorded0))
    rep = report(sharded, plots=False, quiet=True)
    assert len(rep.rows) == 1 and rep.notes == []
    assert rep.rows[0].entries["fidelity"].stats["samples"] == 3
    # the retired engine settings (slot_reuse, evict_together, stack_prefill: how the engine before the static slot
    # cache decoded) are left out: a shard that records them, whatever their values, merges with one that does not.
    # (Before, a shard without slot_reuse read as slot_reuse: false and did not merge with one recording true.)
    cfg0.write_text(yaml.safe_dump({**recorded0, "slot_reuse": True, "evict_together": False, "stack_prefill": "auto"}))
    cfg1.write_text(yaml.safe_dump({**recorded, "slot_reuse": False}))
    rep = report(sharded, plots=False, quiet=True)
    assert len(rep.rows) == 1 and rep.notes == []
    assert rep.rows[0].entries["fidelity"].stats["samples"] == 3
    cfg0.write_text(yaml.safe_dump(recorded0))
    cfg1.write_text(yaml.safe_dump(recorded))

    (sharded / "job" / "shard1of2" / "metrics.json").unlink()  # one shard unfinished
    rep = report(sharded, plots=False, quiet=True)
    assert rep.rows[0].entries["fidelity"].label == "(1/2 shards)"
    assert any("only shards [0] of 2" in n for n in rep.notes)
    assert any("unfinished" in n for n in rep.notes)


def _fake_run(root: Path, name: str, metrics: dict, cfg: dict) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(metrics))
    import yaml

    (d / "config.yaml").write_text(yaml.safe_dump(cfg))


def _layout(task: str, names: list[str]) -> dict:
    """The layout the task writes for runs of these datasets (LongBench) or cells (NIAH `L<length>_D<depth>`)."""
    if task == "longbench":
        datasets = [n for n in names if n in LongBench().spec]
        return LongBench(datasets=datasets).layout([{"meta": {"dataset": d}} for d in datasets], {})
    grid = sorted({(int(n[1:].split("_D")[0]), float(n.split("_D")[1])) for n in names if "_D" in n})
    return NIAH().layout([{"meta": {"context_length": L, "depth": d}} for L, d in grid], {})


def _metrics(model: str, policy: str, budget: int | None, task: str, scores: dict, average: float) -> dict:
    evicts = policy != "full"
    return {"model": model, "policy": policy, "budget": budget, "block": 128, "task": task, "shard": None,
            "applies": {"budget": evicts, "protocol": evicts, "block": evicts}, "reference": not evicts,
            "scores": scores, "average": average, "composition": {}, "layout": _layout(task, list(scores)),
            "stats": {"samples": 2, "prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 20.0, "evict_s": 0.1,
                      "peak_kv_tokens": 129, "kv_bytes_peak": 2**20, "compression_ratio": 0.5},
            "provenance": {"kvbench": "0.1.0", "commit": "abc", "transformers": "5.23.0", "torch": "2.13.0",
                           "model_path": f"org/{model}", "model_revision": "r1", "task": {"source": "x"}},
            "notes": ["scorer: official"]}


def _cfg(policy_target: str, budget: int | None, task: str) -> dict:
    """A run's config.yaml with these policy and task classes (the report reads only their targets)."""
    return run_config("block=128", values={"model": {"name": "m"}, "policy": {"_target_": policy_target},
                                           "task": {"_target_": task}, "budget": budget})


def test_report_layout_full_row_first_categories_and_plots(tmp_path: Path) -> None:
    lb = "kvbench.tasks.longbench.LongBench"
    kd, full = "kvbench.policies.keydiff.KeyDiff", "kvbench.policies.full.Full"
    scores = {"qasper": 40.0, "narrativeqa": 20.0, "multifieldqa_en": 30.0, "trec": 70.0, "cat:single_doc_qa": 30.0,
              "avg_selected": 40.0}
    for k, budget in enumerate((4096, 2048)):
        s = {n: v - k for n, v in scores.items()}
        _fake_run(tmp_path, f"kd{budget}", _metrics("llama", "keydiff", budget, "longbench", s, s["avg_selected"]),
                  _cfg(kd, budget, lb))
    # The full cache was run at a budget too: the budget does not apply to it, and its row comes first.
    _fake_run(tmp_path, "full", _metrics("llama", "full", 2048, "longbench", scores, 40.0), _cfg(full, 2048, lb))
    rep = report(tmp_path, plots=True, quiet=True)

    rows = _csv(tmp_path / "table.csv")
    # Datasets in LongBench order (narrativeqa before qasper), summaries after the details, then Avg.
    assert list(rows[0]) == ["model", "policy", "budget", "block", "protocol", "narrativeqa", "qasper",
                             "multifieldqa_en", "trec", "cat:single_doc_qa", "avg_selected", "Avg"]
    # Budget, block and protocol do not apply to the full cache.
    assert [(r["policy"], r["budget"], r["block"], r["protocol"], r["Avg"]) for r in rows] == [
        ("full", "", "", "", "40.0"), ("keydiff", "2048", "128", "blockwise", "39.0"),
        ("keydiff", "4096", "128", "blockwise", "40.0")]
    assert [c.category for c in rep.columns] == ["Single Doc. QA"] * 3 + ["Few-shot Learning"]
    md = (tmp_path / "table.md").read_text()
    assert "| *Single Doc. QA* |" in md.replace("  ", " ") or "*Single Doc. QA*" in md
    assert "*Few-shot Learning*" in md
    assert "org/llama (revision r1" in md and "scorer: official" in md and '{"source": "x"}' in md
    assert (tmp_path / "score_vs_budget.png").stat().st_size > 0
    assert not list(tmp_path.glob("heatmap_*.png"))  # no NIAH cells here


def test_report_draws_niah_heatmaps_side_by_side(tmp_path: Path) -> None:
    niah = "kvbench.tasks.niah.NIAH"
    for policy, target in (("tova", "kvbench.policies.tova.TOVA"), ("keydiff", "kvbench.policies.keydiff.KeyDiff")):
        cells = {"L1024_D0": 100.0, "L1024_D50": 0.0, "L2048_D0": 100.0, "L2048_D50": 100.0, "avg": 75.0}
        _fake_run(tmp_path, policy, _metrics("llama", policy, 512, "niah", cells, 75.0), _cfg(target, 512, niah))
    rep = report(tmp_path, plots=True, quiet=True)
    assert [c.name for c in rep.columns] == ["L1024_D0", "L1024_D50", "L2048_D0", "L2048_D50"]
    assert [c.category for c in rep.columns] == ["niah L1024", "niah L1024", "niah L2048", "niah L2048"]
    assert (tmp_path / "heatmap_niah_llama.png").stat().st_size > 0
    assert not (tmp_path / "score_vs_budget.png").exists()  # one budget: no curve


def test_the_speed_table_says_which_runs_shared_their_forwards(tmp_path: Path) -> None:
    """A run that was a row of shared forwards (stats.batch_size K > 1) or took its first prompt forwards from a shared
    trunk (stats.trunk_samples) has a speed that is its equal share of them: the table says so beside its speed, and
    says nothing where no run shared (the column is absent)."""
    from kvbench.report.cli import metrics_rows
    from kvbench.report.tables import SHARED_NOTE

    niah = "kvbench.tasks.niah.NIAH"
    cells = {"L1024_D0": 100.0, "avg": 100.0}
    alone = _metrics("llama", "tova", 512, "niah", cells, 100.0)
    rows = {"tova": {}, "keydiff": {"batch_size": 3}, "snapkv": {"batch_size": 3, "trunk_samples": 2}}
    for policy, extra in rows.items():
        m = _metrics("llama", policy, 512, "niah", cells, 100.0)
        m["stats"].update(extra)
        _fake_run(tmp_path / "shared", policy, m, _cfg(f"kvbench.policies.{policy}.X", 512, niah))
    report(tmp_path / "shared", plots=False, quiet=True)
    text = (tmp_path / "shared" / "table.md").read_text()
    speed = text[text.index("## Speed and memory"):text.index("## Provenance")]
    shared = {ln.split("|")[2].strip(): ln.split("|")[-3].strip() for ln in speed.splitlines()
              if ln.startswith("| llama")}
    assert shared == {"keydiff": "rows of 3", "snapkv": "trunk, rows of 3", "tova": ""}
    assert SHARED_NOTE in speed
    head, body = metrics_rows([alone])  # the table `kvbench` prints: alone, no column; a row of 3, said
    assert "shared" not in head
    row_of_3 = _metrics("llama", "keydiff", 512, "niah", cells, 100.0)
    row_of_3["stats"]["batch_size"] = 3
    head, body = metrics_rows([alone, row_of_3])
    assert head[-1] == "shared" and [r[-1] for r in body] == ["", "rows of 3"]
    _fake_run(tmp_path / "alone", "tova", alone, _cfg("kvbench.policies.tova.TOVA", 512, niah))
    report(tmp_path / "alone", plots=False, quiet=True)
    assert "shared" not in (tmp_path / "alone" / "table.md").read_text()


def test_report_draws_a_heatmap_figure_per_budget_on_request(tmp_path: Path, capsys) -> None:
    # --heatmaps-per-budget: one figure per (model, budget, block, protocol), the full cache's panel in each; the
    # tables and the default heatmap are those of the report without it.
    niah, full = "kvbench.tasks.niah.NIAH", "kvbench.policies.full.Full"
    cells = {"L1024_D0": 100.0, "L1024_D50": 0.0, "avg": 50.0}
    _fake_run(tmp_path, "full", _metrics("llama", "full", None, "niah", {**cells, "L1024_D50": 100.0}, 100.0),
              _cfg(full, None, niah))
    for policy, target, budget in (("tova", "kvbench.policies.tova.TOVA", 512),
                                   ("keydiff", "kvbench.policies.keydiff.KeyDiff", 512),
                                   ("keydiff", "kvbench.policies.keydiff.KeyDiff", 256)):
        _fake_run(tmp_path, f"{policy}{budget}", _metrics("llama", policy, budget, "niah", cells, 50.0),
                  _cfg(target, budget, niah))
    report_main([str(tmp_path), "-q", "--no-plots"])
    table = (tmp_path / "table.md").read_text()
    report_main([str(tmp_path), "-q", "--no-plots", "--heatmaps-per-budget"])
    assert (tmp_path / "table.md").read_text() == table
    assert sorted(p.name for p in tmp_path.glob("niah_*.png")) == ["niah_llama_N256_B128_blockwise.png",
                                                                  "niah_llama_N512_B128_blockwise.png"]
    assert capsys.readouterr().out.count("wrote ") == 2
    assert not list(tmp_path.glob("heatmap_*.png"))  # (--no-plots: the default plots only)


def test_report_of_an_empty_directory_is_a_one_line_error(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        report_main([str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"kvbench-report: error: no finished runs (metrics.json) below {tmp_path}"


def test_sweep_preflight_names_the_bad_job() -> None:
    err = config.validate_overrides(["--multirun", *FIDELITY, "policy=keydiff", "budget=64,0"])
    assert err == ("sweep job [model=tiny-llama task=fidelity task.new_tokens=4 progress=False policy=keydiff "
                   "budget=0]: budget must be a positive integer, got 0")
    assert config.validate_overrides(["--multirun", *FIDELITY, "policy=keydiff,tova", "budget=64,128"]) is None


def test_sweep_jobs_expand_like_hydra_with_command_line_last() -> None:
    jobs = config.sweep_jobs({"policy": "a,b", "budget": "1,2"}, ["budget=3", "seed=0,1"])
    assert jobs == [["policy=a", "budget=3", "seed=0"], ["policy=a", "budget=3", "seed=1"],
                    ["policy=b", "budget=3", "seed=0"], ["policy=b", "budget=3", "seed=1"]]


@pytest.mark.parametrize("params,overrides", [
    ({"policy": "a,b", "budget": "1,2"}, ["budget=3", "seed=0,1"]),
    ({"block": "null,128", "budget": "range(1,4)"}, ["+x=choice(u,v)", "~y", "task.lengths=[1,2]", "block=64,32"]),
    (None, ["policy=keydiff", "task.depths=[10,50]", "seed=range(0,6,2)", "budget='1,2'"]),
])
def test_sweep_jobs_equal_the_basic_sweepers_own_expansion(params: dict | None, overrides: list[str]) -> None:
    # kvbench expands sweeps with Hydra's public parser only; the sweeper Hydra runs them with is private API, used
    # here (a test) to check that both give the same jobs in the same order.
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in (params or {}).items()] + overrides
    hydra_jobs = [job for chunk in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
                  for job in chunk]
    assert config.sweep_jobs(params, overrides) == hydra_jobs
    assert len(hydra_jobs) > 1


def test_no_private_hydra_in_the_package() -> None:
    texts = {p: p.read_text() for p in (ROOT / "kvbench").rglob("*.py")}
    assert [str(p) for p, t in texts.items() if "hydra._internal" in t] == []


@pytest.mark.parametrize("name", config.group_choices("experiment"))
def test_experiment_preset_composes_with_existing_choices(name: str) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"experiment={name}"], return_hydra_config=True)
    params = dict(cfg.hydra.sweeper.params)
    assert params, f"{name} has no hydra.sweeper.params"
    assert cfg.hydra.sweep.dir == f"results/{name}"
    for group in ("model", "policy", "task"):
        for value in str(params.get(group, "")).split(",") if group in params else []:
            assert value in config.group_choices(group), (name, group, value)
    for key in ("budget", "block"):
        for value in str(params[key]).split(",") if key in params else []:
            assert value == "null" or int(value) > 0


def test_a_runs_stats_count_the_samples_that_took_a_shared_trunk() -> None:
    from kvbench.run.records import summarize

    def rec(**extra: int) -> dict:
        return {"prompt_tokens": 100, "prefill_s": 1.0, "decode_steps": 4, "decode_s": 0.5, "new_tokens": 5,
                "evict_s": 0.1, "peak_kv_tokens": 40, "kv_bytes_peak": 800, **extra}

    assert summarize([rec(trunk_tokens=64), rec(), rec(trunk_tokens=32)], 32, True)["trunk_samples"] == 2
    assert "trunk_samples" not in summarize([rec(), rec()], 32, True)  # none: no key (the tables stay as they are)
