"""Test helpers around real vLLM servers: skip or fail when vLLM is missing, start several servers at once.

The launcher itself is production code and lives in :mod:`fastdistill.serve` (``VLLMServer``, ``free_port``,
``vllm_python``): import it from there.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdistill.serve import VLLMServer, vllm_python


def vllm_available(python: str | None = None) -> bool:
    """Whether ``python`` (default: :func:`vllm_python`) can import vLLM, checked without importing it here."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = subprocess.run([python or vllm_python(), "-c", check], check=False)
    return probe.returncode == 0


def require_vllm() -> None:
    """In a pytest test or fixture: skip when vLLM is missing, or fail when ``$FASTDISTILL_REQUIRE_VLLM=1`` (what
    ``make test`` sets, so CI runs the real-server tests instead of skipping them)."""
    import pytest

    if vllm_available():
        return
    message = f"vLLM is not installed for {vllm_python()} (set FASTDISTILL_VLLM_PYTHON)"
    if os.environ.get("FASTDISTILL_REQUIRE_VLLM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def start_together(*servers: VLLMServer) -> None:
    """Start several servers side by side (start-up is mostly waiting); if any fails, stop them all and raise.

    Each is launched from the calling thread (the kernel stops a server when the thread that launched it ends), then
    all are waited for together."""
    errors: list[BaseException | None] = []
    for server in servers:
        try:
            server.launch()
            errors.append(None)
        except BaseException as error:  # the others are stopped below
            errors.append(error)
    for index, server in enumerate(servers):
        if errors[index] is None:
            try:
                server.wait_started()
            except BaseException as error:
                errors[index] = error
    failed = [error for error in errors if error is not None]
    if failed:
        for server in servers:
            server.stop()
        raise failed[0]


@contextlib.contextmanager
def running(*servers: VLLMServer) -> Iterator[tuple[VLLMServer, ...]]:
    """Start ``servers`` side by side (:func:`start_together`), yield them, stop them all on exit."""
    start_together(*servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def student_and_teacher(student_dir: Any, teacher_dir: Any, logs: Path) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """A student server (fastdistill's ``gloo`` weight transfer) and a teacher server, started side by side and
    stopped on exit; their logs go to ``logs/student.log`` and ``logs/teacher.log`` (the folder is created)."""
    logs.mkdir(parents=True, exist_ok=True)
    student = VLLMServer(student_dir, role="student", weight_transfer_backend="gloo", log_path=logs / "student.log")
    teacher = VLLMServer(teacher_dir, role="teacher", log_path=logs / "teacher.log")
    with running(student, teacher):
        yield student, teacher


# The shared pair's teacher has its lm_head scaled up: a peaked teacher far from the near-uniform student (what a
# distillation run needs to show progress), whose log-probs still stay within a few float32 ulps of HF's.
TEACHER_SHARPNESS = 4.0
# The shared teacher prefills at most 32 tokens per engine step, in KV blocks of 32 tokens: longer sequences are
# prefilled in chunks and several requests share a batch (vLLM-CPU's default block of 128 would keep short test
# sequences out of the prefix cache).
SCORING_CHUNK_TOKENS = 32
TEACHER_SCORING_ARGS = ("--max-num-batched-tokens", str(SCORING_CHUNK_TOKENS), "--enable-chunked-prefill",
                        "--block-size", str(SCORING_CHUNK_TOKENS))


@dataclass
class TinyServers:
    """A tiny student/teacher pair of real vLLM servers that many tests share (``tests/conftest.py``'s session
    fixture ``tiny_servers``): one tokenizer, one tiny Qwen3 architecture, the folders they serve and their fp32
    Hugging Face models (the tests' oracles).

    ``student`` is a student-role server with gloo weight transfer, ``--max-logprobs V`` (its replies may hold μ
    over the whole vocabulary) and the generate route (the student role's ``--enable-scale-out``), which
    ``staleness_unit: token`` takes; it serves ``student_dir`` (seed 1) until someone pushes other weights: a trainer's
    cold sync does, and a test that needs known weights calls :meth:`serve_student_weights` first. ``teacher`` is a
    teacher-role server (with fastdistill's scoring plugin, which the vLLM entry point installs in every server)
    serving ``teacher_dir`` (seed 2, lm_head × :data:`TEACHER_SHARPNESS`), prefilling in chunks
    (:data:`TEACHER_SCORING_ARGS`). Its weights never change."""

    tokenizer: Any
    vocab_size: int
    student_dir: Path
    teacher_dir: Path
    student_model: Any
    teacher_model: Any
    student: VLLMServer
    teacher: VLLMServer
    pushes: int = 0

    def serve_student_weights(self, model: Any, *, tolerance: float = 1e-4) -> None:
        """Push ``model``'s weights (same architecture) to the student server and check that it serves them: the
        served log-probs of a probe prompt within ``tolerance`` nats of ``model``'s. The push pauses the server,
        which clears its prefix cache (no KV of earlier weights is reused)."""
        from fastdistill.sync import VLLMWeightSync, served_logprob_gap

        self.pushes += 1
        with VLLMWeightSync(self.student.url, timeout_s=120) as sync:
            sync.push(model, 1000 + self.pushes)
        gap = served_logprob_gap(self.student.url, model, [[1, 5, 9, 30, 7, 100, 3, 44]])
        assert gap <= tolerance, f"the student server does not serve the pushed weights: gap {gap}"


@contextlib.contextmanager
def tiny_servers(root: Path) -> Iterator[TinyServers]:
    """Build the tiny student and teacher folders under ``root``, start both servers side by side (logs in
    ``root/logs``), yield :class:`TinyServers`, stop both on exit."""
    import torch

    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    student_model = build_model(config, seed=1).float().eval()
    teacher_model = build_model(config, seed=2).float().eval()
    with torch.no_grad():
        teacher_model.lm_head.weight.mul_(TEACHER_SHARPNESS)
    student_dir = save_pretrained_dir(student_model, tokenizer, root / "student")
    teacher_dir = save_pretrained_dir(teacher_model, tokenizer, root / "teacher")
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    student = VLLMServer(student_dir, role="student", weight_transfer_backend="gloo",
                         extra_args=["--max-logprobs", str(config.vocab_size)], log_path=logs / "student.log")
    teacher = VLLMServer(teacher_dir, role="teacher", extra_args=list(TEACHER_SCORING_ARGS),
                         log_path=logs / "teacher.log")
    with running(student, teacher):
        yield TinyServers(tokenizer, config.vocab_size, Path(student_dir), Path(teacher_dir), student_model,
                          teacher_model, student, teacher)
