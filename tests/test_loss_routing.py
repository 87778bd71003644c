"""What ``backend="auto"`` runs (fastdistill.loss.routing), on CPU tensors that claim to be CUDA ones: the fastest
Triton design validated on a GPU that fits the memory budget (the chunked one, else the fused one), else the torch
path; ``FASTDISTILL_TRITON`` and ``FASTDISTILL_AUTO_MEMORY_MIB`` as documented in docs/loss.md."""

from __future__ import annotations

import pytest
import torch
from loss_cases import make_case

import fastdistill.loss.api as api
import fastdistill.loss.dense as dense
import fastdistill.loss.routing as routing
from fastdistill import dense_teacher_jsd_loss, sparse_jsd_loss

pytest.importorskip("triton", reason="auto only routes to the Triton kernels when triton is installed")
from fastdistill_kernels import validation  # noqa: E402

GiB = 2**30
ALL = frozenset(validation.DESIGNS)
N, V = 40, 300


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors claim to be on CUDA, on an 80 GiB device with ``free`` bytes free (set ``gpu.free``); the record
    validates every design unless a test says otherwise; the self-check is off (tests/test_selfcheck.py routes with
    it); no other FASTDISTILL_* routing variable is set."""

    class Device:
        free = 40 * GiB

    monkeypatch.setattr(routing, "_is_cuda", lambda x: True)
    monkeypatch.setattr(routing, "free_device_bytes", lambda device: Device.free)
    monkeypatch.setattr(routing, "total_device_bytes", lambda device: 80 * GiB)
    monkeypatch.setattr(validation, "validated_designs", lambda: ALL)
    for name in (routing.TRITON_ENV, routing.BUDGET_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FASTDISTILL_SELFCHECK", "0")
    return Device


def _sparse_route(monkeypatch, dtype=torch.float32, backend="auto"):
    """``(backend, chunk_rows)`` that sparse_jsd_loss hands its inputs to (N=40 rows, V=300)."""
    taken = []
    monkeypatch.setattr(api, "_triton_sparse_jsd", lambda *a, **k: taken.append(("triton", None)))
    monkeypatch.setattr(api, "_triton_chunked_sparse_jsd",
                        lambda *a, chunk_rows=None, **k: taken.append(("triton-chunked", chunk_rows)))
    monkeypatch.setattr(api, "torch_sparse_jsd", lambda *a, **k: taken.append(("torch", None)))
    case = make_case(seed=2, N=N, D=16, V=V, K=4)
    h, w, _ = case.leaves(dtype)
    sparse_jsd_loss(h, w, *case.narrowed(0.0), backend=backend)
    (got,) = taken
    return got


def test_the_chunked_design_when_its_buffer_fits(monkeypatch, gpu):
    assert _sparse_route(monkeypatch) == ("triton-chunked", None)  # its own default chunk (all 40 rows here)
    assert _sparse_route(monkeypatch, dtype=torch.bfloat16) == ("triton-chunked", None)


def test_a_smaller_chunk_when_only_that_fits_then_the_fused_design(monkeypatch, gpu):
    monkeypatch.setattr(routing, "MIN_CHUNK_ROWS", 8)
    margin = 8 * GiB  # 10 % of the 80 GiB device
    gpu.free = margin + 20 * V * 4  # 20 rows of fp32 logits
    assert _sparse_route(monkeypatch) == ("triton-chunked", 20)
    gpu.free = margin + 7 * V * 4  # fewer than MIN_CHUNK_ROWS rows
    assert _sparse_route(monkeypatch) == ("triton", None)
    gpu.free = 3 * GiB  # below the margin: nothing for a buffer
    assert _sparse_route(monkeypatch) == ("triton", None)


def test_the_chunk_buffer_is_fp32_whatever_the_operands_dtype(monkeypatch, gpu):
    """bf16 operands still get fp32 raw logits (4 bytes per vocabulary entry): a budget of 20 bf16 rows holds 10
    fp32 rows, and one that holds MIN_CHUNK_ROWS bf16 rows but not as many fp32 rows goes to the fused kernel."""
    monkeypatch.setattr(routing, "MIN_CHUNK_ROWS", 8)
    margin = 8 * GiB
    gpu.free = margin + 20 * V * 2
    assert _sparse_route(monkeypatch, dtype=torch.bfloat16) == ("triton-chunked", 10)
    gpu.free = margin + 8 * V * 2
    assert _sparse_route(monkeypatch, dtype=torch.bfloat16) == ("triton", None)
    gpu.free = margin + 8 * V * 4
    assert _sparse_route(monkeypatch, dtype=torch.bfloat16) == ("triton-chunked", 8)


def test_the_default_chunk_is_the_kernels_own(monkeypatch, gpu):
    """Unconstrained, auto leaves the chunk to the kernel (None), and the rows it weighs against the budget are the
    kernel's default for its fp32 buffer, not a half-precision one."""
    from fastdistill_kernels.dense_chunk import dense_chunk_rows_for
    from fastdistill_kernels.logits_chunk import chunk_rows_for

    monkeypatch.setattr(routing, "MIN_CHUNK_ROWS", 8)
    h = torch.empty(10**5, 8, dtype=torch.bfloat16)
    w = torch.empty(152064, 8, dtype=torch.bfloat16)
    fp32_rows = chunk_rows_for(h.shape[0], w.shape[0], torch.float32)
    assert fp32_rows < chunk_rows_for(h.shape[0], w.shape[0], torch.bfloat16)  # the shape tells them apart
    assert routing.route("sparse", ((h, w),)) == routing.Route("triton-chunked", None)
    gpu.free = 8 * GiB + fp32_rows * w.shape[0] * 4 - 1  # one byte short of the kernel's default chunk
    assert routing.route("sparse", ((h, w),)) == routing.Route("triton-chunked", fp32_rows - 1)
    wt = torch.empty(152064, 8, dtype=torch.bfloat16)
    dense_rows = dense_chunk_rows_for(h.shape[0], w.shape[0], wt.shape[0], torch.float32, torch.float32)
    gpu.free = 8 * GiB + dense_rows * 2 * w.shape[0] * 4 - 1
    assert routing.route("dense", ((h, w), (h, wt))) == routing.Route("triton-chunked", dense_rows - 1)


