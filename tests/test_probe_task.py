"""task=probe: token-exact prompts on the probe vocabulary, needle positions in meta, scoring, aggregation,
heatmap and the synthetic-geometry note; end to end with a plain HF forward of the probe model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbench.models import probe as pm
from kvbench.tasks.base import Sample, TaskEnv, TaskError
from kvbench.tasks.probe import NOTE, ProbeTask, cell_key

BOS, EOS = 0, 1
FILLERS = set(range(3, 134))
KEYS = set(range(134, 262))
VALUES = set(range(262, 390))


@pytest.fixture(scope="module")
def probe_path(tmp_path_factory) -> Path:
    return pm.write_probe_model(tmp_path_factory.mktemp("probe") / "A", "A")


@pytest.fixture(scope="module")
def probe_tok(probe_path):
    """The probe model's own tokenizer (not conftest's tiny `tok`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(probe_path)


def _env(probe_tok, seed: int = 42, max_prompt_tokens: int = 65536) -> TaskEnv:
    return TaskEnv(tokenizer=probe_tok, model_name="probe", max_prompt_tokens=max_prompt_tokens, chat_template=False,
                   seed=seed)


def test_grid_and_positions(probe_tok):
    task = ProbeTask(context_lengths=[64, 100], depths=[0, 50, 100], samples_per_cell=2)
    samples = list(task.samples(_env(probe_tok)))
    assert [s.id for s in samples[:3]] == ["probe_L64_D0_n1_0", "probe_L64_D0_n1_1", "probe_L64_D50_n1_0"]
    assert [(s.meta["length"], s.meta["depth"]) for s in samples] == [
        (n, d) for n in (64, 100) for d in (0.0, 50.0, 100.0) for _ in range(2)]
    # F = length - 4 fillers; slot = floor((F - 1) * depth / 100 + 0.5); key at 1 + slot
    expected_key_pos = {(64, 0): 1, (64, 50): 31, (64, 100): 60, (100, 0): 1, (100, 50): 49, (100, 100): 96}
    for s in samples:
        ids, m = s.input_ids, s.meta
        n = m["length"]
        kp, vp = m["needle_key_pos"], m["needle_value_pos"]
        assert len(ids) == n and m["query_pos"] == n - 1 and s.context_tokens == n - 1
        assert kp == expected_key_pos[(n, int(m["depth"]))] and vp == kp + 1
        assert m["all_key_pos"] == [kp] and m["all_value_pos"] == [vp]
        assert ids[0] == BOS and ids[kp] == ids[-1] and ids[kp] in KEYS and ids[vp] in VALUES
        assert ids[-2] in FILLERS
        assert all(t in FILLERS for i, t in enumerate(ids) if i not in (0, kp, vp, n - 1))
        assert s.answers == [probe_tok.convert_ids_to_tokens(ids[vp])] and s.answers[0].startswith("v")
        assert m["key"] == probe_tok.convert_ids_to_tokens(ids[-1])
        assert probe_tok(s.prompt, add_special_tokens=False).input_ids == ids
        assert s.max_new_tokens == 1 and m["num_needles"] == 1 and m["variant"] == "A"


def test_multi_needle_positions(probe_tok):
    task = ProbeTask(context_lengths=[64], depths=[50], num_needles=4, samples_per_cell=3)
    for s in task.samples(_env(probe_tok)):
        ids, m = s.input_ids, s.meta
        kps, vps = m["all_key_pos"], m["all_value_pos"]
        assert len(ids) == 64 and len(kps) == 4 and kps == sorted(kps) and vps == [k + 1 for k in kps]
        assert m["needle_key_pos"] in kps
        assert len({ids[k] for k in kps}) == 4 and len({ids[v] for v in vps}) == 4
        assert all(ids[k] in KEYS for k in kps) and all(ids[v] in VALUES for v in vps)
        assert [i for i, t in enumerate(ids) if t in KEYS] == kps + [63]
        assert ids[-1] == ids[m["needle_key_pos"]] and ids[-2] in FILLERS
        # F = 64 - 2 - 8 = 54 fillers; the queried needle sits before filler floor(53 * 0.5 + 0.5) = 27
        before = sum(1 for k in kps if k < m["needle_key_pos"])
        assert m["needle_key_pos"] - 1 - 2 * before == 27


def test_deterministic_and_seeded(probe_tok):
    task = ProbeTask(context_lengths=[128], depths=[30], num_needles=2, samples_per_cell=2)
    a = [s.input_ids for s in task.samples(_env(probe_tok))]
    assert a == [s.input_ids for s in task.samples(_env(probe_tok))]
    assert a != [s.input_ids for s in task.samples(_env(probe_tok, seed=7))]
    assert a[0] != a[1]


def test_rejects_non_probe_model(tmp_path):
    from kvbench.models.tiny import build_tiny_tokenizer

    tiny = build_tiny_tokenizer()
    tiny.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    env = _env(AutoTokenizer.from_pretrained(tmp_path))
    with pytest.raises(TaskError, match="task=probe needs the probe model .* has no probe_meta.json"):
        list(ProbeTask().samples(env))


