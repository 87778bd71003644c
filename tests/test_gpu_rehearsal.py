"""The one-call GPU check rehearsed on the CPU, as close to the lent GPU machine as this machine allows.

That machine runs its own image (torch, triton 3.6, transformers 5.17, numpy, pandas, pytest, ... but none of
fastdistill's own additions) and reaches no network. Here: a fresh venv holding torch, triton 3.6 and those image
packages (``$FASTDISTILL_REHEARSAL_PYTHON``, built by ``make test``), the device kit built for that interpreter by
``benchmarks/device_kit.py`` (``$FASTDISTILL_REHEARSAL_KIT``), and ``benchmarks/gpu_check.py --dry-run --kit``
run by it inside a network namespace of its own (``unshare -n``: loopback only), so the kit installs with pip and no
index, fastdistill and ``kernels/`` come from this source tree without a build, and the steps run under triton 3.6.
Without those variables the test is skipped, or fails under ``FASTDISTILL_REQUIRE_REHEARSAL=1`` (``make test``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REHEARSAL_PYTHON = os.environ.get("FASTDISTILL_REHEARSAL_PYTHON")
REHEARSAL_KIT = os.environ.get("FASTDISTILL_REHEARSAL_KIT")
# fastdistill's own dependencies and the kit's packages: the rehearsal interpreter must have none of them before
# the kit goes in, as the GPU image has none (fastdistill itself comes from the source tree).
NOT_ON_THE_IMAGE = ("fastdistill", "fastdistill_kernels", "trl", "datasets", "liger_kernel", "cut_cross_entropy")
# Any HTTP(S) client that honours proxies gets "connection refused" from the discard port, in case the namespace
# cannot be made.
DEAD_PROXY = "http://127.0.0.1:9"


def _rehearsal_paths() -> tuple[Path, Path]:
    problem = None
    if not REHEARSAL_PYTHON or not REHEARSAL_KIT:
        problem = "set FASTDISTILL_REHEARSAL_PYTHON and FASTDISTILL_REHEARSAL_KIT (make test builds both)"
    elif not Path(REHEARSAL_PYTHON).exists() or not (Path(REHEARSAL_KIT) / "MANIFEST.json").exists():
        problem = f"{REHEARSAL_PYTHON} or {REHEARSAL_KIT}/MANIFEST.json is missing (make test builds both)"
    if problem:
        if os.environ.get("FASTDISTILL_REQUIRE_REHEARSAL") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return Path(REHEARSAL_PYTHON), Path(REHEARSAL_KIT)


def bare_env(**extra: str) -> dict[str, str]:
    """This environment without anything that points Python or pip elsewhere (this venv, its paths, pip's
    settings), proxies dead, and ``extra``."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PIP_")}
    env = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    return {**env, "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "HTTP_PROXY": DEAD_PROXY,
            "HTTPS_PROXY": DEAD_PROXY, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, **extra}


def offline_prefix() -> list[str]:
    """``unshare -n`` with loopback up (a network namespace with no other interface), where this machine allows
    it; else nothing (the dead proxies and PIP_NO_INDEX still hold)."""
    if shutil.which("unshare") is None:
        return []
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        return []
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh"]


def _probe(python: Path, code: str, prefix: list[str] | None = None) -> str:
    proc = subprocess.run([*(prefix or []), str(python), "-c", code], capture_output=True, text=True, timeout=120,
                          env=bare_env(), cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict:
    """One dry run of the check with ``--kit`` through the rehearsal interpreter, offline (~1-3 min)."""
    python, kit = _rehearsal_paths()
    work = tmp_path_factory.mktemp("rehearsal")
    out, site = work / "gpu_check.json", work / "site"
    before = json.loads(_probe(python, "import importlib.util, json, triton; print(json.dumps({'triton': "
                                       f"triton.__version__, 'found': [m for m in {list(NOT_ON_THE_IMAGE)!r} "
                                       "if importlib.util.find_spec(m)]}))"))
    prefix = offline_prefix()
    cmd = [*prefix, str(python), str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--kit", str(kit),
           "--site", str(site), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=bare_env(), cwd=work)
    print(proc.stdout[-6000:])  # the rehearsal's output, in the test log
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"proc": proc, "result": json.loads(out.read_text()), "before": before, "namespace": bool(prefix),
            "python": python, "kit": kit, "site": site, "prefix": prefix}


def test_the_rehearsal_interpreter_is_the_image_not_this_venv(rehearsal):
    assert rehearsal["before"]["triton"].startswith("3.6."), rehearsal["before"]
    assert rehearsal["before"]["found"] == [], f"the rehearsal venv already has {rehearsal['before']['found']}"


