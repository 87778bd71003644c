"""The training loop on synthetic samples (no servers): sharding, normalisation, checkpoint/resume, config, metrics."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_cases import TEACHERS, offline_config, synthetic_run_samples, tiny_student_dir, with_rollout_logprobs

from fastdistill.errors import ConfigError
from fastdistill.tiny import build_model, build_tokenizer, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.metrics import MetricsLogger, reduce_values
from fastdistill.train.trainer import AsyncDistillationTrainer
from fastdistill_testing.synthetic import synthetic_samples

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def samples():
    return synthetic_run_samples(24)


def config(student_dir, output_dir, **overrides) -> AsyncDistillationConfig:
    return offline_config(student_dir, output_dir, **overrides)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ distributed


def run_spec(tmp_path: Path, name: str, student_dir: Path, nproc: int, config_values: dict,
             num_samples: int = 24, eval_samples: int = 0) -> Path:
    output_dir = tmp_path / name
    spec = {"student_dir": str(student_dir), "output_dir": str(output_dir), "num_samples": num_samples, "seed": 3,
            "config": config_values, "eval_samples": eval_samples}
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    # --standalone: torchrun binds its own free port (a port picked in advance can be taken by then)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)
                ] if nproc > 1 else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([*launcher, str(HERE / "run_trainer.py"), str(spec_path)], capture_output=True,
                            text=True, timeout=900, env=env)  # only a guard against a hang
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return output_dir


@pytest.mark.slow
def test_two_process_fsdp2_matches_one_process(tmp_path, student_dir):
    """2 ranks (FSDP2 over gloo, Σ L²-balanced rows, gradient checkpointing) train exactly like 1 process."""
    # adam_epsilon=1e-3 keeps Adam's update a smooth function of the gradient: with 1e-8, a gradient element at
    # rounding level (1e-9) gets a full lr-sized step whose sign is that rounding's, so the two runs' weights could
    # differ by ~lr where their gradients agree to fp32 precision
    values = {"teacher_server_urls": TEACHERS, "weight_sync_backend": "none", "learning_rate": 1e-3,
              "num_train_epochs": 1, "gradient_checkpointing": True, "disable_tqdm": True, "save_strategy": "no",
              "token_budget": 0, "gradient_accumulation_steps": 2, "adam_epsilon": 1e-3}
    single = run_spec(tmp_path, "single", student_dir, 1, {**values, "per_device_train_batch_size": 4},
                      eval_samples=5)
    double = run_spec(tmp_path, "double", student_dir, 2, {**values, "per_device_train_batch_size": 2},
                      eval_samples=5)
    one, two = read_jsonl(single / "metrics.jsonl"), read_jsonl(double / "metrics.jsonl")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3]
    # held-out evaluation at the start and the end: 5 samples split 3 + 2 over the ranks give the same divergence
    evaluated = [(a["eval/jsd"], b["eval/jsd"]) for a, b in zip(one, two, strict=True) if "eval/jsd" in a]
    assert len(evaluated) == 2 and all("eval/jsd" in r for r in (two[0], two[-1]))
    for a, b in evaluated:
        # fp32 per-token terms of log-probs of a few nats (eps32 ≈ 1.2e-7 each), summed in another grouping
        assert abs(a - b) <= 1e-6
    one, two = one[1:], two[1:]
    for a, b in zip(one, two, strict=True):
        assert a["batch/trained_tokens_per_step"] == b["batch/trained_tokens_per_step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        for key in ("teacher_jsd/a", "teacher_jsd/b", "teacher_token_frac/a"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key]))
    weights_one = load_file(single / "final" / "model.safetensors")
    weights_two = load_file(double / "final" / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name in weights_one:
        torch.testing.assert_close(weights_one[name], weights_two[name], rtol=1e-5, atol=1e-6)
    # every prompt trained exactly once, in both runs
    for output in (single, double):
        trained = [p for line in read_jsonl(output / "trained_prompts.jsonl") for p in line["prompt_ids"]]
        assert sorted(trained) == list(range(24))


# ------------------------------------------------------------------------------------------------ normalisation


def captured_gradients(trainer: AsyncDistillationTrainer) -> list[dict[str, torch.Tensor]]:
    """Replace the optimizer step by a recorder of the gradients it would apply."""
    recorded = []

    def record(*args, **kwargs):
        recorded.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizer.step = record
    return recorded


def test_gradient_accumulation_is_a_token_mean_over_the_window(tmp_path, student_dir, samples):
    """GA=2 with micro-batches of unequal token counts gives the gradient of GA=1 on their union."""
    union = samples[:6]
    lengths = [len(s.completion_ids) for s in union]
    assert sum(lengths[:3]) != sum(lengths[3:])  # unequal micro-batches
    accumulated = AsyncDistillationTrainer(
        config(student_dir, tmp_path / "ga2", per_device_train_batch_size=3, gradient_accumulation_steps=2,
               max_grad_norm=0.0, max_steps=1), samples=union)
    whole = AsyncDistillationTrainer(
        config(student_dir, tmp_path / "ga1", per_device_train_batch_size=6, gradient_accumulation_steps=1,
               max_grad_norm=0.0, max_steps=1), samples=union)
    grads_ga2, grads_ga1 = captured_gradients(accumulated), captured_gradients(whole)
    accumulated.train()
    whole.train()
    assert len(grads_ga2) == len(grads_ga1) == 1
    for name, grad in grads_ga1[0].items():
        torch.testing.assert_close(grads_ga2[0][name], grad, rtol=1e-5, atol=1e-8)
    # and it is not the mean of the two micro-batch means (what TRL 1.16 computes)
    first = AsyncDistillationTrainer(config(student_dir, tmp_path / "m1", per_device_train_batch_size=3,
                                            max_grad_norm=0.0, max_steps=1), samples=union[:3])
    grads_first = captured_gradients(first)
    first.train()
    name = "model.model.norm.weight"
    assert not torch.allclose(grads_ga1[0][name], grads_first[0][name], rtol=1e-3)


# ------------------------------------------------------------------------------------------------ resume


class Crash(Exception):
    pass


def test_resume_after_a_crash_trains_every_prompt_exactly_once(tmp_path, student_dir, samples):
    """A run dies after step 3 (checkpoint at step 2); the resumed run retrains step 3's prompts and the rest,
    ending with the same weights as an uninterrupted run."""
    overrides = dict(per_device_train_batch_size=4, save_strategy="steps", save_steps=2, export_final_model=True)

    def crash_at_3(step, record):
        if step == 3:
            raise Crash

    crashed = AsyncDistillationTrainer(config(student_dir, tmp_path / "run", **overrides), samples=samples,
                                       on_step_end=crash_at_3)
    with pytest.raises(Crash):
        crashed.train()
    rollout_state = json.loads((tmp_path / "run" / "checkpoint-2" / "rollout_state.json").read_text())
    assert rollout_state["prompt_index"] + len(rollout_state["trained_prompt_ids_after"]) == 8
    assert rollout_state["model_version"] == 0
    resumed = AsyncDistillationTrainer(config(student_dir, tmp_path / "run", resume_from_checkpoint="latest",
                                              **overrides), samples=samples)
    summary = resumed.train()
    assert summary["steps"] == 6
    trained = [p for line in read_jsonl(tmp_path / "run" / "trained_prompts.jsonl") for p in line["prompt_ids"]]
    assert sorted(trained) == list(range(24))
    # the crashed run logged step 3 after its last checkpoint; the resumed run logs it again, once
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]

    straight = AsyncDistillationTrainer(config(student_dir, tmp_path / "straight", **overrides), samples=samples)
    straight.train()
    resumed_weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    straight_weights = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    for name, weight in straight_weights.items():
        torch.testing.assert_close(resumed_weights[name], weight, rtol=1e-6, atol=1e-7)


def test_resume_from_a_missing_checkpoint_is_an_error(tmp_path, student_dir, samples):
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, resume_from_checkpoint=str(tmp_path / "nope")),
                                       samples=samples)
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder"):
        trainer.train()


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"beta": 1.5}, r"beta must be in \[0.0, 1.0\], got 1.5"),
        ({"beta": -0.1}, r"beta must be in \[0.0, 1.0\]"),
        ({"weight_sync_steps": 0}, "weight_sync_steps must be an int >= 1, got 0"),
        ({"teacher_top_k": 0}, "teacher_top_k must be an int >= 1"),
        ({"teacher_temperature": 0.0}, "teacher_temperature must be a finite number > 0"),
        ({"teacher_temperature": 2.0}, r"teacher_temperature must be 1.0: served teachers score at temperature 1 "
                                       r"\(vLLM's prompt_logprobs ignore the request temperature"),
        ({"max_staleness": -1}, "max_staleness must be an int >= 0"),
        ({"queue_maxsize": 0}, r"queue_maxsize must be None \(automatic\) or an int >= 1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an int >= 1"),
        ({"teacher_server_urls": {}}, "teacher_server_urls must be a non-empty mapping"),
        ({"teacher_server_urls": {"math": "localhost:8001"}}, r"teacher_server_urls\['math'\] must be an http"),
        ({"teacher_server_urls": {"math": []}}, r"teacher_server_urls\['math'\] must be an http"),
        ({"vllm_server_base_url": "ftp://x"}, "vllm_server_base_url must be an http"),
        ({"token_budget": 100, "max_completion_length": 128}, "token_budget must be > max_completion_length"),
        ({"tail_mode": "approx"}, r"tail_mode must be one of \['exact', 'trl'\]"),
        ({"loss_type": "kl"}, "loss_type must be one of"),
        ({"stale_policy": "keep"}, "stale_policy must be one of"),
        ({"lr_scheduler_type": "poly"}, "lr_scheduler_type must be one of"),
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"report_to": ["mlflow"]}, "report_to must be a list drawn from"),
        ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number > 0"),
        ({"max_steps": 0}, r"max_steps must be -1 \(from epochs\) or >= 1"),
        ({"max_inflight_tasks": 0}, r"max_inflight_tasks must be -1 \(automatic\) or >= 1"),
        ({"max_lookahead_steps": 0}, r"max_lookahead_steps must be None \(3 steps\) or an int >= 1, got 0"),
        ({"max_lookahead_steps": 1.5}, r"max_lookahead_steps must be None \(3 steps\) or an int >= 1"),
        ({"max_lookahead_steps": 2, "max_inflight_tasks": 24},
         r"max_lookahead_steps must be None with an explicit max_inflight_tasks=24 .*set one of the two"),
        ({"weight_sync_one_call": "yes"}, r"weight_sync_one_call must be None \(automatic\), True or False"),
        ({"weight_sync_one_call": True, "weight_sync_backend": "nccl"},
         r"weight_sync_one_call must be None or False with weight_sync_backend='nccl'"),
        ({"min_p": 2.0}, "min_p must be None or in"),
        ({"model_name_or_path": ""}, "model_name_or_path must be a model folder"),
        ({"save_total_limit": 0}, "save_total_limit must be None or >= 1"),
        ({"importance_ratio_clip": 0.5}, "importance_ratio_clip must be >= 1"),
        ({"per_device_train_batch_size": True}, "per_device_train_batch_size must be an int >= 1"),
        ({"weight_sync_overlap": True, "verify_weight_sync": True}, "weight_sync_overlap must be False with verify"),
        ({"weight_sync_overlap": True, "async_mode": False}, "weight_sync_overlap must be False with async_mode"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    values = {"model_name_or_path": "student", **overrides}
    with pytest.raises(ConfigError, match=message):
        AsyncDistillationConfig(**values)


def test_config_defaults_follow_trl():
    config = AsyncDistillationConfig(model_name_or_path="student")
    assert config.teacher_server_urls == {"default": "http://localhost:8001"}
    assert (config.learning_rate, config.beta, config.teacher_top_k, config.max_staleness) == (1e-6, 0.0, 8, 4)
    assert (config.weight_sync_steps, config.max_completion_length) == (1, 2048)
    # TRL: 4 steps in flight plus a 1024-sample queue; ours: 3 steps' samples in flight and queued together
    assert config.resolved_max_lookahead(world_size=2) == config.resolved_max_inflight_tasks(world_size=2) == 3 * 16
    assert dataclasses.replace(config, max_lookahead_steps=2).resolved_max_lookahead(world_size=2) == 2 * 16
    assert dataclasses.replace(config, max_staleness=2).resolved_max_lookahead(world_size=2) == 2 * 16
    assert dataclasses.replace(config, max_staleness=0).resolved_max_lookahead(world_size=2) == 16
    assert dataclasses.replace(config, queue_maxsize=4).resolved_max_lookahead(world_size=2) == 3 * 16
    explicit = dataclasses.replace(config, max_inflight_tasks=7)  # TRL's meaning: 7 in flight, the queue aside
    assert explicit.resolved_max_inflight_tasks(world_size=2) == 7 and explicit.resolved_max_lookahead(2) is None
    assert config.resolved_queue_maxsize(world_size=2) == 16  # one step, not TRL's 1024 (see the docstring)
    assert config.resolved_max_steps(num_prompts=100, world_size=1) == 38  # ceil(3 × 100 / 8)


def test_config_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: student\nbeta: 0.5\nteacher_server_urls:\n  math: [http://a:1, http://b:2]\n")
    config = AsyncDistillationConfig.from_yaml(path, ["beta=0.25", "report_to=[tensorboard]", "min_p="])
    assert config.beta == 0.25 and config.report_to == ["tensorboard"] and config.min_p is None
    assert config.teacher_server_urls == {"math": ["http://a:1", "http://b:2"]}
    with pytest.raises(ConfigError, match="unknown config field 'bta'; did you mean 'beta'"):
        AsyncDistillationConfig.from_yaml(path, ["bta=0.1"])
    with pytest.raises(ConfigError, match="override 'beta' must look like key=value"):
        AsyncDistillationConfig.from_yaml(path, ["beta"])
    with pytest.raises(ConfigError, match="does not exist"):
        AsyncDistillationConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        AsyncDistillationConfig.from_yaml(tmp_path / "list.yaml")


def test_training_data_is_required(tmp_path, student_dir):
    with pytest.raises(ValueError, match="no training data"):
        AsyncDistillationTrainer(config(student_dir, tmp_path))


# ------------------------------------------------------------------------------------------------ metrics


def test_metric_reductions_follow_trl_except_for_teacher_ids():
    assert reduce_values("sample/dropped_stale_total", [1.0, 1.0, 1.0]) == 3.0
    assert reduce_values("sample/staleness_max", [1.0, 4.0, 2.0]) == 4.0
    assert reduce_values("completions/min_length", [5.0, 3.0]) == 3.0
    assert reduce_values("jsd", [1.0, 2.0, float("nan")]) == 1.5
    assert reduce_values("rollout/score_s", [(3.0, 2.0), (1.0, 2.0)]) == 1.0
    assert reduce_values("jsd", [float("nan")]) is None
    # TRL would sum teacher_jsd/total and take the max of teacher_jsd/max_math; these are means of teachers' jsd
    assert reduce_values("teacher_jsd/total", [1.0, 3.0]) == 2.0
    assert reduce_values("teacher_jsd/max_math", [1.0, 3.0]) == 2.0


def test_metrics_logger_writes_jsonl(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2, disable_progress=True)
    logger.update({"jsd": 1.0, "sample/dropped_stale_total": 1.0})
    logger.add("jsd", 3.0)
    assert logger.log(1)["jsd"] == 2.0
    logger.log(2, extra={"loss": 0.5})
    logger.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["sample/dropped_stale_total"] == 1.0 and records[1] == {**records[1], "loss": 0.5}


def test_an_unavailable_tracker_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match=r"report_to=\['wandb'\] needs the wandb package"):
        MetricsLogger(tmp_path, total_steps=1, report_to=["wandb"], disable_progress=True)


def test_synthetic_samples_have_the_worker_layout():
    tokenizer = build_tokenizer()
    teacher = build_model(tiny_config(len(tokenizer)), seed=0).eval()
    (sample,) = synthetic_samples(teacher, len(tokenizer), 1, top_k=3)
    completion = sample.completion_ids
    assert sample.teacher_topk_ids.shape == (len(completion), 4)
    logits = teacher(torch.tensor(sample.input_ids[None].astype("int64"))).logits[0].float()
    expected = torch.log_softmax(logits, -1)[sample.prompt_length - 1 : -1]
    for j, token in enumerate(completion):
        ids, lps = sample.teacher_topk_ids[j], sample.teacher_topk_logprobs[j]
        slot = list(ids).index(token)
        assert abs(lps[slot] - expected[j, token].item()) < 1e-5
        assert list(ids[:3]) == expected[j].topk(3).indices.tolist()


# ------------------------------------------------------------------------------------------------ staleness


def test_importance_policy_weights_stale_samples_by_the_clipped_ratio(tmp_path, student_dir, samples):
    """A sample 10 versions old whose rollout policy gave its tokens twice the student's probability gets half the
    gradient; a fresh one is untouched; a ratio above the clip is clipped."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    batch = samples[:4]
    common = dict(per_device_train_batch_size=4, max_grad_norm=0.0, max_steps=1, stale_policy="importance",
                  max_staleness=2)
    grads = {}
    for name, shift, version, clip in [("fresh", 0.0, 0, 2.0), ("half", -math.log(2.0), -10, 2.0),
                                       ("clipped", math.log(8.0), -10, 2.0)]:
        trainer = AsyncDistillationTrainer(config(student_dir, tmp_path / name, importance_ratio_clip=clip, **common),
                                           samples=with_rollout_logprobs(batch, model, shift, [version] * len(batch)))
        recorded = captured_gradients(trainer)
        trainer.train()
        grads[name] = recorded[0]
    for param, fresh in grads["fresh"].items():
        torch.testing.assert_close(grads["half"][param], 0.5 * fresh, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(grads["clipped"][param], 2.0 * fresh, rtol=1e-4, atol=1e-9)
    logged = read_jsonl(tmp_path / "half" / "metrics.jsonl")[0]
    assert abs(logged["sample/importance_ratio_mean"] - 0.5) < 1e-4
    assert read_jsonl(tmp_path / "clipped" / "metrics.jsonl")[0]["sample/importance_clip_frac"] == 1.0


# ------------------------------------------------------------------------------------------------ TRL parity


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_per_token_divergence_equals_trls_on_the_same_samples(tmp_path, student_dir, samples, beta):
    """One trainer step with tail_mode="trl": the logged jsd (overall and per teacher) equals TRL 1.16's own
    collator + shift + chunked loss on the same samples and weights. (Only the normalisation across
    gradient-accumulation micro-batches differs, deliberately: see test_gradient_accumulation_...)"""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_loss = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    from loss_cases import divergence_term_scale, fp32_divergence_slack
    from test_data_packing import _trl_collator_view
    from transformers import AutoModelForCausalLM

    batch = samples[:8]
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, per_device_train_batch_size=8, max_steps=1,
                                              tail_mode="trl", beta=beta), samples=batch)
    trainer.train()
    ours = read_jsonl(tmp_path / "metrics.jsonl")[0]

    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    (view,) = _trl_collator_view([batch], list(TEACHERS))
    with torch.no_grad():
        hidden = model.model(input_ids=view["input_ids"][None], position_ids=view["position_ids"][None],
                             use_cache=False).last_hidden_state[0]
        ids, lps = view["candidate_ids"][None], view["candidate_logprobs"][None]
        mask = ids != -1
        if beta > 0:
            ids, lps, mask = trl_loss._narrow_top1_actual_support(ids, lps, view["actual_ids"][None], mask, beta)
        scored = mask[0].any(dim=1)
        trl_args = (hidden[view["target_positions"]][scored], model.lm_head.weight, None, 1.0, None,
                    ids[0][scored].long(), lps[0][scored], mask[0][scored], beta, 1.0, True,
                    view["teacher_index"][scored], 2, 64)
        result = trl_loss._chunked_jsd_loss(*trl_args)
    # Both sides evaluate the divergence in fp32, in different reduction orders, as a sum of terms a·log a and
    # a·log b far larger than the result (~1e-4 nats at β=0.5): the absolute slack follows those terms' size
    # (fp32_divergence_slack), plus 1e-5 relative for the sums over the tokens.
    scale = divergence_term_scale(*trl_args)
    teacher_index = view["teacher_index"][scored]
    jsd_sum, per_teacher = float(result[1]), result[4].view(2, 3)
    theirs = jsd_sum / int(scored.sum())
    assert abs(ours["jsd"] - theirs) <= 1e-5 * abs(theirs) + fp32_divergence_slack(scale)
    for index, teacher_id in enumerate(TEACHERS):
        theirs = float(per_teacher[index, 1] / per_teacher[index, 0])
        slack = fp32_divergence_slack(scale[teacher_index == index])
        assert abs(ours[f"teacher_jsd/{teacher_id}"] - theirs) <= 1e-5 * abs(theirs) + slack


