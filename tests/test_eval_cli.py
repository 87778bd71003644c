"""``fastdistill eval`` and the held-out metrics without servers: arguments, errors, exact-match grading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastdistill.cli import _teacher_urls, main
from fastdistill.errors import ConfigError
from fastdistill.rollout import RolloutSample
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
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


def _sample(tokenizer, completion: str, teacher_id: str = "default", row: int = 0) -> RolloutSample:
    prompt = tokenizer("Q", add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(completion_ids)
    return RolloutSample(input_ids=np.array(prompt + completion_ids, np.int32),
                         completion_mask=np.array([0] * len(prompt) + [1] * n, np.int32),
                         teacher_topk_ids=np.zeros((n, 2), np.int32),
                         teacher_topk_logprobs=np.zeros((n, 2), np.float32),
                         rollout_logprobs=np.zeros(n, np.float32), model_version=0, teacher_id=teacher_id,
                         prompt_id=row, dataset_index=row)


def test_exact_match_grades_only_rows_with_an_answer():
    tokenizer = build_tokenizer()
    samples = [_sample(tokenizer, "5", row=0), _sample(tokenizer, "1 2 3", row=1), _sample(tokenizer, "cat", row=2)]
    stats = torch.tensor([[10.0, 5.0]], dtype=torch.float64)
    record = eval_record(stats, samples, ["default"], answers=[" 5", "1 2", None], tokenizer=tokenizer)
    assert record["eval/exact_match"] == 0.5
    assert record["eval/jsd"] == 0.5 and record["eval/samples_total"] == 3.0
    assert "eval/exact_match" not in eval_record(stats, samples, ["default"], answers=[None] * 3)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        eval_record(stats, samples, ["default"], answers=["5", None, None])


def test_a_failed_eval_row_is_counted_and_its_answer_not_graded():
    """Row 1's rollout failed: the samples are rows 0 and 2, graded against their own answers."""
    tokenizer = build_tokenizer()
    samples = [_sample(tokenizer, "5", row=0), _sample(tokenizer, "cat", row=2)]
    stats = torch.tensor([[4.0, 2.0]], dtype=torch.float64)
    record = eval_record(stats, samples, ["default"], answers=["5", "1 2", "dog"], tokenizer=tokenizer, failed=1)
    assert record["eval/failed_total"] == 1.0 and record["eval/samples_total"] == 2.0
    assert record["eval/exact_match"] == 0.5


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


# ------------------------------------------------------------------------------------------- hidden-state teachers


class FakeServer:
    """A stand-in vLLM server on 127.0.0.1, served from a background thread: ``/health``, ``/v1/models`` (model id
    ``name``), ``/tokenize`` (one id per character, the same on every fake) and, with ``width``, ``/pooling``
    answering rows of ones of that width in the requested dtype (this machine's byte order, little-endian).
    ``paths`` records every request's path."""

    def __init__(self, name: str, width: int | None = None):
        import asyncio
        import threading

        from fastdistill.serve import free_port

        self.name, self.width = name, width
        self.url = f"http://127.0.0.1:{free_port()}"
        self.paths: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def handle(self, request):
        import base64

        from aiohttp import web

        self.paths.append(request.path)
        if request.path == "/health":
            return web.Response(status=200)
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": self.name, "max_model_len": 512}]})
        if request.path == "/tokenize":
            return web.json_response({"tokens": [ord(c) % 97 for c in (await request.json())["prompt"]]})
        if request.path == "/pooling" and self.width is not None:
            body = await request.json()
            rows = torch.ones(len(body["input"]), self.width, dtype=getattr(torch, body["embed_dtype"]))
            rows = rows.view(torch.int16 if rows.dtype == torch.bfloat16 else torch.int32).numpy()
            return web.json_response({"data": [{"data": base64.b64encode(rows.tobytes()).decode()}]})
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", int(self.url.rsplit(":", 1)[1])).start()

    def __enter__(self) -> FakeServer:
        import asyncio

        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc_info: object) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def hidden_config(model_dir, student, teacher, output_dir, head_dir=None, **overrides):
    """A run with one hidden-state teacher ``dense`` (head from ``head_dir`` when given, else from what its server
    serves), no weight sync, short completions."""
    from fastdistill.train.config import AsyncDistillationConfig

    values = dict(model_name_or_path=str(model_dir), output_dir=str(output_dir), vllm_server_base_url=student.url,
                  teacher_server_urls={"dense": teacher.url}, teacher_signal="hidden", weight_sync_backend="none",
                  max_completion_length=8, token_budget=0, max_steps=1, disable_tqdm=True, save_strategy="no",
                  export_final_model=False, gradient_checkpointing=False)
    if head_dir is not None:
        values["teacher_model_paths"] = {"dense": str(head_dir)}
    values.update(overrides)
    return AsyncDistillationConfig(**values)


