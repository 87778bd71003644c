"""The record of which kernel designs have run on a real GPU (fastdistill_kernels.validation): the device code each
design launches, found statically, hashed, and compared with kernels/fastdistill_kernels/validated.json."""

from __future__ import annotations

import ast
import hashlib
import json

import fastdistill_kernels
import pytest
from fastdistill_kernels import validation

# A package of three modules: host code that launches one kernel through a class, a jit helper imported from another
# module, a tl.constexpr constant, and a jit function nothing launches.
TOY = {
    "entry": (
        "from .helpers import helper, LIMIT\n"
        "from . import helpers\n"
        "import triton\n\n"
        "def entry(x):\n    return _Op.apply(x)\n\n"
        "class _Op:\n    @staticmethod\n    def forward(x):\n        launch(x)\n\n"
        "def launch(x):\n    _kernel[(1,)](x)\n    helpers.host_only()\n\n"
        "@triton.jit(do_not_specialize=['n'])\ndef _kernel(X, n):\n    helper(X, LIMIT)\n\n"
        "@triton.jit\ndef _unused(X):\n    pass\n"
    ),
    "helpers": (
        "import triton\nimport triton.language as tl\n\n"
        "BASE = 7\nLIMIT = tl.constexpr(BASE * 2)\n\n"
        "@triton.jit\ndef helper(X, m):\n    pass\n\n"
        "def host_only():\n    return BASE\n"
    ),
}


def _toy_kernels(sources=TOY):
    original = validation.DESIGNS
    try:
        validation.DESIGNS = {("toy", "triton"): ("entry", "entry")}
        return validation.design_kernels("toy", "triton", sources.__getitem__)
    finally:
        validation.DESIGNS = original


def test_source_hash_is_sha256_of_the_text_with_unix_line_endings():
    assert validation.source_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert validation.source_hash("a\r\nb\n") == hashlib.sha256(b"a\nb\n").hexdigest()


def test_a_design_is_the_jit_code_its_host_code_launches_with_helpers_and_constants():
    kernels = _toy_kernels()
    assert sorted(kernels) == ["entry._kernel", "helpers.BASE", "helpers.LIMIT", "helpers.helper"]
    assert kernels["entry._kernel"].startswith("@triton.jit(do_not_specialize=['n'])\ndef _kernel(X, n):")
    assert kernels["helpers.LIMIT"] == "LIMIT = tl.constexpr(BASE * 2)"


def test_the_real_designs_launch_their_own_kernels():
    names = {d: set(validation.design_kernels(*d)) for d in validation.DESIGNS}
    assert "forward._forward_kernel" in names[("sparse", "triton")]
    assert "tiles.logit_tile" in names[("sparse", "triton")] and "tiles.logit_tile" in names[("dense", "triton")]
    assert not any(n.startswith("logits_chunk.") for n in names[("sparse", "triton")])
    assert not any(n.startswith(("forward.", "backward.")) for n in names[("sparse", "triton-chunked")])
    assert all(names.values())


def test_an_edited_kernel_is_detected_and_only_its_designs_lose_validation():
    """A record made from today's sources; then one helper (``tiles.logit_tile``, used by both fused designs) gets
    one more line: exactly the two fused designs report it."""
    record = validation.new_record({"commit": "test"})
    read = validation.read_package_module
    assert all(not validation.changed_kernels(*d, record=record) for d in validation.DESIGNS)

    def edited(module):
        text = read(module)
        if module != "tiles":
            return text
        (node,) = [n for n in ast.parse(text).body if getattr(n, "name", "") == "logit_tile"]
        lines = text.split("\n")
        lines.insert(node.end_lineno, "    pass  # an edit")
        return "\n".join(lines)

    changed = {d: validation.changed_kernels(*d, record=record, read=edited) for d in validation.DESIGNS}
    assert changed[("sparse", "triton")] == ["tiles.logit_tile"] == changed[("dense", "triton")]
    assert changed[("sparse", "triton-chunked")] == [] == changed[("dense", "triton-chunked")]


def test_a_kernel_dropped_from_the_record_or_a_design_missing_is_not_validated():
    record = validation.new_record({"commit": "test"})
    kernels = record["designs"]["sparse"]["triton-chunked"]["kernels"]
    dropped = sorted(kernels)[0]
    del kernels[dropped]
    assert validation.changed_kernels("sparse", "triton-chunked", record=record) == [dropped]
    del record["designs"]["dense"]
    every = sorted(validation.design_kernels("dense", "triton"))
    assert validation.changed_kernels("dense", "triton", record=record) == every


def test_the_committed_record_names_the_gpu_run_for_every_design():
    record = validation.load_record()
    assert record["schema"] == validation.RECORD_SCHEMA
    for loss, backend in validation.DESIGNS:
        entry = record["designs"][loss][backend]
        run = entry["validated_on"]
        assert run["commit"] and run["date"] and "H200" in run["machine"]
        assert run["compiled_tests"]["passed"] == run["compiled_tests"]["total"] > 0
        assert entry["kernels"] and all(len(h) == 64 for h in entry["kernels"].values())


def test_an_unreadable_or_foreign_record_validates_nothing(tmp_path, monkeypatch):
    bad = tmp_path / "validated.json"
    bad.write_text(json.dumps({"schema": 99, "designs": {}}))
    with pytest.raises(ValueError, match="schema 99, expected 1"):
        validation.load_record(bad)
    assert validation.load_record(tmp_path / "absent.json")["designs"] == {}
    validation.validated_designs.cache_clear()
    monkeypatch.setattr(validation, "RECORD_FILE", bad)
    try:
        assert validation.validated_designs() == frozenset()
    finally:
        validation.validated_designs.cache_clear()


def test_the_public_flag_says_whether_every_design_is_validated(monkeypatch):
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset(validation.DESIGNS))
    assert fastdistill_kernels.KERNELS_VALIDATED_ON_GPU is True
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset(list(validation.DESIGNS)[1:]))
    assert fastdistill_kernels.KERNELS_VALIDATED_ON_GPU is False
    with pytest.raises(ValueError, match="unknown kernel design"):
        validation.is_validated("sparse", "cuda")