def test_bad_settings(probe_tok):
    with pytest.raises(TaskError, match=r"task.depths must lie in \[0, 100\], got \[101.0\]"):
        ProbeTask(depths=[50, 101])
    with pytest.raises(TaskError, match=r"context_lengths \[13\] too short for 4 needle\(s\): need at least 14"):
        ProbeTask(context_lengths=[13, 14], num_needles=4)
    with pytest.raises(TaskError, match=r"context_lengths \[4096\] exceed the model's max_prompt_tokens \(1024\)"):
        list(ProbeTask(context_lengths=[1024, 4096]).samples(_env(probe_tok, max_prompt_tokens=1024)))
    with pytest.raises(TaskError, match="num_needles=129 exceeds the 128 probe keys"):
        list(ProbeTask(context_lengths=[1024], num_needles=129).samples(_env(probe_tok)))


def test_score():
    task = ProbeTask()
    s = Sample(id="x", input_ids=[0], answers=["v012"], max_new_tokens=1)
    assert task.score(s, "v012") == 100.0
    assert task.score(s, " v012 v012") == 100.0
    assert task.score(s, "") == 0.0  # the abstain token </s> decodes to nothing
    assert task.score(s, "v013 v012") == 0.0
    assert task.score(s, "v0120") == 0.0


def _rec(length: int, depth: float, score: float) -> dict:
    return {"id": "x", "score": score, "meta": {"length": length, "depth": depth}}


def test_aggregate_and_finalize(tmp_path):
    task = ProbeTask()
    records = [_rec(1024, 0, 100), _rec(1024, 0, 0), _rec(1024, 50, 100), _rec(1024, 50, 100),
               _rec(4096, 0, 0), _rec(4096, 0, 0), _rec(4096, 12.5, 100), _rec(4096, 12.5, 0)]
    scores = task.aggregate(records)
    assert scores == {"L1024_D0": 50.0, "L1024_D50": 100.0, "L4096_D0": 0.0, "L4096_D12.5": 50.0, "avg": 50.0}
    assert task.average_key == "avg"
    extra = task.finalize(tmp_path, records, scores)
    assert extra == {"notes": [NOTE]}
    assert "synthetic key geometry" in NOTE and "0% vs 100%" in NOTE
    png = (tmp_path / "probe_heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert cell_key(2048, 33.0) == "L2048_D33" and cell_key(2048, 2.25) == "L2048_D2.25"
    with pytest.raises(TaskError, match="has no meta.length/meta.depth"):
        task.aggregate([{"id": "y", "score": 1.0, "meta": {}}])


def test_task_yaml_defaults():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/task/probe.yaml"))
    assert cfg.pop("_target_") == "kvbench.tasks.probe.ProbeTask"
    task = ProbeTask(**cfg)
    assert task.context_lengths == [1024, 4096] and task.depths == [float(d) for d in range(0, 101, 10)]
    assert (task.num_needles, task.samples_per_cell, task.max_new_tokens) == (1, 4, 1)


@pytest.mark.parametrize("num_needles", [1, 4])
def test_end_to_end_plain_forward(probe_path, probe_tok, num_needles):
    """Full cache -> 100; the needle VALUE at meta.needle_value_pos replaced by a filler -> 0; the other needles'
    values replaced -> still 100 (so the meta positions are exactly the evidence the model uses)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(probe_path).eval()
    task = ProbeTask(context_lengths=[1024], depths=[0, 50, 100], num_needles=num_needles, samples_per_cell=1)
    samples = list(task.samples(_env(probe_tok)))

    def run(batch):
        with torch.no_grad():
            out = model(torch.tensor(batch), logits_to_keep=1).logits[:, -1].argmax(-1)  # (b,)
        return [probe_tok.decode([t], skip_special_tokens=True) for t in out.tolist()]

    full = run([s.input_ids for s in samples])
    records = [{"id": s.id, "score": task.score(s, p), "meta": s.meta} for s, p in zip(samples, full)]
    assert task.aggregate(records) == {"L1024_D0": 100.0, "L1024_D50": 100.0, "L1024_D100": 100.0, "avg": 100.0}

    filler = min(FILLERS)
    dropped, others_dropped = [], []
    for s in samples:
        ids = list(s.input_ids)
        ids[s.meta["needle_value_pos"]] = filler
        dropped.append(ids)
        ids = list(s.input_ids)
        for v in s.meta["all_value_pos"]:
            if v != s.meta["needle_value_pos"]:
                ids[v] = filler
        others_dropped.append(ids)
    assert [task.score(s, p) for s, p in zip(samples, run(dropped))] == [0.0] * 3
    assert run(dropped) == [""] * 3
    assert [task.score(s, p) for s, p in zip(samples, run(others_dropped))] == [100.0] * 3