@pytest.mark.parametrize("case", ["no head folder", "fewer vocabulary rows", "other width"])
def test_eval_and_training_refuse_a_hidden_teacher_alike_before_any_rollout(case, model_dir, tmp_path):
    """Against fake servers (the student's and a hidden-state teacher's): a teacher head that cannot serve is the
    same ConfigError in `fastdistill eval` as at the start of training, raised before any row is generated or
    scored. "other width": the server sends 8-wide hidden states, the head (the student's own checkpoint, 64 wide)
    takes 64."""
    from fastdistill.train.evaluate import evaluate_saved_model
    from fastdistill.train.trainer import AsyncDistillationTrainer

    tokenizer = build_tokenizer()
    head_dir = {"no head folder": None, "other width": model_dir,
                "fewer vocabulary rows": save_pretrained_dir(
                    build_model(tiny_config(len(tokenizer) - 8, pad_token_id=0, eos_token_id=2), seed=1), tokenizer,
                    tmp_path / "small")}[case]
    expected = {"no head folder": "no teacher_model_paths entry, and its server serves 'org/teacher', which is "
                                  "neither a local folder nor a model in this machine's Hugging Face cache",
                "fewer vocabulary rows": f"has {len(tokenizer) - 8} vocabulary rows, fewer than the student's "
                                         f"{len(tokenizer)}",
                "other width": f"its server sends hidden states of width 8, but its lm_head in {model_dir} takes "
                               "width 64"}[case]
    messages = []
    with FakeServer("student") as student, FakeServer("org/teacher", width=8) as teacher:
        cfg = hidden_config(model_dir, student, teacher, tmp_path / "run", head_dir)
        with pytest.raises(ConfigError) as in_eval:
            evaluate_saved_model(cfg, [{"prompt": "hi"}])
        messages.append(str(in_eval.value))
        with pytest.raises(ConfigError) as in_training:
            AsyncDistillationTrainer(cfg, train_dataset=[{"prompt": "hi"}]).train()
        messages.append(str(in_training.value))
    assert messages[0] == messages[1] and expected in messages[0] and "teacher 'dense'" in messages[0]
    # nothing was generated, nothing scored but the one-token width probe (once in eval, once in training)
    assert "/v1/completions" not in student.paths
    assert teacher.paths.count("/pooling") == 2


def test_eval_scores_mixed_top_k_and_hidden_teachers(tmp_path, monkeypatch, capsys):
    """`fastdistill eval` with a top-K teacher and a hidden-state teacher (what the servers would answer stood in
    for by given samples): eval/jsd and eval/teacher_jsd/<id> equal the float64 references, sparse on the top-K
    teacher's rows and dense with the hidden teacher's head on the other's; teacher_signal and teacher_model_paths
    may name the ids given with --teacher-url."""
    from test_hidden_training import TEACHERS, as_hidden_sample, reference_step

    import fastdistill.train.evaluate as evaluate
    from fastdistill_testing.synthetic import synthetic_samples

    tokenizer = build_tokenizer()
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2),
                                                  seed=7), tokenizer, tmp_path / "student")
    hidden_model = build_model(tiny_config(len(tokenizer) + 8, hidden_size=96, pad_token_id=0, eos_token_id=2),
                               seed=11).float().eval()
    teacher_dir = save_pretrained_dir(hidden_model, tokenizer, tmp_path / "teacher")
    topk_teacher = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=103).eval()
    samples = synthetic_samples(topk_teacher, len(tokenizer), 6, teacher_ids=list(TEACHERS), seed=5)
    samples = [s if s.teacher_id == "topk" else as_hidden_sample(s, hidden_model, torch.bfloat16) for s in samples]
    seen = {}

    def collect(*args, **kwargs):
        seen.update(kwargs)
        return samples

    monkeypatch.setattr(evaluate, "collect_scored_samples", collect)
    monkeypatch.setattr(evaluate, "served_logprob_gap", lambda *args, **kwargs: 0.0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "x", "teacher_id": s.teacher_id}) + "\n" for s in samples))
    with FakeServer("student") as student, FakeServer("org/teacher", width=96) as teacher:
        code = main(["eval", "--model", str(student_dir), "--student-url", student.url, "--teacher-url",
                     "topk=http://127.0.0.1:9", "--teacher-url", f"dense={teacher.url}", "--dataset", str(rows),
                     "--output", str(tmp_path / "eval.json"), "teacher_signal={dense: hidden}",
                     f"teacher_model_paths={{dense: {json.dumps(str(teacher_dir))}}}"])
    assert code == 0
    assert seen["teacher_signals"] == {"topk": "topk", "dense": "hidden"} and seen["hidden_dtype"] == "bfloat16"
    report = json.loads((tmp_path / "eval.json").read_text())
    expected, per_teacher, slack = reference_step(student_dir, teacher_dir, samples, 0.0, list(TEACHERS))
    assert abs(report["eval/jsd"] - expected) <= 1e-5 * abs(expected) + slack
    for teacher_id, value in per_teacher.items():
        assert abs(report[f"eval/teacher_jsd/{teacher_id}"] - value) <= 1e-5 * abs(value) + slack
