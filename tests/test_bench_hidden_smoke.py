"""Smoke test of benchmarks/bench_hidden_teacher.py: the smallest settings run and write every JSON field.

Timings and the divergences' ranking are never asserted (the machine may be busy, and a few steps decide nothing);
only that every measurement exists and is finite.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hidden_teacher.py"


def run_bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--teacher-steps", "2", "--epochs", "1", "--top-ks", "1", "2",
           "--work-dir", str(tmp_path / "work"), "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}  # this checkout's fastdistill
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def check_runs(result: dict, seeds: list[int]) -> None:
    names = ["hidden", "topk-1", "topk-2"]
    assert sorted((r["name"], r["run_seed"]) for r in result["runs"]) == sorted((n, s) for n in names for s in seeds)
    for run in result["runs"]:
        assert run["epochs"] == 1 and run["steps"] >= 1 and run["trained_tokens"] > 0
        for key in ("trained_tokens_per_s", "trained_tokens_per_s_median_step", "held_out_forward_kl",
                    "held_out_jsd"):
            assert math.isfinite(run[key]) and run[key] > 0, (run["name"], key, run[key])
        assert run["held_out_tokens"] == result["held_out_tokens"] > 0
    assert set(result["before_training"]) == {str(s) for s in seeds}
    assert set(result["summary"]) == {"before_training"} | {f"{n}@1ep" for n in names}
    for name in names:
        kl = result["summary"][f"{name}@1ep"]["held_out_forward_kl"]
        assert kl["min"] <= kl["mean"] <= kl["max"]
    teacher = result["teacher"]
    assert 0 < teacher["teacher_entropy"] and set(teacher["teacher_top_k_mass"]) == {"1", "2"}
    assert 0 < teacher["teacher_top_k_mass"]["1"] <= teacher["teacher_top_k_mass"]["2"] <= 1


@pytest.mark.slow
def test_bench_hidden_zipf_smallest(tmp_path):
    result, stdout = run_bench(tmp_path, "--train-prompts", "16", "--held-out", "4", "--run-seeds", "3")
    assert result["task"] == "zipf" and result["train_prompts"] == 16 and result["held_out_prompts"] == 4
    check_runs(result, [3])
    teacher = result["teacher"]
    assert math.isfinite(teacher["language_entropy"]) and teacher["kl_language_teacher"] >= 0
    assert "topk-2@1ep" in stdout and "language entropy" in stdout


@pytest.mark.slow
def test_bench_hidden_demo_smallest(tmp_path):
    result, _ = run_bench(tmp_path, "--task", "demo")
    assert result["task"] == "demo"
    check_runs(result, [0])
    assert "language_entropy" not in result["teacher"]


def test_zipf_language_is_the_stated_distribution():
    """Every next-token distribution sums to one, eos comes only inside the length range (and always at its end),
    and the word distribution is the topic's Zipf law over its 64 words."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_hidden_teacher import ZipfLanguage
    finally:
        sys.path.remove(str(SCRIPT.parent))
    language = ZipfLanguage(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(20):
        prompt = language.sample_prompt(rng)
        assert 4 <= len(prompt) <= 7 and prompt[0] == 1
        completion = language.sample_completion(prompt, rng)
        assert completion[-1] == language.eos and language.eos not in completion[:-1]
        assert language.min_length <= len(completion) - 1 <= language.max_length
        for j in range(len(completion)):
            probs = language.next_token_probs(prompt, completion[:j])
            assert abs(probs.sum() - 1.0) < 1e-12
            assert (probs[language.eos] == 0.0) == (j < language.min_length)
    prompt = language.sample_prompt(rng)
    words = language.next_token_probs(prompt, [language.first_word] * 3)  # j < min_length: no eos
    ranked = np.sort(words[words > 0])[::-1]
    exponent = language.exponents[prompt[1] - language.first_topic]
    expected = (np.arange(1, 65, dtype=np.float64)) ** -exponent
    np.testing.assert_allclose(ranked, expected / expected.sum(), rtol=1e-12)
