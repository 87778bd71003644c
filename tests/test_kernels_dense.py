"""dense_teacher_jsd_loss(backend="triton-chunked") in Triton's CPU interpreter against the float64 dense reference.

Tiny shapes: V_s = 96 and V_t = 110 span two and three 64-column tiles of the interpreter; fp32 only (the
interpreter has no bf16 arithmetic). The fp32 bound is the one tests/test_dense_teacher.py derives for the torch
path (:func:`test_dense_teacher.logit_error_scale`): the kernels evaluate the same per-element terms in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch
from loss_cases import rel_close
from test_dense_teacher import EPS32, FIELDS, logit_error_scale, make_inputs, run

pytest.importorskip("triton")

CASES = [  # beta, temperature, softcap (student; teacher 4.0), padded teacher vocabulary, chunk_rows
    (0.0, 1.0, None, False, None),
    (0.0, 0.7, 3.0, True, 7),
    (0.5, 1.0, None, True, 7),
    (0.5, 1.5, 3.0, False, 5),
    (1.0, 1.0, None, False, 7),
    (1.0, 0.7, 3.0, True, 16),
]


@pytest.mark.parametrize("beta,T,softcap,padded,chunk_rows", CASES)
def test_triton_chunked_matches_float64_reference(beta, T, softcap, padded, chunk_rows):
    x = make_inputs(seed=int(beta * 10) + int(T * 10), Vt=110 if padded else 96)
    kw = dict(beta=beta, temperature=T, student_softcap=softcap, teacher_softcap=None if softcap is None else 4.0,
              student_logit_scale=1.2, teacher_logit_scale=0.9)
    ref, ref_grads = run(x, torch.float64, "reference", **kw)
    assert (float(ref.teacher_dropped_mass_sum) > 0) == padded
    fp32_tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, T)
    assert fp32_tol <= 1e-5
    out, grads = run(x, torch.float32, "triton-chunked", chunk_rows=chunk_rows, **kw)
    assert int(out.num_tokens) == int(x["mask"].sum())
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), fp32_tol, f)
    for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        rel_close(g, r, fp32_tol, name)


def test_no_mask_no_weights_no_bias_single_teacher():
    x = make_inputs(seed=3, N=9, V=70, Vt=70)
    hs, ws = (x[k].float().requires_grad_() for k in ("hs", "ws"))
    outs = {}
    for backend in ("reference", "triton-chunked"):
        h64, w64 = (x[k].clone().requires_grad_() for k in ("hs", "ws"))
        h, w = (h64, w64) if backend == "reference" else (hs, ws)
        from fastdistill import dense_teacher_jsd_loss

        o = dense_teacher_jsd_loss(h, w, x["ht"].to(h.dtype), x["wt"].to(h.dtype), beta=0.3, backend=backend)
        outs[backend] = (o, torch.autograd.grad(o.loss * 2.5, (h, w)))  # a non-unit upstream gradient
    tol = 3 * EPS32 * logit_error_scale(x)
    (ref, rg), (out, g) = outs["reference"], outs["triton-chunked"]
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), tol, f)
    for name, a, b in zip(("dh", "dW"), g, rg, strict=True):
        rel_close(a, b, tol, name)


def test_nothing_scored_gives_zero_loss_and_zero_gradients():
    x = make_inputs(seed=1, N=5)
    out, grads = run(x, torch.float32, "triton-chunked", mask=torch.zeros(5, dtype=torch.bool))
    assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_needs_cuda_or_the_interpreter(monkeypatch):
    x = make_inputs(seed=0, N=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="use CUDA tensors, or set TRITON_INTERPRET=1"):
        run(x, torch.float32, "triton-chunked")


def test_float64_inputs_are_refused_with_a_pointer_to_the_torch_path():
    x = make_inputs(seed=0, N=4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        run(x, torch.float64, "triton-chunked")


def test_extreme_logits_stay_finite_and_match_the_float64_torch_path():
    """Logit gaps of hundreds of nats (most fp32 probabilities underflow): the bounds of the torch path's test of
    the same name — the loss relative 3·eps32·Z, the gradients absolute 3·eps32·Z² times |W|, Σ|h|, the row count."""
    x = make_inputs(seed=13, spread=40.0)
    Z = logit_error_scale(x)
    grad_units = (float(x["ws"].abs().max()), float(x["hs"].abs().sum(dim=0).max()), x["hs"].shape[0])
    for beta in (0.0, 0.3, 1.0):
        ref, ref_grads = run(x, torch.float64, "torch", beta=beta, mask=None, token_weights=None)
        out, grads = run(x, torch.float32, "triton-chunked", beta=beta, mask=None, token_weights=None)
        assert all(bool(torch.isfinite(t).all()) for t in (out.loss, out.entropy_sum, *grads))
        rel_close(out.loss, ref.loss, 3 * EPS32 * Z, f"beta={beta} loss")
        for name, g, r, unit in zip(("dh", "dW", "db"), grads, ref_grads, grad_units, strict=True):
            err = float((g.double() - r).abs().max())
            assert err <= 3 * EPS32 * Z**2 * unit, f"beta={beta} {name}: {err:.3e}"


def test_without_grad_gives_the_same_statistics():
    x = make_inputs(seed=4)
    kw = dict(beta=0.5, chunk_rows=7)
    with_grad, _ = run(x, torch.float32, "triton-chunked", **kw)
    with torch.no_grad():
        plain, _ = run(x, torch.float32, "triton-chunked", grads=False, **kw)
    assert not plain.loss.requires_grad
    for f in FIELDS:
        torch.testing.assert_close(getattr(plain, f), getattr(with_grad, f).detach(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ compiled on a GPU
CUDA_COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
# Loss and gradients against the fp32 torch path on the same inputs. bf16 / fp16 round each raw logit of both sides
# once (2^-9 / 2^-12 relative, |x| ≲ 4 here): an error δ ≈ 8e-3 / 1e-3 shifts p by p·δ, and the gradient p − q
# (β = 0) is smaller than p where the two distributions agree, so its relative error is several δ. Measured in the
# CPU interpreter at N = 64, V = 1003 (bf16 loads, fp32 arithmetic): loss ≤ 4e-4 / 2e-5, gradients ≤ 2.4e-2 / 2.4e-3.
GPU_LOSS_RTOL = {torch.float32: 5e-5, torch.bfloat16: 5e-3, torch.float16: 1e-3}
GPU_GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@pytest.mark.skipif(not CUDA_COMPILED, reason="the compiled kernels need a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,T,softcap", [(0.0, 1.0, None), (0.5, 0.7, 3.0), (1.0, 1.3, 3.0)])
def test_compiled_path_matches_the_torch_path(dtype, beta, T, softcap):
    """N, D, V no tile multiples, a padded teacher, bias, token weights, several chunks, on CUDA."""
    x = {k: v.cuda() for k, v in make_inputs(seed=21, N=333, Ds=64, Dt=48, V=5003, Vt=5067).items()}
    kw = dict(beta=beta, temperature=T, student_softcap=softcap, teacher_softcap=None if softcap is None else 4.0,
              student_logit_scale=1.2, teacher_logit_scale=0.9, chunk_rows=128)
    ref, ref_grads = run(x, torch.float32, "torch", **kw)
    xd = {k: v.to(dtype) if v.is_floating_point() and k != "token_weights" else v for k, v in x.items()}
    out, grads = run(xd, dtype, "triton-chunked", **kw)
    for f in FIELDS:
        rel_close(getattr(out, f).float(), getattr(ref, f), GPU_LOSS_RTOL[dtype], f)
    for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
        assert g.dtype == dtype
        rel_close(g.float(), r, GPU_GRAD_RTOL[dtype], name)
