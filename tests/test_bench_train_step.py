"""benchmarks/bench_train_step.py on the CPU with tiny shapes: its teacher cache, its floor, its packed-attention
check, its guards, the trainer's attention-pair count it reads, and the whole run end to end (one rank in a gloo
group, the student FSDP2-sharded, as the GPU check runs it over NCCL).
No timing is asserted: times are measured, never checked here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _module(name: str):
    """A benchmarks/ module, imported as the scripts import each other (their folder on sys.path)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def parts():
    return _module("train_step_parts")


@pytest.fixture(scope="module")
def bench():
    return _module("bench_train_step")


@pytest.fixture(scope="module")
def tokenizer():
    from fastdistill.tiny import build_tokenizer

    return build_tokenizer()


def test_the_synthetic_cache_reads_back_as_the_teacher_scored_it(parts, tokenizer, tmp_path):
    from fastdistill.cache import TeacherCache

    workload = parts.WORKLOADS["tiny"]
    folder = parts.write_teacher_cache(tmp_path / "cache", tokenizer, 1024, 8, rows=12, workload=workload, seed=3)
    teacher = parts.SyntheticTeacher(1024, workload.used_vocab, 8, seed=3)  # the same teacher, rebuilt
    cache = TeacherCache(folder)
    assert len(cache) == 12
    for sample in cache:
        prompt_length = int((sample.completion_mask == 0).sum())
        tokens = sample.input_ids.astype(np.int64)
        completion = tokens[prompt_length:]
        assert workload.prompt[0] <= prompt_length <= workload.prompt[1]
        assert workload.completion[0] <= len(completion) <= workload.completion[1]
        top = teacher.candidates(tokens[prompt_length - 1 : -1])
        np.testing.assert_array_equal(sample.teacher_topk_ids[:, :8], top)
        outside = ~(top == completion[:, None]).any(axis=1)
        np.testing.assert_array_equal(sample.teacher_topk_ids[:, 8], np.where(outside, completion, -1))
        expected = np.concatenate([np.broadcast_to(teacher.top_logprobs, top.shape),
                                   np.where(outside, teacher.tail_logprob, -np.inf)[:, None]], axis=1)
        np.testing.assert_allclose(sample.teacher_topk_logprobs, expected, rtol=2**-10)  # stored as float16
        assert np.isin(tokens, teacher.used).all()


