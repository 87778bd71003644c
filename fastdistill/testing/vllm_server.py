"""Test helpers around real vLLM servers: skip or fail when vLLM is missing, start several servers at once.

The launcher itself is production code and lives in :mod:`fastdistill.serve`; its names are re-exported here for
the tests that import them from this module.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastdistill.serve import VLLMServer, VLLMServerError, free_port, vllm_python

__all__ = ["VLLMServer", "VLLMServerError", "free_port", "require_vllm", "running", "start_together",
           "student_and_teacher", "vllm_available", "vllm_python"]


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
