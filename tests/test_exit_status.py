"""Exit statuses that say what happened: each fastdistill error class exits with its documented status
(fastdistill.errors.exit_status), through the CLI, through torchrun (whose own status is 1 whatever failed: the
node's supervisor reads torchrun's error file) and through ``fastdistill launch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastdistill import cli
from fastdistill.errors import (
    AlignmentError,
    CacheError,
    CollectiveTimeoutError,
    ConfigError,
    LostRankError,
    NonFiniteLossError,
    ServerDownError,
    TeacherHeadError,
    VLLMRequestError,
    VLLMServerError,
    VLLMUnavailableError,
    VocabularyMismatchError,
    WeightSyncError,
    exit_status,
    read_torchrun_error_file,
    record_for_torchrun,
)
from fastdistill.serve import free_port

LOST = "rank 1 lost trainer rank(s) 0 of 2 (at 10.0.0.1): no heartbeat for 60 s (rank_heartbeat_timeout_s=60)"


@pytest.mark.parametrize(("error", "status"), [
    (LostRankError(LOST), 75), (CollectiveTimeoutError("timed out"), 75),
    (ServerDownError("down"), 69), (VLLMServerError("exited"), 69), (VLLMUnavailableError("gone"), 69),
    (WeightSyncError("cut off"), 69),
    (ConfigError("bad"), 2), (CacheError("torn"), 2), (TeacherHeadError("no head"), 2),
    (VocabularyMismatchError("differs"), 2),
    (NonFiniteLossError("nan"), 65),
    (VLLMRequestError("http://s", 400, "bad request"), 1), (AlignmentError("bytes"), 1), (RuntimeError("bug"), 1),
])
def test_each_error_class_has_its_status(error, status):
    assert exit_status(error) == status


def test_the_torchrun_error_file_round_trips(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_for_torchrun(LostRankError(LOST), formatted_traceback="Traceback ...")
    assert read_torchrun_error_file(str(path)) == (None, f"LostRankError: {LOST}")  # a worker's: no errorCode
    data = json.loads(path.read_text())
    data["message"]["errorCode"] = 75  # what torchrun adds when it copies the first failure's file
    path.write_text(json.dumps(data))
    assert read_torchrun_error_file(str(path)) == (75, f"LostRankError: {LOST}")
    assert read_torchrun_error_file(str(tmp_path / "none.json")) == (None, "")
    (tmp_path / "torn.json").write_text("{not json")
    assert read_torchrun_error_file(str(tmp_path / "torn.json")) == (None, "")


def test_the_cli_exits_with_the_class_status_and_records_it_for_torchrun(tmp_path, monkeypatch, capsys):
    """A LostRankError raised on the main thread (a collective that failed) exits 75, not 1: the traceback ends with
    the line the launcher reads, and torchrun's error file names the class."""
    def lost(args):
        raise LostRankError(LOST)

    monkeypatch.setattr(cli, "_train", lost)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert cli.main(["train"]) == 75
    assert capsys.readouterr().err.rstrip().endswith(f"fastdistill.errors.LostRankError: {LOST}")
    assert read_torchrun_error_file(str(tmp_path / "error.json"))[1] == f"LostRankError: {LOST}"

    def config_error(args):
        raise ConfigError("beta must be in [0, 1]")

    monkeypatch.setattr(cli, "_train", config_error)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train"])
    assert exit_info.value.code == 2
    assert read_torchrun_error_file(str(tmp_path / "error.json"))[1] == "ConfigError: beta must be in [0, 1]"

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_train", bug)
    with pytest.raises(KeyError):  # not fastdistill's: the traceback as always, exit 1
        cli.main(["train"])


# A torchrun worker: `fastdistill train` whose training raises FAILING_CLASS on rank FAILING_RANK (the other ranks
# wait to be stopped by torchrun).
WORKER = """
import os, sys, time
from fastdistill import cli, errors

def train(args):
    if os.environ["RANK"] != os.environ["FAILING_RANK"]:
        time.sleep(600)
    cls = getattr(errors, os.environ["FAILING_CLASS"], None) or getattr(__builtins__, os.environ["FAILING_CLASS"])
    raise cls(os.environ["FAILING_MESSAGE"])

cli._train = train
sys.exit(cli.main(sys.argv[1:]))
"""
# The launcher's `torchrun`: real torchrun, with WORKER in place of `-m fastdistill.cli`.
TORCHRUN = """
import os, sys
argv = sys.argv[2:]
at = argv.index("-m")
os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv[:at], sys.argv[1], *argv[at + 2:]])
"""


