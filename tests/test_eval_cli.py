"""``fastdistill eval`` and the held-out metrics without servers: arguments, errors, exact-match grading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastdistill.cli import _teacher_urls, main
from fastdistill.rollout import RolloutSample
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import ConfigError
from fastdistill.train.evaluate import eval_record, prepare_eval_rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer()
    model = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("model"))


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *argv])
    return exit_info.value.code, capsys.readouterr().err


def test_teacher_urls_from_repeated_flags():
    assert _teacher_urls(["http://a:1"]) == {"default": "http://a:1"}
    assert _teacher_urls(["math=http://a:1", "code=http://b:2", "code=http://c:3"]) == {
        "math": "http://a:1", "code": ["http://b:2", "http://c:3"]}
    with pytest.raises(ConfigError, match="must look like URL or ID=URL"):
        _teacher_urls(["=http://a:1"])


def test_a_missing_model_folder_is_a_config_error(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi"}) + "\n")
    code, err = run_cli(capsys, "--model", str(tmp_path / "nope"), "--student-url", "http://127.0.0.1:9",
                        "--teacher-url", "http://127.0.0.1:10", "--dataset", str(rows))
    assert code == 2 and "model folder" in err and "does not exist" in err


def test_no_dataset_is_a_config_error(model_dir, capsys):
    code, err = run_cli(capsys, "--model", str(model_dir), "--student-url", "http://127.0.0.1:9",
                        "--teacher-url", "http://127.0.0.1:10")
    assert code == 2 and "no held-out rows: pass --dataset" in err


def test_a_missing_dataset_file_is_a_config_error(model_dir, tmp_path, capsys):
    code, err = run_cli(capsys, "--model", str(model_dir), "--student-url", "http://127.0.0.1:9",
                        "--teacher-url", "http://127.0.0.1:10", "--dataset", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "eval_dataset" in err and "does not exist" in err


def test_a_bad_teacher_url_is_a_config_error(model_dir, tmp_path, capsys):
    code, err = run_cli(capsys, "--model", str(model_dir), "--student-url", "http://127.0.0.1:9",
                        "--teacher-url", "default=ftp://x", "--dataset", str(tmp_path / "x.jsonl"))
    assert code == 2 and "teacher_server_urls['default'] must be an http(s) URL" in err


def test_eval_rows_keep_answers_and_refuse_bad_ones():
    tokenizer = build_tokenizer()
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Count to 3."}]
    prepared = prepare_eval_rows(rows, tokenizer, ["default"])
    assert [r["answer"] for r in prepared] == ["5", None]
    assert all(r["teacher_id"] == "default" for r in prepared)
    with pytest.raises(ConfigError, match=r"row 1: 'answer' must be a string"):
        prepare_eval_rows([rows[0], {"prompt": "x", "answer": 5}], tokenizer, ["default"])
    with pytest.raises(ConfigError, match="eval_dataset: row 0"):
        prepare_eval_rows([{"nothing": 1}], tokenizer, ["default"])


def _sample(tokenizer, completion: str, teacher_id: str = "default") -> RolloutSample:
    prompt = tokenizer("Q", add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(completion_ids)
    return RolloutSample(input_ids=np.array(prompt + completion_ids, np.int32),
                         completion_mask=np.array([0] * len(prompt) + [1] * n, np.int32),
                         teacher_topk_ids=np.zeros((n, 2), np.int32),
                         teacher_topk_logprobs=np.zeros((n, 2), np.float32),
                         rollout_logprobs=np.zeros(n, np.float32), model_version=0, teacher_id=teacher_id,
                         prompt_id=0, dataset_index=0)


def test_exact_match_grades_only_rows_with_an_answer():
    tokenizer = build_tokenizer()
    samples = [_sample(tokenizer, "5"), _sample(tokenizer, "1 2 3"), _sample(tokenizer, "cat")]
    stats = torch.tensor([[10.0, 5.0]], dtype=torch.float64)
    record = eval_record(stats, samples, ["default"], answers=[" 5", "1 2", None], tokenizer=tokenizer)
    assert record["eval/exact_match"] == 0.5
    assert record["eval/jsd"] == 0.5 and record["eval/samples_total"] == 3.0
    assert "eval/exact_match" not in eval_record(stats, samples, ["default"], answers=[None] * 3)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        eval_record(stats, samples, ["default"], answers=["5", None, None])


def test_eval_rows_from_a_dataset_with_an_answer_column(tmp_path):
    import datasets

    tokenizer = build_tokenizer()
    table = datasets.Dataset.from_list([{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Count to 3.",
                                                                                       "answer": "1 2 3"}])
    prepared = prepare_eval_rows(table, tokenizer, ["default"])
    assert [r["answer"] for r in prepared] == ["5", "1 2 3"]
    assert [r["prompt_ids"] for r in prepared] == [r["prompt_ids"] for r in prepare_eval_rows(
        [{"prompt": "What is 2 + 3?"}, {"prompt": "Count to 3."}], tokenizer, ["default"])]
    path = tmp_path / "held_out.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": 5}) + "\n")
    with pytest.raises(ConfigError, match=r"eval_dataset: row 0: 'answer' must be a string"):
        prepare_eval_rows(str(path), tokenizer, ["default"])


def test_paths_with_yaml_characters_reach_the_config(tmp_path, capsys):
    odd = tmp_path / "held: out #1.jsonl"  # unquoted, YAML would read a mapping and a comment
    code, err = run_cli(capsys, "--model", str(tmp_path / "nope: x"), "--student-url", "http://127.0.0.1:9",
                        "--teacher-url", "http://127.0.0.1:10", "--dataset", str(odd))
    assert code == 2 and f"model folder {str(tmp_path / 'nope: x')!r} does not exist" in err