# ------------------------------------------------------------------------------------------------ reverse_kl_pg


def test_reverse_kl_pg_step_logs_the_sampled_reverse_kl(tmp_path, student_dir, samples):
    """loss_type="reverse_kl_pg": the logged reverse_kl is the mean over sampled tokens of log π_θ(y) − log π_T(y)
    (computed here from Hugging Face log-probs and the teacher's slot for y), overall and per teacher."""
    from transformers import AutoModelForCausalLM

    batch = samples[:6]
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, loss_type="reverse_kl_pg", max_steps=1,
                                              per_device_train_batch_size=6), samples=batch)
    trainer.train()
    logged = read_jsonl(tmp_path / "metrics.jsonl")[0]
    model = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    per_teacher: dict[str, list[float]] = {t: [] for t in TEACHERS}
    for sample in batch:
        with torch.no_grad():
            logits = model(torch.tensor(sample.input_ids[None].astype("int64")), use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)[sample.prompt_length - 1 : -1]
        for j, token in enumerate(sample.completion_ids.tolist()):
            slot = list(sample.teacher_topk_ids[j]).index(token)
            teacher_logprob = float(sample.teacher_topk_logprobs[j, slot])
            per_teacher[sample.teacher_id].append(float(logprobs[j, token]) - teacher_logprob)
    everything = [v for values in per_teacher.values() for v in values]
    assert logged["reverse_kl"] == pytest.approx(sum(everything) / len(everything), rel=1e-5)
    for teacher_id, values in per_teacher.items():
        assert logged[f"teacher_reverse_kl/{teacher_id}"] == pytest.approx(sum(values) / len(values), rel=1e-5)
    assert "jsd" not in logged and "pg/advantage_std" in logged


