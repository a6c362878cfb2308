"""task=jsonl: prompt encoding (one BOS with and without the chat template) and the context split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.tasks.base import TaskEnv
from kvbench.tasks.jsonl import JsonlTask


def _file(tmp_path: Path, rows: list[dict]) -> str:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_holds_exactly_one_bos(tmp_path, tok, chat):
    path = _file(tmp_path, [{"id": "a", "prompt": "abc", "answers": ["x"]},
                            {"id": "b", "context": "abc", "question": "def", "answers": ["x"]}])
    env = TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=1000)
    a, b = JsonlTask(path=path, chat_template=chat).samples(env)
    user, end, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|end|>", "<|assistant|>"])
    # "abc" -> a b c = 72 73 74; "\n" = 206 (the tiny tokenizer, by hand in test_longbench_task.py).
    if chat:
        # The template writes "<s><|user|>\n{content}<|end|>\n<|assistant|>\n"; its "<s>" is the only BOS.
        assert a.input_ids == [0, user, 206, 72, 73, 74, end, 206, assistant, 206]
    else:
        assert a.input_ids == [0, 72, 73, 74]
    assert b.input_ids.count(tok.bos_token_id) == 1
    # The context tokens: (chat prefix +) "abc", counted under the same encoding rule.
    assert b.context_tokens == (6 if chat else 4)
