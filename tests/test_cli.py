"""The ``fastdistill`` command line: server commands, config errors, the console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdistill.cli import main


def test_serve_teacher_dry_run_prints_the_teacher_flags(capsys):
    argv = ["serve-teacher", "some/model", "--port", "9001", "--no-api-key", "--dry-run", "--", "--seed", "3"]
    assert main(argv) == 0
    command = capsys.readouterr().err
    assert "vllm.entrypoints.openai.api_server" in command and "--model some/model" in command
    assert "--max-logprobs -1" in command and "--logprobs-mode processed_logprobs" in command
    assert "--port 9001" in command and command.rstrip().endswith("--seed 3")


def test_serve_student_dry_run_enables_weight_transfer(capsys):
    assert main(["serve-student", "some/model", "--weight-transfer", "gloo", "--dry-run"]) == 0
    command = capsys.readouterr().err
    assert "--weight-transfer-config" in command and '"gloo"' in command
    assert "--worker-extension-cls fastdistill.sync.vllm_engine.WorkerExtension" in command  # one-call syncs
    assert main(["serve-student", "some/model", "--weight-transfer", "none", "--dry-run"]) == 0
    assert "--weight-transfer-config" not in capsys.readouterr().err


def test_serve_pins_the_server_to_cores(capsys):
    core = sorted(os.sched_getaffinity(0))[0]
    assert main(["serve-teacher", "some/model", "--cpus", str(core), "--no-api-key", "--dry-run"]) == 0
    assert capsys.readouterr().err.startswith(f"fastdistill: taskset -c {core} ")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-teacher", "some/model", "--cpus", "zero", "--dry-run"])
    assert exit_info.value.code == 2 and "expected core ids like 0,2-3, got 'zero'" in capsys.readouterr().err
    assert main(["serve-teacher", "some/model", "--cpus", "4000-4001", "--dry-run"]) == 2
    assert "cpus must be a non-empty subset of the cores this process may use" in capsys.readouterr().err


def test_train_config_errors_are_reported_without_a_traceback(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model_name_or_path: student\nbeta: 2.0\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(config)])
    assert exit_info.value.code == 2
    assert "config error: beta must be in [0.0, 1.0], got 2.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--config", str(config), "beta=0.5", "weight_sync_steps=0"])
    assert "weight_sync_steps must be an int >= 1, got 0" in capsys.readouterr().err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "fastdistill"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "serve-teacher" in result.stdout and "demo" in result.stdout


def test_launch_help_and_the_launcher_start_without_torch():
    """``fastdistill launch --help`` from the console script; the launcher (what it imports to run a cluster config)
    leaves torch out: it only starts processes on other hosts."""
    script = Path(sys.executable).parent / "fastdistill"
    result = subprocess.run([str(script), "launch", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "cluster" in result.stdout and "field=value" in result.stdout
    code = "import sys, fastdistill.cli, fastdistill.launch; print(sorted(m for m in sys.modules if m == 'torch'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_serve_passes_enforce_eager_only_on_cpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve-teacher", "some/model", "--dry-run"]) == 0
    cpu = capsys.readouterr().err
    assert "--enforce-eager" in cpu and "--dtype float32" in cpu and "--distributed-executor-backend uni" in cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU server captures CUDA graphs
    assert main(["serve-student", "some/model", "--dry-run"]) == 0
    gpu = capsys.readouterr().err
    assert "--enforce-eager" not in gpu and "--dtype auto" in gpu and "uni" not in gpu
    assert '--weight-transfer-config {"backend": "nccl"}' in gpu


KEY_VARIABLES = ("FASTDISTILL_STUDENT_API_KEY", "FASTDISTILL_TEACHER_API_KEY", "VLLM_API_KEY",
                 "FASTDISTILL_STUDENT_API_KEY_FILE", "FASTDISTILL_TEACHER_API_KEY_FILE")


@pytest.fixture
def no_keys(monkeypatch, tmp_path):
    """No key in the environment; generated keys go under tmp_path (XDG_CACHE_HOME)."""
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fastdistill" / "keys"


def test_serve_takes_an_api_key_and_keeps_it_out_of_the_command(capsys, monkeypatch, no_keys):
    from fastdistill.cli import build_parser, build_server

    assert main(["serve-student", "some/model", "--host", "0.0.0.0", "--no-api-key", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(
        "fastdistill: refusing to start a dev-mode vLLM student server (VLLM_SERVER_DEV_MODE=1) on host '0.0.0.0' "
        "without an API key")
    assert main(["serve-student", "some/model", "--host", "0.0.0.0", "--api-key", "cli-key", "--dry-run"]) == 0
    printed = capsys.readouterr().err
    assert "--middleware fastdistill.auth.RequireAPIKey" in printed and "cli-key" not in printed
    assert printed.rstrip().endswith("(API key in $VLLM_API_KEY)")
    monkeypatch.setenv("FASTDISTILL_STUDENT_API_KEY", "env-student-key")
    monkeypatch.setenv("FASTDISTILL_TEACHER_API_KEY", "env-teacher-key")
    for role, key in (("student", "env-student-key"), ("teacher", "env-teacher-key")):
        args = build_parser().parse_args([f"serve-{role}", "some/model", "--host", "0.0.0.0"])
        args.vllm_args = []
        if role == "student":
            args.weight_transfer = "gloo"
        server = build_server(args)
        assert server.environment()["VLLM_API_KEY"] == key and key not in " ".join(server.command())
    assert not no_keys.exists()  # a key from the environment: no key file


def _serve_args(argv: list[str]):
    from fastdistill.cli import build_parser

    args = build_parser().parse_args(argv)
    args.vllm_args = []
    args.weight_transfer = "gloo" if args.role == "student" else None
    return args


@pytest.mark.parametrize("role", ["student", "teacher"])
def test_serve_without_a_key_generates_one_into_a_private_file_the_trainer_reads(capsys, caplog, monkeypatch, no_keys,
                                                                                 role):
    from fastdistill.auth import student_api_key_from_env, teacher_api_key_from_env
    from fastdistill.cli import _served_key

    assert main([f"serve-{role}", "some/model", "--port", "8123", "--dry-run"]) == 0
    printed = capsys.readouterr().err
    assert f"would generate an API key into {no_keys / f'{role}.key'} (mode 0600)" in printed
    assert "--middleware fastdistill.auth.RequireAPIKey" in printed and not no_keys.exists()  # dry: nothing written
    assert (student_api_key_from_env() if role == "student" else teacher_api_key_from_env("any")) is None
    key = _served_key(_serve_args([f"serve-{role}", "some/model", "--port", "8123"]))
    path = no_keys / f"{role}.key"
    assert path.read_text().strip() == key and path.stat().st_mode & 0o777 == 0o600
    variable = f"FASTDISTILL_{role.upper()}_API_KEY_FILE"
    assert (f"API key generated into {path} (mode 0600): a trainer run by this user finds it there; elsewhere, give "
            f"it with {variable}") in caplog.text
    assert key not in caplog.text
    assert _served_key(_serve_args([f"serve-{role}", "some/model", "--port", "8124"])) == key  # replicas share it
    assert f"API key read from {path}" in caplog.text
    # the trainer's side: the config's defaults read the generated key
    assert (student_api_key_from_env() if role == "student" else teacher_api_key_from_env("any")) == key
    assert _served_key(_serve_args([f"serve-{role}", "some/model", "--no-api-key"])) is None


def test_serve_key_file_options_and_their_errors(capsys, caplog, tmp_path, no_keys):
    from fastdistill.cli import _served_key

    chosen = tmp_path / "mine.key"
    key = _served_key(_serve_args(["serve-student", "m", "--api-key-file", str(chosen)]))
    assert chosen.read_text().strip() == key and not no_keys.exists()
    chosen.chmod(0o640)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-student", "m", "--api-key-file", str(chosen), "--dry-run"])
    assert exit_info.value.code == 2 and "is open to other users (mode 640): chmod 600" in capsys.readouterr().err
    for argv in (["--api-key", "k", "--api-key-file", str(chosen)], ["--no-api-key", "--api-key-file", str(chosen)]):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve-teacher", "m", *argv, "--dry-run"])
        assert exit_info.value.code == 2 and "not both" in capsys.readouterr().err


def test_wait_until_healthy_reports_healthy_exited_and_timeout():
    """The start-up wait shared by VLLMServer and the SmolLM2 recipe: each outcome on a real local HTTP server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from fastdistill.serve import wait_until_healthy

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the handler's name is fixed)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert wait_until_healthy(url, alive=lambda: True, timeout_s=60) == "healthy"
        assert wait_until_healthy(url, alive=lambda: False, timeout_s=60) == "exited"  # checked before each poll
    finally:
        server.shutdown()
        server.server_close()
    assert wait_until_healthy(url, alive=lambda: True, timeout_s=0) == "timeout"  # no time for a single poll