def test_pg_ratio_clip_needs_the_ratio():
    with pytest.raises(ConfigError, match="pg_ratio_clip must be None, or a number > 0 together with"):
        AsyncDistillationConfig(model_name_or_path="s", loss_type="reverse_kl_pg", pg_ratio_clip=2.0)


# MFU: tests/test_flops.py (the step's FLOPs counted by hand)


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_trains_adapters_only_and_exports_the_merged_model(tmp_path, student_dir, samples):
    """lora_r > 0: only adapter weights move; the weights sent to vLLM and the exported folder are peft's own merge."""
    import copy

    from transformers import AutoModelForCausalLM

    from fastdistill.sync.lora import merged_named_weights

    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, lora_r=4, lora_alpha=8.0, max_steps=3,
                                              per_device_train_batch_size=4, learning_rate=1e-2,
                                              gradient_checkpointing=True, export_final_model=True), samples=samples)
    before = {n: p.detach().clone() for n, p in trainer.hf_model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.hf_model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero, so a moved B means the adapters learned

    merged = dict(merged_named_weights(trainer.hf_model))
    reference = copy.deepcopy(trainer.hf_model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(exported[name], tensor)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="lora_r must be an int >= 0"):
        AsyncDistillationConfig(model_name_or_path="s", lora_r=-1)
    with pytest.raises(ConfigError, match="lora_target_modules must be"):
        AsyncDistillationConfig(model_name_or_path="s", lora_r=4, lora_target_modules=[1])


def test_oversize_samples_are_dropped_and_counted_once(tmp_path, student_dir, samples):
    """A sample longer than token_budget is dropped by the batcher and logged once in batch/dropped_oversize_total,
    also when the run ends on a flushed partial micro-batch; every other prompt is trained."""
    import dataclasses

    import numpy as np

    long = dataclasses.replace(samples[0], prompt_id=10, input_ids=np.concatenate([samples[0].input_ids] * 2),
                               completion_mask=np.concatenate([np.zeros_like(samples[0].completion_mask),
                                                               samples[0].completion_mask]))
    batch = [dataclasses.replace(s, prompt_id=i) for i, s in enumerate(samples[:10])] + [long]
    limit = max(len(s.input_ids) for s in samples[:10])
    assert len(long.input_ids) > limit
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, token_budget=limit, max_completion_length=2,
                                              max_steps=20), samples=batch)
    trainer.train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert sum(r.get("batch/dropped_oversize_total", 0.0) for r in records) == 1.0
    trained = [p for line in read_jsonl(tmp_path / "trained_prompts.jsonl") for p in line["prompt_ids"]]
    assert sorted(trained) == list(range(10))


