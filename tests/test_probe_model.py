"""The hand-wired probe model: builds offline, loads with Auto*, is byte-deterministic, retrieves exactly with a
plain HF forward, abstains when the needle is missing, and has the key geometry docs/probe-model.md describes."""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import pytest
import torch

from kvbench.models import probe as pm

# Token ids by hand from the vocabulary layout: <s> </s> <unk>, 131 fillers (ids 3..133), k000..k127
# (134..261), v000..v127 (262..389).
BOS, EOS = 0, 1
FILLERS = list(range(3, 134))
KEY0, VAL0 = 134, 262


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe")
    return {v: pm.write_probe_model(root / v, v) for v in ("A", "B")}


@pytest.fixture(scope="module")
def models(built):
    from transformers import AutoModelForCausalLM

    return {v: AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").eval() for v, d in built.items()}


def _prompt(length: int, depth: float, key: int, value: int, seed: int) -> tuple[list[int], int]:
    """<s> fillers.. k v fillers.. filler k, the needle at `depth` % of the filler body; returns (ids, key pos)."""
    rng = random.Random(seed)
    n_fill = length - 4
    body = [rng.choice(FILLERS) for _ in range(n_fill)]
    slot = round((n_fill - 1) * depth / 100)
    ids = [BOS] + body[:slot] + [KEY0 + key, VAL0 + value] + body[slot:] + [KEY0 + key]
    assert len(ids) == length
    return ids, 1 + slot


# With all layer-1 attention on the needle the final residual is C + key + 2 * value (sum of squares 6), so after
# RMSNorm r = 1/sqrt(6/576 + eps); the value logit is 2r and the runner-up, abstain </s>, is 0.5r.
FULL_MARGIN = 1.5 / math.sqrt(6 / 576 + 1e-6)


def _logits(model, batch: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(batch), logits_to_keep=1).logits[:, -1]  # (b, vocab)


def _last_argmax(model, batch: list[list[int]]) -> list[int]:
    return _logits(model, batch).argmax(-1).tolist()


def _margins(logits: torch.Tensor) -> list[float]:
    top = logits.topk(2, dim=-1).values  # (b, 2)
    return (top[:, 0] - top[:, 1]).tolist()


def test_vocabulary_and_size(built):
    assert pm.VOCAB[:3] == ["<s>", "</s>", "<unk>"] and len(pm.VOCAB) == 390
    assert pm.VOCAB[KEY0] == "k000" and pm.VOCAB[VAL0 + 127] == "v127"
    from safetensors.torch import load_file

    for variant, nonzero in (("A", 4749), ("B", 4750)):  # doc §5: 4,749 non-zero; B adds one key weight
        sd = load_file(str(built[variant] / "model.safetensors"))
        assert sum(t.numel() for t in sd.values()) == 1_659_456  # 2*390*576 + 2*(4*256*576 + 3*8*576 + 2*576) + 576
        assert sum(int((t != 0).sum()) for t in sd.values()) == nonzero
        assert all(t.dtype == torch.float32 for t in sd.values())


def test_rebuild_is_byte_identical(built, tmp_path):
    again = pm.write_probe_model(tmp_path / "A2", "A")

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    first = digests(built["A"])
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "probe_meta.json"}
    assert digests(again) == first
    diff = {k for k, v in digests(built["B"]).items() if first[k] != v}
    assert diff == {"model.safetensors", "probe_meta.json"}


