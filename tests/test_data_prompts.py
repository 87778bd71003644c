"""tokenize_prompts: chat / text / pre-tokenised rows, teacher ids, template kwargs, and every error a user can hit."""

from __future__ import annotations

import numpy as np
import pytest

from fastdistill.data import tokenize_prompts
from fastdistill.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_chat_prompt_uses_the_template_with_a_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    (out,) = tokenize_prompts([{"prompt": messages}], tokenizer)
    assert tokenizer.decode(out["prompt_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The call TRL 1.16's rollout worker makes, token for token.
    assert out["prompt_ids"] == tokenizer.apply_chat_template(messages, return_dict=False, add_generation_prompt=True)
    assert out["prompt"] is messages and "teacher_id" not in out


def test_text_prompt_is_tokenised_without_special_tokens(tokenizer):
    (out,) = tokenize_prompts([{"prompt": "Count to 5:"}], tokenizer)
    assert out["prompt_ids"] == tokenizer("Count to 5:", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(out["prompt_ids"]) == "Count to 5:"


def test_prompt_ids_pass_through_and_need_no_tokenizer():
    rows = [{"prompt_ids": [5, 6, 7], "teacher_id": "math"}, {"prompt_ids": np.array([8, 9], np.int64), "prompt": "x"}]
    out = tokenize_prompts(rows)
    assert out == [
        {"prompt_ids": [5, 6, 7], "teacher_id": "math", "prompt": None},
        {"prompt_ids": [8, 9], "prompt": "x"},
    ]
    assert all(type(t) is int for t in out[1]["prompt_ids"])


def test_teacher_id_is_copied_and_omitted_when_absent(tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "teacher_id": "code"},
        {"prompt": "hi", "teacher_id": None},
        {"prompt": "hi"},
    ]
    out = tokenize_prompts(rows, tokenizer)
    assert [row.get("teacher_id", "<absent>") for row in out] == ["code", "<absent>", "<absent>"]


def test_chat_template_kwargs_reach_the_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% if enable_thinking %}{{ ' <think>' }}{% endif %}{% endif %}"
    )
    row = {"prompt": [{"role": "user", "content": "hi"}]}
    plain = tokenize_prompts([row], tokenizer)[0]["prompt_ids"]
    thinking = tokenize_prompts([row], tokenizer, chat_template_kwargs={"enable_thinking": True})[0]["prompt_ids"]
    assert tokenizer.decode(plain) == "user: hi\nassistant:"
    assert tokenizer.decode(thinking) == "user: hi\nassistant: <think>"


def test_max_prompt_tokens_is_inclusive(tokenizer):
    row = {"prompt_ids": [3, 4, 5]}
    assert tokenize_prompts([row], tokenizer, max_prompt_tokens=3)[0]["prompt_ids"] == [3, 4, 5]
    with pytest.raises(ValueError, match="row 1: the prompt has 3 tokens, more than max_prompt_tokens=2"):
        tokenize_prompts([{"prompt_ids": [1]}, row], tokenizer, max_prompt_tokens=2)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"text": "hi"}, "row 1: no 'prompt' .* and no 'prompt_ids'"),
        ({"prompt": 42}, "row 1: 'prompt' must be a list of chat messages or a string, got int"),
        ({"prompt": []}, "row 1: 'prompt' is an empty list of messages"),
        ({"prompt": [{"content": "hi"}]}, "row 1: message 0 of 'prompt' must be a mapping with a 'role'"),
        ({"prompt": ["hi"]}, "row 1: message 0 of 'prompt' must be a mapping with a 'role'"),
        ({"prompt": ""}, "row 1: the prompt tokenises to no tokens"),
        ({"prompt_ids": []}, "row 1: the prompt tokenises to no tokens"),
        ({"prompt_ids": [1, -2]}, "row 1: prompt ids must be non-negative, got -2"),
        ({"prompt_ids": [1.5, 2.0]}, "row 1: prompt ids must be a flat sequence of ints"),
        ({"prompt_ids": [[1, 2]]}, "row 1: prompt ids must be a flat sequence of ints"),
        ({"prompt_ids": [1, 10_000]}, "row 1: prompt_ids holds id 10000, outside the tokenizer's"),
        ({"prompt": "hi", "teacher_id": 3}, "row 1: teacher_id must be a string, got 3"),
        ("just text", "row 1: expected a mapping with 'prompt' or 'prompt_ids', got str"),
    ],
)
def test_row_errors_name_the_row(tokenizer, row, match):
    with pytest.raises(ValueError, match=match):
        tokenize_prompts([{"prompt": "fine"}, row], tokenizer)


def test_text_prompt_without_a_tokenizer():
    with pytest.raises(ValueError, match=r"row 0: a tokenizer is needed to tokenise 'prompt'"):
        tokenize_prompts([{"prompt": "hi"}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chat_template_kwargs": {"tokenize": False}}, r"chat_template_kwargs may not set \['tokenize'\]"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False, "return_dict": True}},
            r"may not set \['add_generation_prompt', 'return_dict'\]",
        ),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs must be a mapping or None, got str"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens must be a positive int or None, got 0"),
        ({"max_prompt_tokens": 2.5}, "max_prompt_tokens must be a positive int or None, got 2.5"),
    ],
)
def test_argument_errors(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tokenize_prompts([{"prompt": "hi"}], tokenizer, **kwargs)