# ------------------------------------------------------------------------------------------------ how a run ends


@pytest.mark.slow
@pytest.mark.parametrize("num_samples", [25, 1])
def test_two_ranks_with_fewer_final_samples_than_ranks(tmp_path, student_dir, num_samples):
    """2 ranks and a prompt count that leaves one sample for the final micro-batch: the rank without a sample runs a
    zero-weight ghost row, the run ends by itself and every prompt is trained exactly once."""
    values = {"teacher_server_urls": TEACHERS, "weight_sync_backend": "none", "learning_rate": 1e-3,
              "num_train_epochs": 1, "gradient_checkpointing": False, "disable_tqdm": True, "save_strategy": "no",
              "token_budget": 0, "per_device_train_batch_size": 2, "export_final_model": False}
    output = run_spec(tmp_path, f"ranks-{num_samples}", student_dir, 2, values, num_samples=num_samples)
    lines = read_jsonl(output / "trained_prompts.jsonl")
    assert sorted(p for line in lines for p in line["prompt_ids"]) == list(range(num_samples))
    steps = math.ceil(num_samples / 4)
    assert [r["step"] for r in read_jsonl(output / "metrics.jsonl")] == list(range(1, steps + 1))
    assert read_jsonl(output / "metrics.jsonl")[-1]["batch/samples_per_step"] == 1.0