def test_the_dry_run_passes_every_step_offline(rehearsal):
    proc, result = rehearsal["proc"], rehearsal["result"]
    assert proc.returncode == 0 and result["ok"], proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = result["steps"]
    assert result["mode"] == "kit" and result["python"] == str(rehearsal["python"])
    assert list(steps)[:4] == ["environment", "install", "kernel-tests", "bench-4096"]  # by value
    install = steps["install"]
    assert install["status"] == "ok", install
    versions = install["versions"]
    assert versions["triton"].startswith("3.6.") and versions["torch"].startswith("2.13.")
    for name in ("trl", "liger-kernel", "cut-cross-entropy", "datasets"):  # from the kit's folder, importable
        got = versions["imports"][name]
        assert got["ok"] and got["file"].startswith(str(rehearsal["site"])), (name, got)
    for name in ("fastdistill", "fastdistill_kernels"):  # from this source tree, no build step
        assert versions["imports"][name]["file"].startswith(str(ROOT)), versions["imports"][name]
    assert steps["kernel-tests"]["status"] == "ok" and steps["kernel-tests"]["counts"]["passed"] >= 4
    bench = steps["bench-4096"]  # the kernel benchmark's dry run: both input distributions, floor, prediction
    assert [r["dist"] for r in bench["rows"]] == ["random", "peaked"], bench["output_tail"]
    for row in bench["rows"]:
        assert all(row["impls"][impl]["gate"]["ok"] for impl in ("ours-det", "ours-chunked", "torch")), row
        assert row["floor"]["three_s"] > 0 and row["impls"]["ours-chunked"]["predicted_s"] > 0
    assert "H200 recorded" in bench["predicted"]["rates"]
    assert steps["packed-attention"]["status"] == "ok"
    assert steps["vllm-sync"]["status"] == "skipped" and "not in the kit" in steps["vllm-sync"]["detail"]
    assert "KERNELS_VALIDATED_ON_GPU stays as it is" in proc.stdout and "a dry run (no GPU)" in proc.stdout



def test_the_train_step_rehearses_on_tiny_shapes(rehearsal):
    """The trainer's own step (``bench_train_step.py --tiny``) under the image's interpreter, offline, with the kit:
    fastdistill's trainer imports (msgspec from the kit), 20 steps lower the loss, the packed row matches its samples
    alone, the floor ran, and the guard says a CPU run has nothing to guard."""
    result = rehearsal["result"]
    step = result["steps"]["train-step"]
    assert step["status"] == "ok", step.get("output_tail", "")[-3000:]
    assert step["checks"] == {"tiny loss_decreases": "ok", "tiny packed_attention": "ok",
                              "tiny packed_flash_attention_2": "skipped"}
    assert step["guard"]["ok"] and step["guard"]["detail"].startswith("not a GPU run")
    (shape,) = step["shapes"]
    assert shape["checks"]["loss_decreases"]["steps"] == 20
    assert shape["runs"]["K=8 auto"]["status"] == "ok" and shape["floor"]["status"] == "ok"
    msgspec = result["steps"]["install"]["versions"]["imports"]["msgspec"]
    assert msgspec["ok"] and msgspec["file"].startswith(str(rehearsal["site"])), msgspec


def test_pip_reached_no_index(rehearsal):
    """The kit went in with no index, no configuration and no dependency resolution, inside a namespace where
    no address but loopback exists: a pip that needed an index would have failed the install step."""
    cmd = rehearsal["result"]["steps"]["install"]["install"]["cmd"]
    for flag in ("--isolated", "--no-index", "--no-deps", "--target"):
        assert flag in cmd.split(), cmd
    if not rehearsal["namespace"]:
        pytest.skip("unshare -n is not permitted here: only the dead proxies and PIP_NO_INDEX kept pip offline")
    code = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 443), timeout=5)\n    print('online')\n"
            "except OSError:\n    print('offline')")
    assert _probe(rehearsal["python"], code, rehearsal["prefix"]) == "offline"


def test_the_kit_fits_one_call(rehearsal):
    """The kit (here built for the rehearsal interpreter, from the same list as the GPU image's) holds every
    contender and its missing dependencies, one version each, well under what one call carries."""
    manifest = json.loads((rehearsal["kit"] / "MANIFEST.json").read_text())
    names = {w["file"].split("-")[0] for w in manifest["wheels"]}
    assert {"trl", "liger_kernel", "cut_cross_entropy", "datasets", "dill", "multiprocess"} <= names, names
    assert manifest["total_bytes"] <= manifest["limit_bytes"] < 64 * 2**20 and not manifest["duplicated"]
