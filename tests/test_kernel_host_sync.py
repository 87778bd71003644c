"""The chunked designs' backward keeps the loss's upstream gradient on the device: no host read of a tensor (which
would wait for the GPU once per micro-batch), and the gradients scaled in fp32, rounded once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

from fastdistill_kernels import chunked_logits_sparse_jsd, logits_chunk  # noqa: E402
from loss_cases import make_case  # noqa: E402
from test_dense_teacher import make_inputs  # noqa: E402

from fastdistill import dense_teacher_jsd_loss  # noqa: E402

HOST_READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy")


class HostReads:
    """Records every host read of a tensor's value (``float(t)``, ``t.item()``, ``bool(t)``, ...) while active."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self._monkeypatch = monkeypatch
        self.active = False

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def spy(t, *args, _name=name, _original=original, **kwargs):
                if self.active:
                    self.calls.append(_name)
                return _original(t, *args, **kwargs)

            self._monkeypatch.setattr(torch.Tensor, name, spy)
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


def _sparse(dtype):
    case = make_case(seed=4, N=24, D=16, V=150, K=4, empty_rows=0)
    ids, lps, mask = case.narrowed(0.5)
    h, w, b = (x.detach().to(dtype).requires_grad_(True) for x in case.leaves(torch.float32))
    return h, w, b, ids, lps, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_backward_reads_no_tensor_on_the_host(monkeypatch, dtype):
    h, w, b, ids, lps, mask = _sparse(dtype)
    out = chunked_logits_sparse_jsd(h, w, ids, lps, mask, bias=b, beta=0.5, chunk_rows=7)
    scale = torch.tensor(0.37)
    with HostReads(monkeypatch) as reads:
        (out.loss * scale).backward()
    assert reads.calls == []
    assert all(x.grad is not None for x in (h, w, b))


def test_the_dense_chunked_backward_reads_no_tensor_on_the_host(monkeypatch):
    x = make_inputs(seed=3, N=12, Ds=8, Dt=6, V=80, Vt=90, dtype=torch.float32)
    hs, ws, bs = (x[k].detach().requires_grad_(True) for k in ("hs", "ws", "bs"))
    out = dense_teacher_jsd_loss(hs, ws, x["ht"], x["wt"], student_bias=bs, teacher_bias=x["bt"], beta=0.5,
                                 backend="triton-chunked", chunk_rows=5)
    with HostReads(monkeypatch) as reads:
        (out.loss * 3.0).backward()
    assert reads.calls == []
    assert all(t.grad is not None for t in (hs, ws, bs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_upstream_gradient_scales_in_fp32_with_one_rounding(dtype):
    """The scaled gradients equal the unit-upstream ones times the scale in fp32, rounded once to their dtype
    (bit for bit): a scale that is no fp16 number is not rounded first. (fp16, not bf16: the interpreter's fp32 to
    bf16 conversion truncates, where a GPU rounds to nearest.)"""
    scale = 0.1234567  # not representable in bf16: a bf16-rounded scale would differ in the last bits
    grads = {}
    for upstream in (1.0, scale):
        h, w, b, ids, lps, mask = _sparse(dtype)
        out = chunked_logits_sparse_jsd(h, w, ids, lps, mask, bias=b, beta=0.5, chunk_rows=7)
        out.loss.backward(torch.tensor(upstream))
        grads[upstream] = [x.grad for x in (h, w, b)]
    for unit, scaled in zip(grads[1.0], grads[scale], strict=True):
        expected = (unit.float() * torch.tensor(scale, dtype=torch.float32)).to(unit.dtype)
        assert scaled.dtype == unit.dtype and torch.equal(scaled, expected)


def test_scale_in_place_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        logits_chunk.scale_in_place(torch.zeros(4, 4).t(), torch.tensor(2.0))