def dropped_notice(prompt_id: int, reason: str = "rejected"):
    from fastdistill.rollout.dropped import DroppedPrompt

    return DroppedPrompt(prompt_id=prompt_id, dataset_index=prompt_id, reason=reason,
                         message=f"HTTP 400: prompt {prompt_id} refused", server="teacher a")


def test_dropped_prompts_count_as_done_are_listed_and_the_run_ends(tmp_path, student_dir, samples):
    """Prompts the rollout gave up on arrive as notices: the run ends after the last trainable prompt (it used to
    wait for them forever), trains every other prompt once and lists the dropped ones with the server's message."""
    stream = [dropped_notice(s.prompt_id) if s.prompt_id in (3, 11, 23) else s for s in samples]
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, per_device_train_batch_size=4), samples=stream)
    summary = trainer.train()
    trained = [p for line in read_jsonl(tmp_path / "trained_prompts.jsonl") for p in line["prompt_ids"]]
    assert sorted(trained) == sorted(set(range(24)) - {3, 11, 23})
    listed = read_jsonl(tmp_path / "dropped_prompts.jsonl")
    assert [(d["prompt_id"], d["reason"], d["server"], d["message"]) for d in listed] == [
        (p, "rejected", "teacher a", f"HTTP 400: prompt {p} refused") for p in (3, 11, 23)]
    assert summary["dropped_prompts_total"] == 3 and summary["steps"] == 6
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert sum(r["sample/dropped_prompts_total"] for r in records) == 3.0
    assert sum(r.get("sample/dropped_prompts_rejected_total", 0.0) for r in records) == 3.0