def test_the_floor_is_plain_cross_entropy_on_the_trained_positions(parts, tokenizer, tmp_path):
    """The floor step's loss equals a float64 cross-entropy of each sample run alone through the Hugging Face
    model (an independent oracle), and the optimizer moves the weights."""
    from fastdistill.cache import TeacherCache
    from fastdistill.data.packing import pack_row

    folder = parts.write_teacher_cache(tmp_path / "cache", tokenizer, 1024, 8, rows=3, workload=parts.WORKLOADS["tiny"])
    samples = list(TeacherCache(folder))
    model = parts.build_model("tiny", torch.device("cpu"), "sdpa")
    oracle = parts.build_model("tiny", torch.device("cpu"), "sdpa").double().eval()  # same seed: same weights
    terms = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
            logprobs = torch.log_softmax(oracle(ids).logits[0], -1)
            start = int((sample.completion_mask == 0).sum())
            terms += [-float(logprobs[t - 1, int(ids[0, t])]) for t in range(start, ids.shape[1])]
    row = pack_row(samples, ["default"], vocab_size=1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    timer = parts.PhaseTimer(torch.device("cpu"))
    floor = parts.CrossEntropyModel(model)
    timer.attach(floor, model.model, model.get_input_embeddings(), optimizer)
    _, loss = parts.cross_entropy_step(floor, optimizer, [row], autocast=False, max_grad_norm=1.0,
                                       device=torch.device("cpu"))
    timer.detach()
    assert loss == pytest.approx(sum(terms) / len(terms), rel=1e-5)  # float32 against float64
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    (step,) = timer.steps
    assert {name: len(marks) for name, marks in step.items()} == {
        "start": 1, "backbone": 1, "loss": 1, "dh": 1, "embed": 1, "opt0": 1, "opt1": 1}


def test_the_floor_sharded_over_one_rank_steps_like_the_plain_floor(parts, tokenizer, tmp_path):
    """The floor's model FSDP2-sharded over a gloo group of one rank (as the trainer's is in the check) gives the
    plain model's loss and weights after two steps, to float32 rounding (the same arithmetic, one rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fastdistill.cache import TeacherCache
    from fastdistill.data.packing import pack_row
    from fastdistill.train.model import shard_student

    folder = parts.write_teacher_cache(tmp_path / "cache", tokenizer, 1024, 8, rows=4, workload=parts.WORKLOADS["tiny"])
    rows = [pack_row(pair, ["default"], vocab_size=1024) for pair in np.array_split(list(TeacherCache(folder)), 2)]

    def two_steps(shard: bool) -> tuple[list[float], list[torch.Tensor]]:
        hf_model = parts.build_model("tiny", torch.device("cpu"), "sdpa")
        model = parts.CrossEntropyModel(hf_model)
        if shard:
            shard_student(model, hf_model, bf16=False)
            assert all(isinstance(p, DTensor) for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = [parts.cross_entropy_step(model, optimizer, [row], autocast=False, max_grad_norm=1.0,
                                           device=torch.device("cpu"))[1] for row in rows]
        return losses, [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]

    plain_losses, plain_weights = two_steps(shard=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded_losses, sharded_weights = two_steps(shard=True)
    finally:
        dist.destroy_process_group()
    assert sharded_losses == pytest.approx(plain_losses, rel=1e-5)
    for got, expected in zip(sharded_weights, plain_weights, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_packed_attention_check_catches_samples_that_see_each_other(parts):
    model = parts.build_model("tiny", torch.device("cpu"), "sdpa")
    lengths = [7, 1, 12, 5]
    good = parts.packed_attention_check(model, lengths, torch.device("cpu"), "sdpa")
    assert good["status"] == "ok" and good["max_abs_error_packed_bf16"] <= good["tolerance"], good
    leaked = parts.packed_attention_check(model, lengths, torch.device("cpu"), "sdpa", restart_positions=False)
    assert leaked["status"] == "failed" and leaked["max_abs_error_packed_bf16"] > leaked["tolerance"], leaked
    assert model.training and model.config._attn_implementation == "sdpa"  # left as it was found


def test_the_trainer_counts_every_packed_sample_s_causal_pairs(parts, tokenizer, tmp_path):
    """Over a whole epoch the trainer's logged attention pairs and forwarded tokens add up to those of every cached
    sample, each attending to itself only: Σ L·(L+1)/2 and Σ L."""
    from fastdistill.cache import TeacherCache
    from fastdistill.train import AsyncDistillationTrainer
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.flops import ATTENTION_PAIRS, causal_pairs

    folder = parts.write_teacher_cache(tmp_path / "cache", tokenizer, 1024, 8, rows=6, workload=parts.WORKLOADS["tiny"])
    lengths = [len(s.input_ids) for s in TeacherCache(folder)]
    config = AsyncDistillationConfig(
        model_name_or_path="in-process/tiny", output_dir=str(tmp_path / "out"), teacher_cache=str(folder),
        teacher_server_urls={"default": "http://127.0.0.1:9"}, vllm_server_base_url="http://127.0.0.1:9",
        per_device_train_batch_size=2, token_budget=0, max_completion_length=48, num_train_epochs=1,
        gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", export_final_model=False)
    logged = []
    AsyncDistillationTrainer(config, model=parts.build_model("tiny", torch.device("cpu"), "sdpa"),
                             tokenizer=tokenizer, on_step_end=lambda step, m: logged.append(m)).train()
    assert len(logged) == 3
    assert sum(m[ATTENTION_PAIRS] for m in logged) == causal_pairs(lengths)
    assert sum(m["batch/forwarded_tokens_per_step"] for m in logged) == sum(lengths)


def _result(cuda: bool, peak: float, mfu: float, device: str = "NVIDIA H200") -> dict:
    run = {"status": "ok", "peak_gib": peak, "mfu_measured_pct": mfu}
    return {"date": "2026-12-04T00:00:00+00:00", "machine": {"device": device, "cuda": cuda, "commit": "abc"},
            "shapes": [{"shape": "qwen2.5-0.5b", "runs": {"K=8 auto": run}}]}


def test_the_guards_compare_with_the_last_recorded_gpu_run(bench, tmp_path):
    baseline = tmp_path / "baseline.json"
    assert bench.guard(_result(False, 1.0, 1.0), baseline)["detail"].startswith("not a GPU run")
    first = bench.guard(_result(True, 10.0, 40.0), baseline)
    assert first["ok"] and "no recorded GPU run for NVIDIA H200 yet" in first["detail"]
    bench.record_baseline(_result(True, 10.0, 40.0), baseline)
    assert json.loads(baseline.read_text())["devices"]["NVIDIA H200"]["runs"]["qwen2.5-0.5b K=8 auto"] == {
        "peak_gib": 10.0, "mfu_measured_pct": 40.0}
    within = bench.guard(_result(True, 10.0 * bench.PEAK_MEMORY_BOUND, 40.0 * bench.MFU_BOUND), baseline)
    assert within["ok"] and within["violations"] == []
    memory = bench.guard(_result(True, 10.0 * bench.PEAK_MEMORY_BOUND * 1.01, 40.0), baseline)
    assert not memory["ok"] and "peak" in memory["violations"][0]
    mfu = bench.guard(_result(True, 10.0, 40.0 * bench.MFU_BOUND * 0.99), baseline)
    assert not mfu["ok"] and "MFU" in mfu["violations"][0]
    other = bench.guard(_result(True, 99.0, 1.0, device="NVIDIA A100"), baseline)  # another device: no record
    assert other["ok"] and "no recorded GPU run for NVIDIA A100" in other["detail"]


def test_the_tiny_run_end_to_end(bench, tmp_path):
    out = tmp_path / "train_step.json"
    rc = bench.main(["--tiny", "--top-ks", "8", "--backends", "auto", "torch", "--loss-steps", "6", "--json",
                     str(out), "--baseline", str(tmp_path / "none.json")])
    result = json.loads(out.read_text())
    assert rc == 0 and result["correct"] and result["guard"]["ok"], result["table"]
    assert result["machine"]["process_group"] == "gloo"  # one rank, the student FSDP2-sharded: the GPU check's path
    (shape,) = result["shapes"]
    assert shape["attention"] == "sdpa" and set(shape["runs"]) == {"K=8 auto", "K=8 torch"}
    for run in shape["runs"].values():
        assert run["status"] == "ok" and run["mfu_datasheet_pct"] is None  # a CPU has no datasheet rate here
        rate = result["machine"]["rates_tflops"]["measured"] * 1e12  # float32 torch.mm measured in the same run
        assert run["mfu_measured_pct"] == pytest.approx(100 * run["step_tflop"] * 1e12 / run["step_s"] / rate)
        assert set(run["split_s"]) == {"backbone_fwd", "loss", "backbone_bwd", "optimizer", "rest"}
        assert run["step_tflop"] * 1e12 == pytest.approx(sum(run["tflop_split"].values()) * 1e12)
    losses = shape["checks"]["loss_decreases"]
    assert losses["status"] == "ok" and losses["steps"] == 6 and losses["last3_mean"] < losses["first"]
    assert shape["checks"]["packed_attention"]["status"] == "ok"
    assert shape["checks"]["packed_flash_attention_2"] == {"status": "skipped", "detail": "no CUDA device"}
    assert shape["floor"]["steps_measured"] == bench.MEASURED_STEPS
    assert shape["loss_inputs"]["rows"] == int(shape["runs"]["K=8 auto"]["trained_tokens_per_step"])
    assert shape["loss_inputs"]["float32_ms"] > 0 and shape["loss_inputs"]["bfloat16_ms"] > 0
    assert "| tiny | 8 | auto |" in result["table"] and "| tiny | – | CE floor |" in result["table"]
    for run in [*shape["runs"].values(), shape["floor"]]:
        low, high = run["step_s_range"]
        assert low <= run["step_s"] <= high and run["predicted_ms"] is None  # no H200 prediction of the tiny shape


def test_the_prediction_covers_both_shapes_and_every_phase(bench):
    predict = _module("train_step_predict")
    row = predict.typical_row()
    assert 0 < row["trained"] < row["forwarded"] <= parts_budget()
    for shape in predict.TOP_K_SHAPES:
        phases = predict.predict(shape, row)
        assert {"backbone_fwd", "backbone_bwd", "optimizer"} <= set(phases)
        assert phases["backbone_bwd"]["tflop"] == pytest.approx(2 * phases["backbone_fwd"]["tflop"])
    assert "qwen2.5-1.5b | step with loss: triton (fused) |" in predict.prediction_table()


def test_the_prediction_beside_a_measured_step_is_the_table_s(bench):
    """The predicted step time printed beside a GPU run's row is the prediction table's for the same tokens: the
    phases plus the design's loss (the CE floor's loss for the floor), summed; the tiny shape has none."""
    predict = _module("train_step_predict")
    row = predict.typical_row()
    phases = predict.predict("qwen2.5-1.5b", row)
    common = sum(p["ms"] for name, p in phases.items() if not name.startswith("loss"))
    summary = {"forwarded_tokens_per_step": row["forwarded"], "trained_tokens_per_step": row["trained"],
               "attention_pairs_per_step": row["pairs"]}
    assert bench.predicted_ms("qwen2.5-1.5b", "torch", summary) == pytest.approx(
        common + phases[predict.LOSS_TORCH]["ms"])
    assert bench.predicted_ms("qwen2.5-1.5b", "triton-chunked", summary) == pytest.approx(
        common + phases[predict.LOSS_CHUNKED]["ms"])
    assert bench.predicted_ms("qwen2.5-1.5b", "ce", summary) == pytest.approx(
        common + predict.ce_loss_ms("qwen2.5-1.5b", row["trained"]))
    assert bench.predicted_ms("tiny", "auto", summary) is None
    calibrated = predict.predict("qwen2.5-1.5b", row)  # and calibrated, as the table prints beside it
    assert bench.predicted_ms("qwen2.5-1.5b", "torch", summary, calibrated=True) == pytest.approx(
        sum(p["ms_calibrated"] for name, p in calibrated.items() if not name.startswith("loss"))
        + calibrated[predict.LOSS_TORCH]["ms_calibrated"])


def parts_budget() -> int:
    return _module("train_step_parts").WORKLOADS["gpu"].token_budget