def test_the_budget_from_the_environment_replaces_the_free_memory_rule(monkeypatch, gpu):
    monkeypatch.setattr(routing, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setenv(routing.BUDGET_ENV, str(10 * V * 4 / 2**20))  # 10 rows, although 40 GiB are free
    assert _sparse_route(monkeypatch) == ("triton-chunked", 10)
    monkeypatch.setenv(routing.BUDGET_ENV, "0")
    assert _sparse_route(monkeypatch) == ("triton", None)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(routing.BUDGET_ENV, bad)
        with pytest.raises(ValueError, match="FASTDISTILL_AUTO_MEMORY_MIB must be a number of MiB >= 0"):
            _sparse_route(monkeypatch)


def test_the_default_budget_is_the_free_memory_less_a_tenth_of_the_device(monkeypatch, gpu):
    gpu.free = 30 * GiB
    assert routing.memory_budget(torch.device("cuda")) == 22 * GiB
    gpu.free = 5 * GiB
    assert routing.memory_budget(torch.device("cuda")) == 0
    monkeypatch.setattr(routing, "total_device_bytes", lambda device: 4 * GiB)  # small device: the 1 GiB floor
    gpu.free = 3 * GiB
    assert routing.memory_budget(torch.device("cuda")) == 2 * GiB


def test_only_designs_whose_kernels_match_the_record(monkeypatch, gpu):
    """A design whose kernels changed since the GPU run is not auto's; the next validated one is, then torch."""
    monkeypatch.setattr(validation, "validated_designs", lambda: ALL - {("sparse", "triton-chunked")})
    assert _sparse_route(monkeypatch) == ("triton", None)
    assert _sparse_route(monkeypatch, backend="triton-chunked") == ("triton-chunked", None)  # still by name
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset({("dense", "triton-chunked")}))
    assert _sparse_route(monkeypatch) == ("torch", None)
    assert _sparse_route(monkeypatch, backend="triton") == ("triton", None)


def test_fastdistill_triton_opts_in_to_unvalidated_designs_and_out_of_all(monkeypatch, gpu):
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset())
    monkeypatch.setenv(routing.TRITON_ENV, "1")
    assert _sparse_route(monkeypatch) == ("triton-chunked", None)
    monkeypatch.setattr(validation, "validated_designs", lambda: ALL)
    monkeypatch.setenv(routing.TRITON_ENV, "0")
    assert _sparse_route(monkeypatch) == ("torch", None)


def test_other_dtypes_cpu_tensors_and_no_triton_stay_on_the_torch_path(monkeypatch, gpu):
    assert _sparse_route(monkeypatch, dtype=torch.float64) == ("torch", None)
    monkeypatch.setattr(routing, "_is_cuda", lambda x: False)
    assert _sparse_route(monkeypatch) == ("torch", None)
    monkeypatch.setattr(routing, "_is_cuda", lambda x: True)
    find_spec = routing.importlib.util.find_spec
    monkeypatch.setattr(routing.importlib.util, "find_spec", lambda n, *a: None if n == "triton" else find_spec(n, *a))
    assert _sparse_route(monkeypatch) == ("torch", None)


def _dense_route(monkeypatch, **kw):
    """``(backend, chunk_rows)`` that dense_teacher_jsd_loss runs (N=24, V_s=96, V_t=110, fp32)."""
    taken = []
    real = dense._DenseJSD.apply
    monkeypatch.setattr(dense, "_triton_dense", lambda *a: taken.append((a[9], a[10])))
    monkeypatch.setattr(dense._DenseJSD, "apply", lambda *a: taken.append(("torch", a[9])) or real(*a))
    g = torch.Generator().manual_seed(0)
    hs, ws, ht, wt = (torch.randn(*s, generator=g) for s in ((24, 16), (96, 16), (24, 12), (110, 12)))
    dense_teacher_jsd_loss(hs, ws, ht, wt, **kw)
    (got,) = taken
    return got


def test_dense_loss_routes_by_the_same_rule(monkeypatch, gpu):
    monkeypatch.setattr(routing, "MIN_CHUNK_ROWS", 8)
    assert _dense_route(monkeypatch) == ("triton-chunked", None)
    gpu.free = 8 * GiB + 10 * (96 + 110) * 4  # both heads' logits rows: 10 fit
    assert _dense_route(monkeypatch) == ("triton-chunked", 10)
    assert _dense_route(monkeypatch, chunk_rows=7) == ("triton-chunked", 7)  # the caller's chunk, when it fits
    assert _dense_route(monkeypatch, chunk_rows=16) == ("triton", 16)  # does not fit: the fused design
    gpu.free = 40 * GiB
    monkeypatch.setattr(validation, "validated_designs", lambda: ALL - {("dense", "triton-chunked")})
    assert _dense_route(monkeypatch)[0] == "triton"
    monkeypatch.setattr(validation, "validated_designs", lambda: ALL - {("dense", "triton-chunked"),
                                                                         ("dense", "triton")})
    assert _dense_route(monkeypatch) == ("torch", None)