def test_logging_steps_reduce_every_steps_values(tmp_path, student_dir, samples):
    """With logging_steps=4 the counters of the steps in between are summed into the logged line (they used to be
    lost), averages cover every step, and the final step is logged although it is not a logging step."""
    stream = [dropped_notice(s.prompt_id) if s.prompt_id in (1, 6) else s for s in samples[:16]]
    every = AsyncDistillationTrainer(config(student_dir, tmp_path / "every", per_device_train_batch_size=2),
                                     samples=stream)
    every.train()
    sparse = AsyncDistillationTrainer(config(student_dir, tmp_path / "sparse", per_device_train_batch_size=2,
                                             logging_steps=4), samples=stream)
    sparse.train()
    each = read_jsonl(tmp_path / "every" / "metrics.jsonl")
    grouped = read_jsonl(tmp_path / "sparse" / "metrics.jsonl")
    assert [r["step"] for r in each] == list(range(1, 8)) and [r["step"] for r in grouped] == [4, 7]
    assert sum(r["sample/dropped_prompts_total"] for r in grouped) == 2.0
    for record, steps in zip(grouped, (each[:4], each[4:]), strict=True):
        mean = sum(r["batch/trained_tokens_per_step"] for r in steps) / len(steps)
        assert record["batch/trained_tokens_per_step"] == pytest.approx(mean, rel=1e-12)
        assert record["learning_rate"] == steps[-1]["learning_rate"]  # a gauge keeps its last value


