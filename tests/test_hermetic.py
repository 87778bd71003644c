"""The suite is hermetic: what a user's shell and earlier ``fastdistill serve-*`` runs left (keys in the environment,
key files under ``~/.cache/fastdistill/keys``) cannot reach a test (tests/conftest.py)."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

from conftest import HARNESS_VARIABLES, TEST_HOME

from fastdistill.auth import default_key_file, write_new_key_file

ROOT = Path(__file__).resolve().parent.parent
LEFT_BEHIND = {"FASTDISTILL_STUDENT_API_KEY": "from-the-shell", "FASTDISTILL_TEACHER_API_KEY_FILE": "/nonexistent",
               "FASTDISTILL_TRITON": "1", "VLLM_API_KEY": "from-the-shell"}


def test_the_session_has_its_own_home_and_no_keys():
    """No key variable, a home that is not the user's, no generated key: a config finds no key at all."""
    from fastdistill.train.config import AsyncDistillationConfig

    assert not [name for name in os.environ if "API_KEY" in name]
    assert "FASTDISTILL_TRITON" not in os.environ
    assert Path.home() == TEST_HOME != Path(pwd.getpwuid(os.getuid()).pw_dir)  # the session's one home
    assert Path(os.environ["XDG_CACHE_HOME"]).is_relative_to(Path.home())
    for role in ("student", "teacher"):
        assert default_key_file(role).is_relative_to(Path.home()) and not default_key_file(role).exists()
    config = AsyncDistillationConfig(model_name_or_path="m")
    assert config.vllm_server_api_key is None and config.teacher_api_keys is None
    assert AsyncDistillationConfig(**config.to_dict()) == config


def left_behind_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a shell on a machine where ``serve-student`` and ``serve-teacher`` ran: their generated
    keys under ``$HOME/.cache``, key variables exported, and the harness variables the Makefile passes."""
    home = tmp_path / "home"
    for role in ("student", "teacher"):  # where serve-<role> writes the key it generates
        write_new_key_file(home / ".cache" / "fastdistill" / "keys" / f"{role}.key")
    return {**os.environ, **LEFT_BEHIND, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
            "FASTDISTILL_REQUIRE_NETNS": "0", "FASTDISTILL_COMPILE_JOBS": "3"}


def test_keys_left_by_the_user_do_not_reach_a_test(tmp_path):
    """The test above passes in a pytest session started from such a shell; the key files are left alone."""
    env = left_behind_environment(tmp_path)
    test = "tests/test_hermetic.py::test_the_session_has_its_own_home_and_no_keys"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
    assert (Path(env["HOME"]) / ".cache" / "fastdistill" / "keys" / "student.key").is_file()


def test_the_harness_variables_are_kept(tmp_path):
    """What the session keeps of that environment: exactly the variables that steer the test run, unchanged."""
    env = left_behind_environment(tmp_path)
    show = ("import os, sys; sys.path.insert(0, 'tests'); import conftest; "
            "print(sorted((k, v) for k, v in os.environ.items() if k.startswith('FASTDISTILL_') or 'API_KEY' in k))")
    result = subprocess.run([sys.executable, "-c", show], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = sorted((k, v) for k, v in env.items() if k.startswith("FASTDISTILL_") and k in HARNESS_VARIABLES)
    assert ("FASTDISTILL_REQUIRE_NETNS", "0") in expected and ("FASTDISTILL_COMPILE_JOBS", "3") in expected
    assert result.stdout.strip() == repr(expected)