def clean_environment(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
            "GLOO_SOCKET_IFNAME")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1", **extra}


def torchrun_node(worker: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(worker), "train"]


@pytest.mark.parametrize(("cls", "message", "status"), [
    ("LostRankError", LOST, 75), ("ServerDownError", "the student answered nothing for 600 s", 69),
    ("ConfigError", "beta must be in [0, 1]", 2), ("RuntimeError", "a bug", 1),
])
def test_a_torchrun_node_under_its_supervisor_exits_with_its_first_failure_s_status(tmp_path, cls, message, status):
    """torchrun turns any failing rank into its own exit 1; ``fastdistill supervise --torchrun-status`` reads
    torchrun's error file and exits with the failing rank's status, naming its class."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = clean_environment(FAILING_RANK="1", FAILING_CLASS=cls, FAILING_MESSAGE=message)
    supervisor = [sys.executable, "-m", "fastdistill.cli", "supervise", "--grace-s", "5", "--torchrun-status", "--"]
    node = subprocess.run([*supervisor, *torchrun_node(worker)], env=env, capture_output=True, text=True,
                          timeout=300)  # a hang guard only
    assert node.returncode == status, node.stderr[-3000:]
    if status != 1:
        assert f"fastdistill supervise: torchrun's first failure (exit {status}): {cls}: {message}" in node.stderr
    if cls == "LostRankError":  # torchrun alone: 1, whatever failed
        bare = subprocess.run(torchrun_node(worker), env=env, capture_output=True, text=True, timeout=300)
        assert bare.returncode == 1 and f"fastdistill.errors.LostRankError: {LOST}" in bare.stderr


def test_fastdistill_launch_exits_with_a_trainer_rank_s_status_through_torchrun(tmp_path, capsys):
    """``fastdistill launch``: a rank of trainer node 0 raises LostRankError under torchrun: the launcher names it and
    exits 75 (a trainer peer lost: resumable)."""
    worker, torchrun = tmp_path / "worker.py", tmp_path / "torchrun.py"
    worker.write_text(WORKER)
    torchrun.write_text(TORCHRUN)
    config = {
        "exec": ["env", "LAUNCH_HOST={host}"], "exec_shell": False,
        "student": {"host": "s", "address": "127.0.0.1", "port": 8000, "model": "student-model"},
        "teacher_model": "teacher-model", "teachers": {"default": {"host": "t", "address": "127.0.0.1", "port": 8001}},
        "trainers": [{"host": "n0", "address": "127.0.0.1", "nproc": 2}], "master_port": free_port(),
        "key_files": {"student": "keys/student.key", "teacher": "keys/teacher.key"},
        "train_config": "train.yaml", "logs": "logs", "failure_grace_s": 60, "stop_grace_s": 5,
        # the servers: `fastdistill supervise` around a sleeper; the node: the real supervisor around real torchrun
        "fastdistill": [sys.executable, "-c", "import sys, time\nif sys.argv[1:2] == ['supervise']:\n"
                        "    from fastdistill.cli import main; sys.exit(main(sys.argv[1:]))\ntime.sleep(600)"],
        "torchrun": [sys.executable, str(torchrun), str(worker)],
        "env": {"FAILING_RANK": "1", "FAILING_CLASS": "LostRankError", "FAILING_MESSAGE": LOST, "OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    environment = clean_environment()
    launched = subprocess.run([sys.executable, "-m", "fastdistill.cli", "launch", str(path)], env=environment,
                              capture_output=True, text=True, timeout=300)  # a hang guard only
    assert launched.returncode == 75, launched.stderr[-3000:]
    assert f"launch: failed: trainer-0 (exit 75): fastdistill.errors.LostRankError: {LOST}" in launched.stderr
    assert "launch: exit 75: a trainer peer lost or stuck: resume with resume_from_checkpoint=latest" in \
        launched.stderr