def test_a_token_budget_run_trains_every_prompt_and_ends_its_schedule(tmp_path, student_dir, samples):
    """Under a token budget a step holds as many samples as fit, not per_device_train_batch_size: the step count
    estimated from the batch size is wrong, the run still trains every prompt once and the linear decay ends on the
    run's last step (lr × 1/T at step T)."""
    budget = 2 * max(len(s.input_ids) for s in samples)
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, token_budget=budget, max_completion_length=2,
                                              per_device_train_batch_size=8, learning_rate=1e-3), samples=samples)
    assert trainer.max_steps == 3  # the initial estimate: 24 prompts / 8 per step
    summary = trainer.train()
    trained = [p for line in read_jsonl(tmp_path / "trained_prompts.jsonl") for p in line["prompt_ids"]]
    assert sorted(trained) == list(range(24))
    records = read_jsonl(tmp_path / "metrics.jsonl")
    steps = summary["steps"]
    assert steps > 3 and [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["learning_rate"] == pytest.approx(1e-3 / steps, rel=1e-12)
    rates = [r["learning_rate"] for r in records]
    assert rates == sorted(rates, reverse=True)
    assert trainer.scheduler.total_steps == steps


def test_stopping_the_pipeline_runs_every_part_when_one_fails(tmp_path, student_dir, samples):
    """A worker whose stop() raises does not leak the weight-sync group: close() still runs, then the error
    propagates."""
    calls = []

    class Worker:
        def stop(self):
            calls.append("worker")
            raise RuntimeError("worker would not stop")

    class Sync:
        def close(self):
            calls.append("sync")

    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path), samples=samples)
    trainer.worker, trainer.weight_sync = Worker(), Sync()
    with pytest.raises(RuntimeError, match="worker would not stop"):
        trainer._stop_pipeline()
    assert calls == ["worker", "sync"] and trainer.worker is None