def test_loads_with_auto_classes(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["A"])
    assert tok("the k001 v002").input_ids == [BOS, 3, KEY0 + 1, VAL0 + 2]
    assert tok.decode([BOS, 3, KEY0 + 1, EOS], skip_special_tokens=True) == "the k001"
    assert tok.eos_token_id == EOS and tok.bos_token_id == BOS
    model, info = AutoModelForCausalLM.from_pretrained(built["A"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.max_position_embeddings == 65536


@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_retrieves_at_every_depth(models, variant, length):
    batch, answers = [], []
    for i, depth in enumerate((0, 50, 100)):
        key, value = (7 * i + length) % 128, (31 * i + 5) % 128
        batch.append(_prompt(length, depth, key, value, seed=length + i)[0])
        answers.append(VAL0 + value)
    logits = _logits(models[variant], batch)
    assert logits.argmax(-1).tolist() == answers
    assert _margins(logits) == pytest.approx([FULL_MARGIN] * 3, rel=1e-5)


@pytest.mark.parametrize("variant", ["A", "B"])
def test_abstains_without_the_needle(models, variant):
    """Needle VALUE or KEY replaced by a filler -> "not found" (</s>), even though another value is in context."""
    batch = []
    for i, depth in enumerate((0, 50, 100)):
        ids, kpos = _prompt(1024, depth, key=3 + i, value=90 - i, seed=i)
        no_value = ids.copy()
        no_value[kpos + 1] = FILLERS[0]
        no_key = ids.copy()
        no_key[kpos] = FILLERS[1]
        # a needle for a different key: the lone value in context must not be returned either
        other_key = ids.copy()
        other_key[-1] = KEY0 + 100 + i
        batch += [no_value, no_key, other_key]
    assert _last_argmax(models[variant], batch) == [EOS] * len(batch)


def test_multi_needle_4k(models):
    ids, _ = _prompt(4096, 30, key=10, value=20, seed=1)
    # three more needles elsewhere in the filler body; query each key in turn
    for pos, (k, v) in zip((500, 2000, 3500), ((11, 21), (12, 22), (13, 23))):
        assert ids[pos] in FILLERS and ids[pos + 1] in FILLERS
        ids[pos], ids[pos + 1] = KEY0 + k, VAL0 + v
    batch = []
    for k in (10, 11, 12, 13):
        q = ids.copy()
        q[-1] = KEY0 + k
        batch.append(q)
    assert _last_argmax(models["A"], batch) == [VAL0 + 20, VAL0 + 21, VAL0 + 22, VAL0 + 23]


def test_generate_greedy(models, built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["A"])
    ids, kpos = _prompt(1024, 70, key=42, value=17, seed=9)
    out = models["A"].generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
    assert tok.decode(out[0, len(ids):], skip_special_tokens=True) == "v017"
    ids[kpos + 1] = FILLERS[5]
    out = models["A"].generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out[0, len(ids):].tolist() == [EOS]  # stops at the model's EOS at once


def test_layer1_key_geometry(models):
    """Doc §4/§1: A's layer-1 keys are ~0 except the needle VALUE (norm s = sqrt(800)); B adds a constant
    3s offset so the needle has norm sqrt((3s*sqrt(2/3))^2 + s^2) = sqrt(5600) and every other key 3s."""
    ids, kpos = _prompt(256, 40, key=70, value=1, seed=3)
    norms, keys = {}, {}
    for v in ("A", "B"):
        with torch.no_grad():
            cache = models[v](torch.tensor([ids]), use_cache=True).past_key_values
        k = cache.layers[1].keys[0, 0]  # (n, head_dim)
        norms[v] = k.norm(dim=-1)  # (n,)
        keys[v] = k / norms[v].clamp_min(1e-12)[:, None]  # unit keys; A's zero keys stay ~0
    others = [i for i in range(len(ids)) if i != kpos + 1]
    assert norms["A"][kpos + 1].item() == pytest.approx(math.sqrt(800), rel=1e-5)
    assert norms["A"][others].max().item() < 1e-6  # e^-40 leak of the prev-token head at most
    # RMSNorm's eps (1e-6) shifts sqrt(2/3) by ~5e-5 relative
    assert norms["B"][kpos + 1].item() == pytest.approx(math.sqrt(5600), rel=1e-4)
    assert norms["B"][others].min().item() == pytest.approx(3 * math.sqrt(800), rel=1e-5)
    assert norms["B"][others].max().item() == pytest.approx(3 * math.sqrt(800), rel=1e-5)
    # What K-norm (keep the smallest) and KeyDiff (keep the least similar to the mean direction) see: in A the
    # needle is the largest and most typical key, in B the smallest and least typical one.
    assert norms["A"].argmax().item() == kpos + 1 and norms["B"].argmin().item() == kpos + 1
    for v, pick in (("A", torch.argmax), ("B", torch.argmin)):
        assert pick(keys[v] @ torch.nn.functional.normalize(keys[v].mean(0), dim=0)).item() == kpos + 1


def test_probe_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    d = pm.probe_dir("B")
    assert d.parent == tmp_path / "models" and (d / "probe_meta.json").is_file()
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert pm.probe_dir("B") == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [d.name]  # no temp dir left behind
    assert pm.probe_dir("A") != d


def test_probe_dir_bad_variant(tmp_path, monkeypatch):
    from kvbench.models.common import ModelError

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="unknown probe model variant 'C'; choose one of: A, B"):
        pm.probe_dir("C")


def test_cli_main(tmp_path, capsys):
    import json

    assert pm.main([str(tmp_path / "out"), "--variant", "B"]) == 0
    meta = json.loads((tmp_path / "out" / "probe_meta.json").read_text())
    assert meta["variant"] == "B" and meta["key_ids"] == list(range(KEY0, KEY0 + 128))
    assert meta["value_ids"] == list(range(VAL0, VAL0 + 128)) and meta["filler_ids"] == FILLERS
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")


def test_model_presets():
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1] / "conf" / "model"
    for name, path in (("probe", "probe:A"), ("probe-b", "probe:B")):
        cfg = OmegaConf.to_container(OmegaConf.load(root / f"{name}.yaml"))
        assert cfg == {"name": name, "path": path, "dtype": "float32", "max_prompt_tokens": 65536,
                       "chat_template": False, "revision": None, "attn_implementation": "sdpa"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_doc_accuracy_grid(built, models, variant, length):
    """docs/probe-model.md "Measured": 11 depths x 20 samples plus 20 four-needle prompts, all correct, each with
    the full-attention margin (run with `python -m pytest tests/test_probe_model.py -m slow`)."""
    from transformers import AutoTokenizer

    from kvbench.tasks.base import TaskEnv
    from kvbench.tasks.probe import ProbeTask

    env = TaskEnv(tokenizer=AutoTokenizer.from_pretrained(built[variant]), model_name="probe",
                  max_prompt_tokens=65536, chat_template=False, seed=42)
    single = ProbeTask(context_lengths=[length], depths=range(0, 101, 10), samples_per_cell=20)
    multi = ProbeTask(context_lengths=[length], depths=range(0, 101, 10), num_needles=4, samples_per_cell=2)
    samples = list(single.samples(env)) + list(multi.samples(env))[:20]
    for i in range(0, len(samples), 5):
        chunk = samples[i:i + 5]
        logits = _logits(models[variant], [s.input_ids for s in chunk])
        answers = [env.tokenizer.convert_tokens_to_ids(s.answers[0]) for s in chunk]
        assert logits.argmax(-1).tolist() == answers
        assert _margins(logits) == pytest.approx([FULL_MARGIN] * len(chunk), rel=1e-5)
