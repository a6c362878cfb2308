"""RULER: templates vs the official constants, key space, generators (budget + answers), scorers, aggregation."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from kvbench.metrics import get_metric
from kvbench.metrics.ruler import dataset_score, postprocess_pred, string_match_all, string_match_part
from kvbench.models.tiny import build_tiny_tokenizer
from kvbench.tasks.base import TaskEnv, TaskError
from kvbench.tasks.ruler import Ruler
from kvbench.tasks.ruler.constants import DEPTHS, NOISE, TASKS, TEMPLATES
from kvbench.tasks.ruler.synthetic import vt_noise
from kvbench.tasks.ruler.words import SortedKeySpace, cwe_vocab, niah_keys

from shared_reference import reference_file


def _env(tok, chat=True):
    return TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=8192, chat_template=chat)


def _ntok(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


# --- constants against the official files ------------------------------------------------------------------------

def test_templates_equal_official_constants():
    f = reference_file("ruler", "data_synthetic_constants.json")
    assert TEMPLATES == json.loads(f.read_text())["TASKS"]


def test_task_table_equals_official_synthetic_yaml():
    f = reference_file("ruler", "synthetic.yaml")
    import yaml

    official = yaml.safe_load(f.read_text())
    assert {name: (v["task"], v["args"]) for name, v in official.items()} == TASKS


def test_depths_from_spec():
    assert DEPTHS == [0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54, 56, 59, 62,
                      64, 67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100]


def test_word_list_sizes_from_spec():
    assert len(niah_keys()) == 6_175_260  # wonderwords 2.2.0, the version RULER pins
    assert len(cwe_vocab()) == 8_169


def test_sorted_key_space_equals_brute_force():
    # hyphen families ("blue"/"blue-eyed"), a space ("ad hoc" sorts before "ad-"), upper case, hyphenated nouns
    adjs = ["blue", "blue-eyed", "ad hoc", "ad", "Early", "zonked", "high", "high-pitched", "blue"]
    nouns = ["ox", "eyed-ox", "apple", "ATM", "back-up", "eyed"]
    ks = SortedKeySpace(adjs, nouns)
    brute = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    assert len(ks) == len(brute) and list(ks) == brute
    assert ks[-1] == brute[-1]


# --- generators --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    articles = []
    # 60 paragraphs: the qa_1 search probes (at most 30 documents at length 1024) stay below the document count,
    # so the shared document list is never shuffled in place (test_qa_all_documents_shuffles_...).
    for a in range(12):
        paras = []
        for p in range(5):
            text = f"Paragraph {a}-{p} tells that the keeper of hall {a}{p} is named Keeper{a}{p}."
            paras.append({"context": text, "qas": [
                {"question": f"Who keeps hall {a}{p}?", "is_impossible": False,
                 "answers": [{"text": f"Keeper{a}{p}"}, {"text": f"named Keeper{a}{p}"}]},
                {"question": "Unanswerable?", "is_impossible": True, "answers": []}]})
        articles.append({"title": f"t{a}", "paragraphs": paras})
    squad = d / "squad.json"
    squad.write_text(json.dumps({"data": articles}))
    hotpot_rows = []
    for q in range(6):
        ctx = [[f"Title{q}_{j}", [f"Fact {q}.{j} says the code is C{q}{j}. ", "Nothing else. "]] for j in range(10)]
        hotpot_rows.append({"question": f"What is the code of {q}.0?", "answer": f"C{q}0", "context": ctx})
    hotpot = d / "hotpot.json"
    hotpot.write_text(json.dumps(hotpot_rows))
    return str(squad), str(hotpot)


# The tiny tokenizer spends ~3.6 tokens per word, so tasks whose smallest unit is big (an essay step is 500 words,
# cwe's few-shot example alone is ~1100 words) need longer budgets than with a real tokenizer.
LENGTHS = {"niah_single_1": 1024, "niah_multikey_2": 1024, "niah_multikey_3": 1024, "fwe": 1024, "qa_1": 1024,
           "qa_2": 1024, "vt": 4096, "niah_single_2": 4096, "niah_single_3": 4096, "niah_multikey_1": 4096,
           "niah_multivalue": 4096, "niah_multiquery": 4096, "cwe": 8192}


@pytest.mark.parametrize("task", list(TASKS))
def test_generator_budget_and_answers(task, tok, qa_files):
    length = LENGTHS[task]
    r = Ruler(tasks=[task], lengths=[length], num_samples=2, squad_path=qa_files[0], hotpot_path=qa_files[1])
    samples = list(r.samples(_env(tok)))
    assert len(samples) == 2
    kind = TASKS[task][0]
    ttg = TEMPLATES[kind]["tokens_to_generate"]
    for i, s in enumerate(samples):
        assert s.id == f"{task}_L{length}_{i}"
        assert _ntok(tok, s.prompt) + ttg <= length
        assert s.max_new_tokens == ttg
        assert s.input_ids == tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert s.prompt.startswith("<s><|user|>\n")
        assert s.answers and all(a in s.prompt for a in s.answers)
        # answer prefix after the chat wrapper, question after the context
        assert "<|end|>\n<|assistant|>\n" + s.meta["answer_prefix"].split("<|end|>\n<|assistant|>\n")[-1] \
            in s.prompt
        assert 0 < s.context_tokens < len(s.input_ids)
        tail = tok.decode(s.input_ids[s.context_tokens:])
        assert "Question" in tail or "What" in tail or "Answer" in tail
    if kind == "qa":
        # the gold document of question i is in the prompt of sample i
        gold = ["Keeper00", "Keeper01"] if task == "qa_1" else ["C00", "C10"]
        assert [g in s.prompt for g, s in zip(gold, samples)] == [True, True]


def test_niah_singular_and_plural_rewrite(tok):
    single = next(Ruler(tasks=["niah_single_1"], lengths=[1024], num_samples=1).samples(_env(tok)))
    assert single.prompt.startswith("<s><|user|>\nA special magic number is hidden within the following text.")
    assert single.prompt.endswith(" mentioned in the provided text is")
    assert "\nWhat is the special magic number for " in single.prompt
    assert "One of the special magic numbers for " in single.prompt  # the needle keeps the plural
    multi = next(Ruler(tasks=["niah_multivalue"], lengths=[4096], num_samples=1).samples(_env(tok)))
    assert "Some special magic numbers are hidden" in multi.prompt
    assert multi.prompt.endswith(" mentioned in the provided text are")
    assert len(multi.answers) == 4


def test_vt_has_one_shot_example_and_five_names(tok):
    s = next(Ruler(tasks=["vt"], lengths=[4096], num_samples=1).samples(_env(tok)))
    assert s.prompt.count("Memorize and track the chain(s)") == 2  # example + task
    assert "12345" not in s.prompt  # the example's value is re-drawn per sample
    assert len(s.answers) == 5 and all(len(a) == 5 and a.isupper() for a in s.answers)
    assert s.prompt.endswith(" 5 variables are assigned the value "
                             f"{s.prompt.split('VAR ' + s.answers[0] + ' = ')[1].split()[0]}, they are: ")


# --- vt and fwe against the official generators' logic -------------------------------------------------------------

def test_vt_noise_is_split_only_below_the_chain_length():
    # Official rule: the noise lines are cut into sentences only when there are fewer lines than assignments.
    assert vt_noise(5, 5) == [NOISE] * 5
    assert vt_noise(6, 5) == [NOISE] * 6
    pieces = ["The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
              " There and back again.", ""]  # NOISE.split(".") with the "." put back on each non-empty piece
    assert vt_noise(4, 5) == pieces * 4
    assert vt_noise(1, 5) == pieces


def test_vt_example_at_the_boundary_keeps_whole_noise_lines(tok):
    # With the tiny tokenizer the one-shot example never fits its 500 tokens, so it stays at the smallest size:
    # 5 noise lines for a 5-assignment chain. 5 is not below 5, so the lines stay whole, and 5 positions sampled
    # from range(5) are 0..4: the context alternates assignment, noise line, assignment, ...
    s = next(Ruler(tasks=["vt"], lengths=[4096], num_samples=1).samples(_env(tok)))
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    example = s.prompt.split(head)[1].split("\nQuestion:")[0].split("\n")
    assert len(example) == 10
    assert example[1::2] == [NOISE] * 5
    assert example[0].startswith("VAR ") and example[0].split(" = ")[1].isdigit()
    assert all(line.startswith("VAR ") and " = VAR " in line for line in example[2::2])


def test_vt_fit_is_measured_with_the_randomized_example(tok):
    # Each retry draws the sample and the example's new names together and measures that whole text. At this
    # length, measuring the task text plus the un-randomized example's count instead let samples run 2-8 tokens
    # over the budget.
    length = 3182
    for s in Ruler(tasks=["vt"], lengths=[length], num_samples=3).samples(_env(tok)):
        assert _ntok(tok, s.prompt) + TEMPLATES["variable_tracking"]["tokens_to_generate"] <= length, s.id


class WordTok:
    """A stand-in tokenizer: one token per whitespace word. Records every count it is asked for; the call numbered
    `force` (1-based) reports 10,000 extra tokens, to force one shrink retry."""

    chat_template = None

    def __init__(self, force: int | None = None) -> None:
        self.calls: list[int] = []
        self.force = force

    def __call__(self, text, add_special_tokens=True):
        n = len(text.split())
        self.calls.append(n)
        return {"input_ids": [0] * (n + (10_000 if len(self.calls) == self.force else 0))}


def _fwe(tok, num_samples=2, length=1650):
    env = TaskEnv(tokenizer=tok, model_name="fake", max_prompt_tokens=length, chat_template=False)
    return Ruler(tasks=["fwe"], lengths=[length], num_samples=num_samples).generate("fwe", length, env)


def _fwe_words(n, vocab_size):
    # Zipf counts of the spec: int(n * k^-2 / zeta(2)) for ranks k = 1..vocab_size.
    z = math.pi ** 2 / 6
    return sum(int(n * k ** -2.0 / z) for k in range(1, vocab_size + 1))


def _fwe_count(n):
    t = TEMPLATES["freq_words_extraction"]
    fixed = len(t["template"].format(context="", query="").split()) + len(t["answer_prefix"].split())
    return fixed + _fwe_words(n, 32)


def _fwe_grid():
    # length 1650: max_len = 1650 - 50 = 1600, vocabulary 1600 // 50 = 32 words, increment 1600 // 32 = 50,
    # start 1600 // 6 = 266 words; the sizes probed, up to the first one whose text is not below 1600.
    grid = [266]
    while _fwe_count(grid[-1]) < 1600:
        grid.append(grid[-1] + 50)
    return grid


def test_fwe_sizing_keeps_the_last_size_below_the_budget():
    # Grow while the measured text is below 1600, then step back once: the size used is the last one measured
    # below 1600, which fits, so every sample is measured once and never retried.
    grid = _fwe_grid()
    count = _fwe_count
    assert len(grid) > 2 and count(grid[-1]) > 1600  # the last probe is over: a retry would show
    tok = WordTok()
    gens = _fwe(tok)
    assert tok.calls == [count(n) for n in grid] + [count(grid[-2])] * 2
    assert [len(g.context.split()) for g in gens] == [_fwe_words(grid[-2], 32)] * 2


def test_fwe_keeps_the_vocabulary_across_shrink_retries():
    plain = WordTok()
    base = _fwe(plain)
    first_sample_call = len(plain.calls) - 1  # 1-based number of sample 0's count (after the sizing counts)
    forced = WordTok(force=first_sample_call)
    gens = _fwe(forced)
    # Sample 0 is measured over budget once and shrinks by one increment (50 words), with the same vocabulary:
    # same answers, and sample 1 draws exactly what it drew before.
    assert forced.calls[:first_sample_call - 1] == plain.calls[:first_sample_call - 1]
    assert len(forced.calls) == len(plain.calls) + 1
    assert gens[0].answers == base[0].answers
    assert gens[1].text == base[1].text
    size = _fwe_grid()[-2]
    assert len(base[0].context.split()) == _fwe_words(size, 32)
    assert len(gens[0].context.split()) == _fwe_words(size - 50, 32)
    assert set(gens[0].context.split()) <= set(base[0].context.split())


def test_qa_all_documents_shuffles_the_shared_list_in_place(tmp_path, tok):
    # When a sample asks for all documents, RULER shuffles its one document list in place (not a copy), so each
    # such request reorders the order the previous one left: sample 1's documents are sample 0's order shuffled
    # once more with random.Random(42).
    paras = [{"context": f"Paragraph {p} names keeper K{p}.", "qas": [
        {"question": f"Who keeps {p}?", "is_impossible": False, "answers": [{"text": f"K{p}"}]}]} for p in range(5)]
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paras}]}))
    r = Ruler(tasks=["qa_1"], lengths=[4096], num_samples=2, squad_path=str(squad))
    orders = []
    for s in r.samples(_env(tok)):
        blocks = s.prompt.split("Document ")[1:]
        assert [b.split(":\n", 1)[0] for b in blocks] == ["1", "2", "3", "4", "5"]  # all 5 documents
        orders.append([b.split(":\n", 1)[1].split("\n\n")[0] for b in blocks])
    expected = list(orders[0])
    random.Random(42).shuffle(expected)
    assert orders[1] == expected != orders[0]

def test_generation_is_deterministic_and_seeded(tok):
    r = Ruler(tasks=["niah_multikey_3", "fwe"], lengths=[1024], num_samples=2)
    a = [s.prompt for s in r.samples(_env(tok))]
    assert a == [s.prompt for s in r.samples(_env(tok))]
    other = TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=8192, seed=7)
    assert a != [s.prompt for s in r.samples(other)]


def test_essay_haystack_dir_and_plain_prompt(tmp_path, tok):
    (tmp_path / "a.txt").write_text("The lighthouse keeper counted gulls every morning. " * 40, encoding="utf-8")
    r = Ruler(tasks=["niah_single_2"], lengths=[4096], num_samples=1, haystack_dir=str(tmp_path))
    s = next(r.samples(_env(tok, chat=False)))
    assert s.prompt.startswith("A special magic number is hidden")
    assert "The lighthouse keeper counted gulls every morning." in s.prompt
    assert s.input_ids[0] == tok.bos_token_id
    notes = r.finalize(tmp_path, [], {})["notes"]
    assert any(f"dir:{tmp_path}" in n for n in notes)


def test_qa_skipped_without_data(tok, caplog):
    r = Ruler(tasks=["qa_1", "niah_single_1", "qa_2"], lengths=[1024], num_samples=1)
    with caplog.at_level("WARNING"):
        ids = [s.id for s in r.samples(_env(tok))]
    assert ids == ["niah_single_1_L1024_0"]
    assert "squad_path" in caplog.text and "hotpot_path" in caplog.text
    notes = r.finalize(Path("."), [], {})["notes"]
    assert any(n.startswith("ruler qa_1: skipped") for n in notes)
    assert any(n.startswith("ruler qa_2: skipped") for n in notes)


def test_bad_config():
    with pytest.raises(TaskError, match="unknown RULER task"):
        Ruler(tasks=["niah_single_9"])
    with pytest.raises(TaskError, match="auto, nltk, regex"):
        Ruler(sentence_splitter="spacy")
    with pytest.raises(TaskError, match="squad_path not found"):
        Ruler(tasks=["qa_1"], lengths=[1024], num_samples=1, squad_path="/nonexistent.json").generate(
            "qa_1", 1024, _env(build_tiny_tokenizer()))


# --- scorers -----------------------------------------------------------------------------------------------------

def test_postprocess():
    assert postprocess_pred("  a\tb\x00c \n") == "a\nb\nc"


@pytest.mark.parametrize("pred, refs, all_, part", [
    ("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"], 2 / 3, 1.0),
    ("ABC-DEF", ["abc-def"], 1.0, 1.0),  # case-insensitive
    ("12345678", ["1234567"], 1.0, 1.0),  # substring, not token, match
    ("nothing", ["x", "y"], 0.0, 0.0),
    ("123\x004567", ["1234567"], 0.0, 0.0),  # control char -> newline breaks the match
    ("anything", [], 0.0, 0.0),
])
def test_string_match(pred, refs, all_, part):
    assert string_match_all(pred, refs) == pytest.approx(all_)
    assert string_match_part(pred, refs) == part


def test_dataset_score_and_registry():
    assert dataset_score([1.0, 0.5, 0.0]) == 50.0
    assert dataset_score([1.0, 0.0, 0.0]) == 33.33
    assert dataset_score([]) == 0.0
    assert get_metric("string_match_all") is string_match_all
    assert get_metric("string_match_part") is string_match_part


def test_aggregate_per_task_per_length_avg():
    def rec(task, length, pred, answers, metric="string_match_all"):
        return {"prediction": pred, "answers": answers, "score": 0.0,
                "meta": {"task": task, "length": length, "metric": metric}}

    records = [
        rec("niah_single_1", 4096, "1234567", ["1234567"]), rec("niah_single_1", 4096, "no", ["7654321"]),  # 50
        rec("vt", 4096, "AAAAA BBBBB", ["AAAAA", "BBBBB", "CCCCC", "DDDDD"]),  # 50
        rec("niah_single_1", 8192, "1234567", ["1234567"]),  # 100
        rec("vt", 8192, "aaaaa", ["AAAAA", "BBBBB", "CCCCC"]),  # 33.33
    ]
    out = Ruler(tasks=["niah_single_1", "vt"]).aggregate(records)
    # Python round() acts on the binary value: (50 + 33.33) / 2 = 41.66499999... -> 41.66, likewise 66.66, 58.33
    assert out == {"niah_single_1": 75.0, "vt": 41.66, "L4096": 50.0, "L8192": 66.66,
                   "niah_single_1_L4096": 50.0, "niah_single_1_L8192": 100.0, "vt_L4096": 50.0, "vt_L8192": 33.33,
                   "avg": 58.33}
    part = [rec("qa_1", 4096, "Paris, France", ["paris", "lyon"], "string_match_part")]
    assert Ruler(tasks=["qa_1"]).aggregate(part) == {"qa_1": 100.0, "L4096": 100.0, "avg": 100.0}


def test_per_sample_windows_give_each_sample_its_own_stretch_of_the_essays(tok):
    # windows=per_sample (opt-in): sample k's essay haystack starts where sample k-1's ends, so a run's
    # samples do not share their haystack; sample 0 is the official one (start 0), and shared stays official.
    shared = Ruler(tasks=["niah_single_2"], lengths=[4096], num_samples=3)
    own = Ruler(tasks=["niah_single_2"], lengths=[4096], num_samples=3, windows="per_sample")
    a, b = list(shared.samples(_env(tok))), list(own.samples(_env(tok)))
    assert b[0].prompt == a[0].prompt and "window_start_word" not in a[0].meta
    starts = [s.meta["window_start_word"] for s in b]
    assert 0 == starts[0] < starts[1] < starts[2]  # each window after the one before
    words = own._essay
    for s, start in zip(b, starts):
        # the haystack begins with the essay words at its window's start (the first needle goes in further on)
        head = " ".join(words[start:start + 20])
        assert head in s.prompt
    assert len({" ".join(words[st:st + 20]) for st in starts}) == 3  # three different stretches
    assert a[1].prompt != b[1].prompt and " ".join(words[starts[1]:starts[1] + 20]) not in a[1].prompt
    assert own.provenance()["windows"] == "per_sample" and "windows" not in shared.provenance()
    with pytest.raises(TaskError, match="unknown windows"):
        Ruler(tasks=["niah_single_2"], windows="each")