def test_prompts_too_long_for_a_server_are_refused_or_skipped_up_front(tmp_path, student_dir):
    """prompt + max_completion_length must fit the student's max_model_len, and + 1 (the scoring request asks for a
    token) its teacher's: otherwise a ConfigError that says how many and what to change, or with skip_long_prompts
    the rows are never dispatched and each of their prompts in the run is listed once as too_long."""
    from fastdistill.rollout import ServedModel, row_of_prompt

    rows = [{"prompt_ids": [5] * length, "teacher_id": teacher}
            for length, teacher in [(10, "a"), (30, "a"), (10, "b"), (25, "b"), (12, "a")]]
    served = {"student": ServedModel("s", 40), "a": ServedModel("ta", 64), "b": ServedModel("tb", 34)}

    runs = iter(range(100))

    def trainer(**overrides):
        values = {"max_completion_length": 8, "num_train_epochs": 2, **overrides}
        return AsyncDistillationTrainer(config(student_dir, tmp_path / str(next(runs)), **values), train_dataset=rows)

    # at 11 completion tokens: row 1 needs 30 + 11 = 41 > 40 (student), row 3 needs 25 + 11 + 1 = 37 > 34 (teacher b)
    with pytest.raises(ConfigError, match=r"^2 of 5 prompts do not fit the servers: the longest has 30 tokens \(row "
                       r"1\); with max_completion_length=11 it needs 41 tokens, but the student server serves "
                       r"max_model_len=40\. Lower max_completion_length, raise the servers' --max-model-len, or set "
                       r"skip_long_prompts=True"):
        trainer(max_completion_length=11)._skip_long_prompts(served)
    skipping = trainer(skip_long_prompts=True, max_completion_length=11)
    skip = skipping._skip_long_prompts(served)
    assert skip == {1, 3}
    lines = read_jsonl(skipping.output_dir / "dropped_prompts.jsonl")
    assert len(lines) == 4  # two rows, two epochs
    for line in lines:
        assert line["reason"] == "too_long" and line["step"] == 0
        assert row_of_prompt(line["prompt_id"], 5, 42) == line["dataset_index"]
        assert skipping.rollout_state.is_trained(line["prompt_id"])
    assert {line["server"] for line in lines} == {"student", "teacher b"}
    assert trainer(max_completion_length=8)._skip_long_prompts(served) == frozenset()
    with pytest.raises(ConfigError, match="No prompt can be trained: lower max_completion_length"):
        trainer(skip_long_prompts=True, max_completion_length=40)._skip_long_prompts(served)


def test_lr_schedule_shapes_and_its_state():
    from fastdistill.train.schedule import LRSchedule

    def rates(kind, total, warmup=0):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        schedule = LRSchedule(optimizer, kind, total, warmup)
        return [schedule.apply(step) for step in range(total)], schedule

    linear, schedule = rates("linear", 4)
    assert linear == [2.0, 1.5, 1.0, 0.5]
    assert rates("linear", 4, warmup=1)[0] == pytest.approx([1.0, 2.0, 4 / 3, 2 / 3], rel=1e-15)
    assert rates("cosine", 3)[0] == pytest.approx([2.0, 1.5, 0.5], abs=1e-15)  # (1 + cos(π·step/3)) / 2
    assert rates("constant", 3, warmup=2)[0] == [2.0, 2.0, 2.0]  # constant has no warmup
    assert rates("constant_with_warmup", 3, warmup=1)[0] == [1.0, 2.0, 2.0]
    schedule.total_steps = 8  # corrected while the run goes: the decay stretches
    assert schedule.apply(3) == 2.0 * 5 / 8
    restored = rates("linear", 2)[1]
    restored.load_state_dict(schedule.state_dict())
    assert restored.total_steps == 8 and restored.apply(3) == 2.0 * 5 / 8
    restored.load_state_dict({"base_lrs": [4.0], "last_epoch": 3})  # a LambdaLR state from an older checkpoint
    assert restored.total_steps == 8 and restored.apply(0) == 4.0
    with pytest.raises(ValueError, match="lr schedule kind must be one of"):
        LRSchedule(schedule.optimizer, "poly", 3)
