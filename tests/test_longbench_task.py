"""LongBench / LongBench-E task: prompts, truncation, chat skip list, context split, data sources, scoring and the
official-format outputs; kvbench-score on a fixture prediction directory."""

from __future__ import annotations

import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest

from kvbench.metrics import longbench as lbm
from kvbench.models.tiny import build_tiny_tokenizer
from kvbench.run.score import main as score_main
from kvbench.tasks.base import TaskEnv, TaskError
from kvbench.tasks.longbench import (HF_REVISION, LongBench, LongBenchE, context_end, load_spec,
                                     truncate_middle)

from shared_reference import reference_file

FIX = Path(__file__).parent / "fixtures" / "longbench"
ALL21 = ["narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
         "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
         "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p"]
E13 = ["qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
       "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


def env(tok, budget=100000, chat=False):
    return TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=budget, chat_template=chat)


def rows(name):
    return [json.loads(line) for line in (FIX / name).read_text(encoding="utf-8").splitlines()]


# ---- definitions ------------------------------------------------------------------------------------------------

def test_templates_and_maxlen_equal_official_reference():
    prompts = json.loads(reference_file("longbench", "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads(reference_file("longbench", "dataset2maxlen.json").read_text(encoding="utf-8"))
    spec = load_spec()
    assert list(spec) == list(prompts)
    assert {d: s["template"] for d, s in spec.items()} == prompts
    assert {d: s["max_new_tokens"] for d, s in spec.items()} == maxlen


def test_spec_tables():
    spec = load_spec()
    assert list(spec) == ALL21
    assert [d for d, s in spec.items() if s["longbench_e"]] == E13
    assert {d for d, s in spec.items() if not s["chat_template"]} == NO_CHAT
    assert {d: s["metric"] for d, s in spec.items()} == {d: f.__name__ for d, f in lbm.DATASET2METRIC.items()}
    # Quirks of the official pred.py that must survive (docs/longbench.md).
    assert spec["narrativeqa"]["template"].count("asconcisely") == 2
    assert "\n\n Answer the question" in spec["qasper"]["template"]
    assert spec["passage_count"]["template"].endswith("The final answer is: ")
    assert spec["lcc"]["template"] == "Please complete the code given below. \n{context}Next line of code:\n"


# ---- prompts ----------------------------------------------------------------------------------------------------

def test_every_dataset_prompt_path_without_chat(tok):
    task = LongBench(data_dir=str(FIX))
    samples = list(task.samples(env(tok)))
    assert len(samples) == 42 and len({s.id for s in samples}) == 42
    spec = load_spec()
    by_id = {s.id: s for s in samples}
    for d in ALL21:
        for i, row in enumerate(rows(f"{d}.jsonl")):
            s = by_id[f"{d}/{i}"]
            prompt = spec[d]["template"].format(**row)
            assert s.prompt == prompt
            assert s.input_ids == tok(prompt).input_ids and s.input_ids[0] == tok.bos_token_id
            assert s.max_new_tokens == spec[d]["max_new_tokens"]
            assert s.answers == row["answers"]
            assert s.meta == {"dataset": d, "_id": row["_id"], "all_classes": row["all_classes"],
                              "length": row["length"], "index": i, "truncated": False}
            if d == "samsum":
                assert s.stop_token_ids == [tok.eos_token_id, 206] and s.min_new_tokens == 1  # 206 = "\n"
            else:
                assert s.stop_token_ids is None and s.min_new_tokens == 0


def test_lcc_prompt_by_hand(tok):
    s = next(LongBench(datasets=["lcc"], limit=1, data_dir=str(FIX)).samples(env(tok)))
    ctx = rows("lcc.jsonl")[0]["context"]
    assert s.prompt == "Please complete the code given below. \n" + ctx + "Next line of code:\n"


def test_chat_template_skip_list(tok):
    samples = list(LongBench(data_dir=str(FIX), limit=1).samples(env(tok, chat=True)))
    for s in samples:
        d = s.meta["dataset"]
        wrapped = s.prompt.startswith("<s><|user|>\n") and s.prompt.endswith("<|end|>\n<|assistant|>\n")
        assert wrapped == (d not in NO_CHAT), d
        # Exactly one BOS, first: the chat template's own "<s>" text for wrapped prompts (encoding adds none),
        # the tokenizer's default BOS for the bare datasets.
        assert s.input_ids[0] == tok.bos_token_id and s.input_ids.count(tok.bos_token_id) == 1, d
        assert s.input_ids == tok(s.prompt, add_special_tokens=not wrapped).input_ids, d


def test_chat_prompt_ids_by_hand(tok):
    # trec is bare; qasper is chat-wrapped. For the wrapped prompt the ids are the template's "<s>" (the BOS id),
    # then the user tag, then the text: no BOS added by encoding on top of the template's.
    [bare] = list(LongBench(datasets=["trec"], limit=1, data_dir=str(FIX)).samples(env(tok, chat=True)))
    [chat] = list(LongBench(datasets=["qasper"], limit=1, data_dir=str(FIX)).samples(env(tok, chat=True)))
    assert bare.prompt.startswith("Please")
    assert bare.input_ids[:5] == [tok.bos_token_id, 55, 486, 298, 76]  # <s> P le as e
    user = tok.convert_tokens_to_ids("<|user|>")
    assert chat.input_ids[:2] == [tok.bos_token_id, user]
    # HF's own chat tokenization (apply_chat_template(tokenize=True)) adds no special tokens either.
    row = rows("qasper.jsonl")[0]
    text = load_spec()["qasper"]["template"].format(**row)
    ref = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert chat.input_ids == list(ref)


def test_missing_chat_template_is_an_error(tok):
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(TaskError, match="chat_template: false"):
        next(LongBench(datasets=["qasper"], data_dir=str(FIX)).samples(env(bare, chat=True)))


def test_truncate_middle_by_hand(tok):
    # "0 1 2 3 4" -> <s> "0" " 1" " 2" " 3" " 4" (6 tokens).
    assert tok("0 1 2 3 4").input_ids == [0, 23, 267, 302, 384, 329]
    assert truncate_middle(tok, "0 1 2 3 4", 6) == ("0 1 2 3 4", None)
    # half = 2: decode(<s> "0") drops BOS -> "0"; decode(" 3" " 4") -> " 3 4"; junction after 1 char.
    assert truncate_middle(tok, "0 1 2 3 4", 5) == ("0 3 4", 1)
    assert truncate_middle(tok, "0 1 2 3 4", 4) == ("0 3 4", 1)
    # half = int(3 / 2) = 1: decode(<s>) = "" and decode(" 4") = " 4".
    assert truncate_middle(tok, "0 1 2 3 4", 3) == (" 4", 0)


def test_task_truncation_uses_budget_and_keeps_halves(tok):
    row = rows("gov_report.jsonl")[1]
    prompt = load_spec()["gov_report"]["template"].format(**row)
    ids = tok(prompt).input_ids
    assert len(ids) > 40
    s = next(LongBench(datasets=["gov_report"], data_dir=str(FIX)).samples(env(tok, budget=40)))
    s2 = list(LongBench(datasets=["gov_report"], data_dir=str(FIX)).samples(env(tok, budget=40)))[1]
    assert s.meta["truncated"] is True
    assert s2.prompt == tok.decode(ids[:20], skip_special_tokens=True) + tok.decode(ids[-20:], skip_special_tokens=True)
    # task.max_length overrides the preset budget.
    s3 = list(LongBench(datasets=["gov_report"], data_dir=str(FIX), max_length=10 ** 6).samples(env(tok, 40)))[1]
    assert s3.prompt == prompt and s3.meta["truncated"] is False


# ---- context split (scenario context_only) ----------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_context_tokens_split_at_context_end(tok, chat):
    spec = load_spec()
    for s in LongBench(data_dir=str(FIX), limit=1).samples(env(tok, chat=chat)):
        d = s.meta["dataset"]
        row = rows(f"{d}.jsonl")[0]
        head, tail = spec[d]["template"].split("{context}")
        n = s.context_tokens
        assert 0 < n < len(s.input_ids)
        # The context tokens decode to (chat prefix +) template head + context; the rest to the tail (+ chat
        # suffix). The tiny tokenizer never merges across the boundary for these fixtures.
        before = tok.decode(s.input_ids[:n], skip_special_tokens=True)
        after = tok.decode(s.input_ids[n:], skip_special_tokens=False)
        assert before.endswith(head.format(**row) + row["context"]), d
        assert after.startswith(tail.format(**row)), d


def test_context_end_fallbacks():
    # Tail found: its start.
    assert context_end("ab CTX tail", "<u>ab CTX tail<e>", " tail", None) == 9
    # A chat template that trims the message: the stripped tail is found.
    assert context_end("ab CTX tail ", "<u>ab CTX tail<e>", " tail ", None) == 9
    # Truncation cut into the tail: the context ends at the junction (after "ab C" in the prompt).
    assert context_end("ab Cil", "<u>ab Cil<e>", " tail", 4) == 7
    assert context_end("ab Cil", "unrelated", " tail", 4) is None


# ---- data sources -----------------------------------------------------------------------------------------------

def test_dataset_selection_errors():
    with pytest.raises(TaskError, match="unknown dataset.*nq.*choose from: narrativeqa"):
        LongBench(datasets=["nq"])
    with pytest.raises(TaskError, match="unknown dataset.*narrativeqa.*choose from: qasper"):
        LongBenchE(datasets=["narrativeqa"])
    with pytest.raises(TaskError, match="fuzz_backend"):
        LongBench(fuzz_backend="rapidfuzz")
    with pytest.raises(TaskError, match="limit"):
        LongBench(limit=0)


def test_data_dir_missing_file_is_named(tmp_path, tok):
    shutil.copy(FIX / "trec.jsonl", tmp_path / "trec.jsonl")
    with pytest.raises(TaskError, match=r"lacks lcc\.jsonl"):
        list(LongBench(datasets=["trec", "lcc"], data_dir=str(tmp_path)).samples(env(tok)))
    with pytest.raises(TaskError, match="data_dir not found"):
        list(LongBench(data_dir=str(tmp_path / "nope")).samples(env(tok)))
    # LongBench-E reads <name>_e.jsonl.
    with pytest.raises(TaskError, match=r"lacks trec_e\.jsonl"):
        list(LongBenchE(datasets=["trec"], data_dir=str(tmp_path)).samples(env(tok)))


def _make_zip(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.write(FIX / n, f"data/{n}")
    return path


def test_hub_download_path_with_fake_downloader(tmp_path, tok):
    zp = _make_zip(tmp_path / "data.zip", ["trec.jsonl", "lcc.jsonl"])
    calls = []

    def fake(**kw):
        calls.append(kw)
        return str(zp)

    task = LongBench(datasets=["lcc", "trec"], downloader=fake)
    samples = list(task.samples(env(tok)))
    assert calls == [{"repo_id": "THUDM/LongBench", "filename": "data.zip", "repo_type": "dataset",
                      "revision": HF_REVISION, "cache_dir": None}]
    assert [s.id for s in samples] == ["lcc/0", "lcc/1", "trec/0", "trec/1"]
    assert task.provenance()["data"]["source"] == f"hf:THUDM/LongBench@{HF_REVISION}"
    assert set(task.provenance()["data"]["files_sha256"]) == {"lcc.jsonl", "trec.jsonl"}
    # The same records as the offline directory.
    offline = list(LongBench(datasets=["lcc", "trec"], data_dir=str(FIX)).samples(env(tok)))
    assert [s.input_ids for s in samples] == [s.input_ids for s in offline]


def test_hub_download_failure_says_how_to_go_offline(tok):
    def offline(**kw):
        raise OSError("no network")

    with pytest.raises(TaskError, match="could not download data.zip.*task.data_dir="):
        list(LongBench(datasets=["trec"], downloader=offline).samples(env(tok)))


def test_local_zip_and_missing_member(tmp_path, tok):
    zp = _make_zip(tmp_path / "data.zip", ["qasper_e.jsonl"])
    assert len(list(LongBenchE(datasets=["qasper"], data_zip=str(zp)).samples(env(tok)))) == 3
    with pytest.raises(TaskError, match="lacks data/trec_e.jsonl"):
        list(LongBenchE(datasets=["trec"], data_zip=str(zp)).samples(env(tok)))


# ---- scoring and outputs ----------------------------------------------------------------------------------------

def _records(task, tok, preds):
    samples = list(task.samples(env(tok)))
    recs = []
    for s, p in zip(samples, preds):
        recs.append({"id": s.id, "prediction": p, "answers": s.answers, "score": task.score(s, p), "meta": s.meta})
    return recs


def test_score_and_aggregate_by_hand(tmp_path, tok):
    task = LongBench(datasets=["trec", "passage_count"], data_dir=str(FIX))
    # trec answers: Animal, Numeric value; passage_count answers: 2, 3.
    recs = _records(task, tok, ["\nAnimal\nLocation", "Numeric value or Location", "2 or 3", "3"])
    assert [r["score"] for r in recs] == [100.0, 50.0, 50.0, 100.0]
    scores = task.aggregate(recs)
    assert scores == {"trec": 75.0, "passage_count": 75.0, "avg_selected": 75.0}
    extra = task.finalize(tmp_path, recs, scores)
    assert extra["longbench"]["fuzz_backend"] == "difflib"
    assert extra["longbench"]["official_pred_dir"] == "longbench_pred"
    pred_dir = tmp_path / "longbench_pred"
    line = json.loads((pred_dir / "trec.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert line == {"pred": "\nAnimal\nLocation", "answers": ["Animal"],
                    "all_classes": rows("trec.jsonl")[0]["all_classes"], "length": rows("trec.jsonl")[0]["length"]}
    assert json.loads((pred_dir / "result.json").read_text()) == {"trec": 75.0, "passage_count": 75.0}
    # The exported directory rescored by kvbench-score gives the same result.json.
    before = (pred_dir / "result.json").read_text()
    assert score_main([str(pred_dir)]) == 0
    assert (pred_dir / "result.json").read_text() == before


def test_aggregate_uses_dataset_rounding_not_per_sample_scores(tok):
    # 107/4000 per sample -> eval.py's round(2.675..., 2) = 2.67 (Python round on the dataset mean).
    task = LongBench(datasets=["passage_count"], data_dir=str(FIX), limit=1)
    recs = _records(task, tok, ["2 " * 107 + "0 " * 3893])
    assert task.aggregate(recs)["passage_count"] == 2.67


def test_longbench_e_aggregate(tok):
    task = LongBenchE(datasets=["passage_count"], data_dir=str(FIX))
    # passage_count_e answers 2, 3, 2 with lengths 1200, 5000, 9000.
    recs = _records(task, tok, ["2", "4", "2 or 9"])
    assert [r["id"] for r in recs] == ["passage_count_e/0", "passage_count_e/1", "passage_count_e/2"]
    assert task.aggregate(recs) == {"passage_count:0-4k": 100.0, "passage_count:4-8k": 0.0,
                                    "passage_count:8k+": 50.0, "avg:0-4k": 100.0, "avg:4-8k": 0.0,
                                    "avg:8k+": 50.0, "avg": 50.0}  # avg: (100 + 0 + 50) / 3


# ---- kvbench-score ----------------------------------------------------------------------------------------------

def test_score_cli_result_json_by_hand(tmp_path, capsys):
    d = tmp_path / "pred"
    shutil.copytree(FIX / "pred", d)
    assert score_main([str(d)]) == 0
    # narrativeqa: 2/3 + 0 + 1 over 3 -> 55.56; trec: 1 + 1/2 + 0 over 3 -> 50.0;
    # passage_count: 1 + 1/2 + 0 + 0 over 4 -> 37.5; lcc: 1 + 0.62 over 2 -> 81.0.
    assert (d / "result.json").read_text(encoding="utf-8") == (
        '{\n    "narrativeqa": 55.56,\n    "trec": 50.0,\n    "passage_count": 37.5,\n    "lcc": 81.0\n}')
    out = capsys.readouterr().out
    assert "avg_selected" in out and "difflib" in out


def test_score_cli_longbench_e_with_empty_buckets(tmp_path):
    d = tmp_path / "pred_e"
    shutil.copytree(FIX / "pred_e", d)
    assert score_main([str(d), "--longbench-e"]) == 0
    got = json.loads((d / "result.json").read_text())
    assert got["passage_count"] == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0}
    assert got["trec"]["0-4k"] == 100.0 and math.isnan(got["trec"]["4-8k"]) and math.isnan(got["trec"]["8k+"])
    assert '"4-8k": NaN' in (d / "result.json").read_text()


def test_score_cli_errors(tmp_path, capsys):
    (tmp_path / "nq.jsonl").write_text('{"pred": "a", "answers": ["a"], "all_classes": null}\n')
    assert score_main([str(tmp_path)]) == 2
    assert "'nq' is not a LongBench dataset" in capsys.readouterr().err
    assert score_main([str(tmp_path / "missing")]) == 2


# ---- smaller behaviours -----------------------------------------------------------------------------------------

def test_unzipped_layout_and_source_conflicts(tmp_path, tok):
    (tmp_path / "data").mkdir()
    shutil.copy(FIX / "trec.jsonl", tmp_path / "data" / "trec.jsonl")
    task = LongBench(datasets=["trec"], data_dir=str(tmp_path))
    assert len(list(task.samples(env(tok)))) == 2
    assert task.provenance()["data"]["source"] == f"dir:{tmp_path}"
    with pytest.raises(TaskError, match="not both"):
        LongBench(data_dir=str(tmp_path), data_zip=str(tmp_path / "data.zip"))
    (tmp_path / "bad.zip").write_text("not a zip")
    with pytest.raises(TaskError, match="not a zip file"):
        list(LongBench(datasets=["trec"], data_zip=str(tmp_path / "bad.zip")).samples(env(tok)))


def test_count_tokens_before_fast_and_slow(tok):
    from kvbench.tasks.longbench import count_tokens_before

    class Slow:  # a tokenizer without offsets: the prefix is encoded instead
        is_fast = False

        def __call__(self, text, truncation=False, add_special_tokens=True):
            return tok(text, add_special_tokens=add_special_tokens)

    ids = tok("abc\n\ndef").input_ids  # <s> a b c \n \n def
    assert count_tokens_before(tok, "abc\n\ndef", 3, ids) == 4
    assert count_tokens_before(Slow(), "abc\n\ndef", 3, ids) == 4
    # A chat prompt is encoded without added special tokens: no BOS to count in front.
    bare = tok("abc\n\ndef", add_special_tokens=False).input_ids
    assert count_tokens_before(tok, "abc\n\ndef", 3, bare, add_special_tokens=False) == 3
    assert count_tokens_before(Slow(), "abc\n\ndef", 3, bare, add_special_tokens=False) == 3


def test_finalize_records_provenance(tmp_path, tok):
    task = LongBench(datasets=["lcc"], data_dir=str(FIX), fuzz_backend="levenshtein", write_official=False)
    recs = _records(task, tok, ["    return 0", "x"])
    extra = task.finalize(tmp_path, recs, task.aggregate(recs))["longbench"]
    assert extra["fuzz_backend"] == "levenshtein"
    assert extra["data"]["source"] == f"dir:{FIX}"
    assert set(extra["data"]["files_sha256"]) == {"lcc.jsonl"}
    assert "official_pred_dir" not in extra and not (tmp_path / "longbench_pred").exists()


def test_longbench_e_empty_bucket_left_out_of_bucket_average(tok):
    task = LongBenchE(datasets=["passage_count", "trec"], data_dir=str(FIX), limit=1)  # only length 1200 rows
    recs = _records(task, tok, ["2", "Animal"])
    got = task.aggregate(recs)
    assert got["passage_count:0-4k"] == 100.0 and math.isnan(got["trec:4-8k"])
    assert got["avg:0-4k"] == 100.0 and "avg:4-8k" not in got and "avg:8k+" not in got


def test_aggregate_rejects_foreign_records():
    with pytest.raises(TaskError, match="meta.dataset"):
        LongBench().aggregate([{"id": "x", "prediction": "", "answers": [], "meta": {}}])


def test_score_cli_missing_fields(tmp_path, capsys):
    (tmp_path / "trec.jsonl").write_text('{"pred": "a", "answers": ["a"], "all_classes": ["a"]}\n')
    assert score_main([str(tmp_path), "--longbench-e"]) == 2
    assert "missing 'length'" in capsys.readouterr().err
    (tmp_path / "trec.jsonl").write_text('{"pred": "a", "answers": ["a"]}\n')
    assert score_main([str(tmp_path)]) == 2
    assert "missing 'all_classes'" in capsys.readouterr().err


def test_binary_files_are_one_line_errors(tmp_path, tok, capsys):
    # A data file that is not UTF-8 (0xff on line 2) is bad input: the LongBench reader names file and line ...
    (tmp_path / "trec.jsonl").write_bytes(b'{"input": "a"}\n\xff\n')
    with pytest.raises(TaskError, match=r"trec\.jsonl:2: not UTF-8 text \(byte 0xff at offset 15\)"):
        list(LongBench(datasets=["trec"], data_dir=str(tmp_path)).samples(env(tok)))
    # ... and kvbench-score exits 2 with one line.
    assert score_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"kvbench-score: {tmp_path / 'trec.jsonl'}:2: not UTF-8 text " \
                                              f"(byte 0xff at offset 15); expected a UTF-8 text file"
