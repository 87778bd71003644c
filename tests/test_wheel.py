"""The wheel ships the library and nothing else: every module of ``fastdistill`` and ``fastdistill_kernels`` (the
kernels' JSON records included), the console script and the vLLM plugin entry point; not the test harness
(``fastdistill_testing`` and its network-namespace hosts), the tests, the benchmarks or the examples.

The wheel is built with pip from a copy of the checkout (as ``pip install .`` builds it; a copy, so that setuptools'
``build/`` folder of an earlier build cannot add stale files), then installed into a folder of its own and imported
from there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = ("pyproject.toml", "setup.py", "README.md", "fastdistill", "kernels", "fastdistill_testing", "tests",
            "benchmarks", "examples", "docs")
# What the wheel installs: the library's two packages and the wheel's metadata.
LIBRARY = {"fastdistill": ROOT / "fastdistill", "fastdistill_kernels": ROOT / "kernels" / "fastdistill_kernels"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CHECKOUT:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "--no-cache-dir", "--quiet", "--wheel-dir", str(folder / "dist"), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = (folder / "dist").glob("fastdistill-*.whl")
    return built


def library_files() -> set[str]:
    """The files of the library's packages in the checkout, as wheel paths (``fastdistill/cli.py``, ...)."""
    return {f"{top}/{path.relative_to(folder).as_posix()}" for top, folder in LIBRARY.items()
            for path in folder.rglob("*") if path.is_file() and "__pycache__" not in path.parts}


def test_the_wheel_holds_the_library_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = {name for name in names if name.split("/")[0].endswith(".dist-info")}
    assert {name.split("/")[0] for name in set(names) - info} == set(LIBRARY)
    assert set(names) - info == library_files()  # every module, the demo, the launcher and the kernels' JSON
    expected = {"fastdistill/demo.py", "fastdistill/tiny.py", "fastdistill/launch.py", "fastdistill/cli.py",
                "fastdistill_kernels/metadata.json", "fastdistill_kernels/validated.json"}
    assert expected <= set(names)
    assert not [name for name in names if "testing" in name or "conftest" in name or name.startswith("tests/")]
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in info if n.endswith("entry_points.txt"))).decode()
    assert "fastdistill = fastdistill.cli:main" in entry_points
    assert "fastdistill_gloo = fastdistill.sync.vllm_plugin:register" in entry_points


# Imports every module of the installed packages with nothing of the checkout on the path (an editable install's
# finder, which would serve a module the wheel lacks from the checkout, is taken off first); prints what failed.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import fastdistill, fastdistill_kernels
failed = {}
for package in (fastdistill, fastdistill_kernels):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(module.name)
        except ImportError as error:
            failed[module.name] = error.name
try:
    import fastdistill_testing
    failed["fastdistill_testing"] = "importable"
except ImportError:
    pass
print(json.dumps({"file": fastdistill.__file__, "kernels": fastdistill_kernels.__file__, "failed": failed}))
"""


@pytest.mark.slow
def test_the_installed_wheel_imports_and_runs_outside_the_checkout(wheel, tmp_path):
    """Installed alone, every module imports (those that need vLLM aside, where this interpreter has none), the
    harness does not, and ``fastdistill launch --help`` runs from the installed files."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=600)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["file"] == str(site / "fastdistill" / "__init__.py")
    assert outcome["kernels"] == str(site / "fastdistill_kernels" / "__init__.py")
    assert {name: why for name, why in outcome["failed"].items() if (why or "").split(".")[0] != "vllm"} == {}
    result = subprocess.run([sys.executable, "-m", "fastdistill.cli", "launch", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "usage: fastdistill launch" in result.stdout, result.stderr[-3000:]
