"""The KV-compression benchmark's tasks: prompts of about the asked length (within a row of the
document) whose answer is in the context at the asked depth; deterministic from the seed."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from selfattn.benchmarks.kv_compression import TASKS, make_samples


@pytest.fixture(scope="module")
def tokenizer():
    from selfattn.models import load_tokenizer
    from selfattn.models.bundled import ChatModelMissing, chat_model_path

    try:
        return load_tokenizer(str(chat_model_path()))
    except ChatModelMissing as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("task", TASKS)
def test_prompt_holds_its_answer_at_its_depth(tokenizer, task):
    length, n = 512, 3
    samples = make_samples(tokenizer, task, length, n, seed=7)
    assert samples == make_samples(tokenizer, task, length, n, seed=7)
    assert samples != make_samples(tokenizer, task, length, n, seed=8)
    where = []
    for s in samples:
        assert length - 64 <= len(s.context) + len(s.question) <= length
        text = tokenizer.decode(s.context)
        assert s.answer not in tokenizer.decode(s.question)
        where.append(text.index(s.answer) / len(text))
    # depths spread over 10 %-90 % in order (the template's head and intro shift them a little)
    assert where == sorted(where) and where[0] < 0.35 and where[-1] > 0.65, where
