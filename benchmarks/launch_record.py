"""A pytest plugin for the GPU check's kernel tests: which launch patterns each kernel design ran on the GPU, and
whether the tests that ran them passed; written with the keys of the tree that ran (``--launch-record PATH``).

Every launch of a design goes through its autograd function (``fastdistill_kernels.validation.AUTOGRAD_FUNCTIONS``);
the plugin wraps each one's ``forward`` and notes :func:`fastdistill_kernels.validation.launch_pattern` of the
operands it receives (``ctx.needs_input_grad`` for the gradients) when they are CUDA tensors (any tensors under
``TRITON_INTERPRET=1``: the check's dry run). A pattern's verdict is
``"passed"`` when every test that ran it passed, ``"failed"`` when one of them failed or erred. At the end the plugin
writes ``{"run_keys": validation.run_keys(), "patterns": {loss: {backend: {pattern: verdict}}}, "tests": {...}}``:
the module hashes are those of the package this pytest imported, the triton version the one it imported.

    python -m pytest -p launch_record --launch-record out.json tests/test_kernels.py   # benchmarks/ on PYTHONPATH
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path

import pytest

_seen: set[tuple[str, str, str]] = set()  # (loss, backend, pattern) launched by the test running now
_verdicts: dict[tuple[str, str, str], str] = {}
_counts = {"passed": 0, "failed": 0}


def pytest_addoption(parser):
    parser.addoption("--launch-record", type=Path, default=None,
                     help="write the launch patterns the kernel designs ran on CUDA, with their verdicts, here")


def _recording(design: tuple[str, str], forward):
    from fastdistill_kernels import validation

    n = len(validation.PATTERN_OPERANDS[design[0]])
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the dry run's CPU kernels (never a validation)

    @functools.wraps(forward)
    def wrapped(ctx, *args, **kwargs):
        operands = args[:n]
        if interpreted or any(getattr(x, "is_cuda", False) for x in operands):
            _seen.add((*design, validation.launch_pattern(design[0], operands, ctx.needs_input_grad[:n])))
        return forward(ctx, *args, **kwargs)

    return staticmethod(wrapped)


def pytest_configure(config):
    if config.getoption("--launch-record") is None:
        return
    from fastdistill_kernels import validation

    for design, (module, cls) in validation.AUTOGRAD_FUNCTIONS.items():
        function = getattr(importlib.import_module(f"fastdistill_kernels.{module}"), cls)
        function.forward = _recording(design, function.forward)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _seen.clear()
    yield
    _seen.clear()


def pytest_runtest_logreport(report):
    if not _seen:
        return
    failed = report.failed
    if report.when == "call" or failed:
        for key in _seen:
            if failed:
                _verdicts[key] = "failed"
            else:
                _verdicts.setdefault(key, "passed")
        if report.when == "call":
            _counts["failed" if failed else "passed"] += 1


def _merge(into: dict, patterns: dict) -> None:
    """Merge ``{loss: {backend: {pattern: verdict}}}`` into ``into``: a pattern failed anywhere failed."""
    for loss, by in patterns.items():
        for backend, verdicts in by.items():
            mine = into.setdefault(loss, {}).setdefault(backend, {})
            for pattern, verdict in verdicts.items():
                mine[pattern] = "failed" if "failed" in (verdict, mine.get(pattern)) else verdict


def pytest_sessionfinish(session):
    """Write the record (a pytest-xdist worker writes ``PATH.<worker id>``, and the controller merges those)."""
    path = session.config.getoption("--launch-record")
    if path is None:
        return
    from fastdistill_kernels import validation

    patterns: dict[str, dict[str, dict[str, str]]] = {}
    for (loss, backend, pattern), verdict in sorted(_verdicts.items()):
        patterns.setdefault(loss, {}).setdefault(backend, {})[pattern] = verdict
    counts = dict(_counts)
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker is None:  # the controller (or a run without xdist): merge what the workers wrote
        for part in sorted(path.parent.glob(path.name + ".gw*")):
            data = json.loads(part.read_text())
            _merge(patterns, data["patterns"])
            counts = {k: counts[k] + data["tests_that_launched"][k] for k in counts}
            part.unlink()
    triton = importlib.import_module("triton").__version__
    out = {"run_keys": validation.run_keys(triton_version=triton), "triton_version": triton,
           "patterns": patterns, "tests_that_launched": counts}
    target = path if worker is None else path.with_name(f"{path.name}.{worker}")
    target.write_text(json.dumps(out, indent=2))
