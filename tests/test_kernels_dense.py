"""dense_teacher_jsd_loss(backend="triton" / "triton-chunked") in Triton's CPU interpreter against the float64 dense
reference, and the fused kernels' own entry point (:func:`fastdistill_kernels.dense_fused.fused_dense_teacher_jsd`).

Tiny shapes: V_s = 96 and V_t = 110 span two and three 64-column tiles of the interpreter; fp32 only (the
interpreter has no bf16 arithmetic). The fp32 bound is the one tests/test_dense_teacher.py derives for the torch
path (:func:`test_dense_teacher.logit_error_scale`): the kernels evaluate the same per-element terms in fp32.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_cases import rel_close
from test_dense_teacher import EPS32, FIELDS, logit_error_scale, make_inputs, run

pytest.importorskip("triton")

TRITON_BACKENDS = ("triton", "triton-chunked")  # fused tiles of both heads; cuBLAS logits per chunk + Triton passes

CASES = [  # beta, temperature, softcap (student; teacher 4.0), padded teacher vocabulary, chunk_rows
    (0.0, 1.0, None, False, None),
    (0.0, 0.7, 3.0, True, 7),
    (0.5, 1.0, None, True, 7),
    (0.5, 1.5, 3.0, False, 5),
    (1.0, 1.0, None, False, 7),
    (1.0, 0.7, 3.0, True, 16),
]


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("beta,T,softcap,padded,chunk_rows", CASES)
def test_triton_matches_float64_reference(backend, beta, T, softcap, padded, chunk_rows):
    x = make_inputs(seed=int(beta * 10) + int(T * 10), Vt=110 if padded else 96)
    kw = dict(beta=beta, temperature=T, student_softcap=softcap, teacher_softcap=None if softcap is None else 4.0,
              student_logit_scale=1.2, teacher_logit_scale=0.9)
    ref, ref_grads = run(x, torch.float64, "reference", **kw)
    assert (float(ref.teacher_dropped_mass_sum) > 0) == padded
    fp32_tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, T)
    assert fp32_tol <= 1e-5
    out, grads = run(x, torch.float32, backend, chunk_rows=chunk_rows, **kw)
    assert int(out.num_tokens) == int(x["mask"].sum())
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), fp32_tol, f)
    for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        rel_close(g, r, fp32_tol, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_no_mask_no_weights_no_bias_single_teacher(backend):
    x = make_inputs(seed=3, N=9, V=70, Vt=70)
    hs, ws = (x[k].float().requires_grad_() for k in ("hs", "ws"))
    outs = {}
    for name in ("reference", backend):
        h64, w64 = (x[k].clone().requires_grad_() for k in ("hs", "ws"))
        h, w = (h64, w64) if name == "reference" else (hs, ws)
        from fastdistill import dense_teacher_jsd_loss

        o = dense_teacher_jsd_loss(h, w, x["ht"].to(h.dtype), x["wt"].to(h.dtype), beta=0.3, backend=name)
        outs[name] = (o, torch.autograd.grad(o.loss * 2.5, (h, w)))  # a non-unit upstream gradient
    tol = 3 * EPS32 * logit_error_scale(x)
    (ref, rg), (out, g) = outs["reference"], outs[backend]
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), tol, f)
    for name, a, b in zip(("dh", "dW"), g, rg, strict=True):
        rel_close(a, b, tol, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_nothing_scored_gives_zero_loss_and_zero_gradients(backend):
    x = make_inputs(seed=1, N=5)
    out, grads = run(x, torch.float32, backend, mask=torch.zeros(5, dtype=torch.bool))
    assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_needs_cuda_or_the_interpreter(monkeypatch, backend):
    x = make_inputs(seed=0, N=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=f"backend='{backend}' got cpu tensors: use CUDA tensors, or set "
                                         "TRITON_INTERPRET=1"):
        run(x, torch.float32, backend)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_float64_inputs_are_refused_with_a_pointer_to_the_torch_path(backend):
    x = make_inputs(seed=0, N=4)
    with pytest.raises(ValueError, match=f"backend='{backend}' takes float32, bfloat16 or float16 hidden, got "
                                         "torch.float64; use backend='torch'"):
        run(x, torch.float64, backend)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_extreme_logits_stay_finite_and_match_the_float64_torch_path(backend):
    """Logit gaps of hundreds of nats (most fp32 probabilities underflow): the bounds of the torch path's test of
    the same name — the loss relative 3·eps32·Z, the gradients absolute 3·eps32·Z² times |W|, Σ|h|, the row count."""
    x = make_inputs(seed=13, spread=40.0)
    Z = logit_error_scale(x)
    grad_units = (float(x["ws"].abs().max()), float(x["hs"].abs().sum(dim=0).max()), x["hs"].shape[0])
    for beta in (0.0, 0.3, 1.0):
        ref, ref_grads = run(x, torch.float64, "torch", beta=beta, mask=None, token_weights=None)
        out, grads = run(x, torch.float32, backend, beta=beta, mask=None, token_weights=None)
        assert all(bool(torch.isfinite(t).all()) for t in (out.loss, out.entropy_sum, *grads))
        rel_close(out.loss, ref.loss, 3 * EPS32 * Z, f"beta={beta} loss")
        for name, g, r, unit in zip(("dh", "dW", "db"), grads, ref_grads, grad_units, strict=True):
            err = float((g.double() - r).abs().max())
            assert err <= 3 * EPS32 * Z**2 * unit, f"beta={beta} {name}: {err:.3e}"


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_without_grad_gives_the_same_statistics(backend):
    x = make_inputs(seed=4)
    kw = dict(beta=0.5, chunk_rows=7)
    with_grad, _ = run(x, torch.float32, backend, **kw)
    with torch.no_grad():
        plain, _ = run(x, torch.float32, backend, grads=False, **kw)
    assert not plain.loss.requires_grad
    for f in FIELDS:
        torch.testing.assert_close(getattr(plain, f), getattr(with_grad, f).detach(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ the fused kernels
def fused_case(x, beta, T=0.7, softcap=3.0):
    """Keyword arguments of ``fused_dense_teacher_jsd`` for the inputs ``x`` and the float64 per-row oracle: the
    torch path's :func:`fastdistill.loss.dense.dense_rows` (itself checked against the dense reference)."""
    from fastdistill_kernels.dense_chunk import DenseHeads

    from fastdistill.loss.dense import Head, dense_rows

    t_cap = None if softcap is None else 4.0
    heads = DenseHeads(1.2, softcap, 0.9, t_cap, T)
    oracle = dense_rows(x["hs"], x["ws"], x["bs"], x["ht"], x["wt"], x["bt"], Head(1.2, softcap, T),
                        Head(0.9, t_cap, T), beta, need_dh=True, need_dw=True, need_db=True,
                        row_weights=x["token_weights"])
    return heads, oracle


def call_fused(x, heads, beta, dtype=torch.float32, **kw):
    """Per-row outputs of the fused kernels and the gradients of Σ w·div (w = the inputs' token weights)."""
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    hs, ws, bs = (x[k].to(dtype).requires_grad_() for k in ("hs", "ws", "bs"))
    out = fused_dense_teacher_jsd(hs, ws, x["ht"].to(dtype), x["wt"].to(dtype), student_bias=bs,
                                  teacher_bias=x["bt"].to(dtype), heads=heads, beta=beta, **kw)
    grads = torch.autograd.grad((out.divergence * x["token_weights"].to(dtype)).sum(), (hs, ws, bs))
    return out, grads


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["deterministic", "fused"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_kernels_match_the_float64_rows_in_both_backward_modes(mode, beta):
    """70 rows (three 32-row blocks), V_s = 150 (three 64-column tiles in two vocabulary splits), a padded teacher
    (V_t = 170), biases, softcaps, a temperature and a per-row upstream gradient (the token weights)."""
    x = make_inputs(seed=31 + int(10 * beta), N=70, V=150, Vt=170)
    heads, (div, ent, tent, dropped, dh, dw, db) = fused_case(x, beta)
    out, grads = call_fused(x, heads, beta, backward_mode=mode)
    tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, 0.7)
    for name, a, b in (("divergence", out.divergence, div), ("entropy", out.entropy, ent),
                       ("teacher_entropy", out.teacher_entropy, tent), ("dropped", out.dropped, dropped),
                       ("dh", grads[0], dh), ("dW", grads[1], dw), ("db", grads[2], db)):
        assert a.dtype == torch.float32, name
        rel_close(a, b, tol, name)
    assert float(dropped.min()) > 0  # the padded columns carry mass


@pytest.mark.interpreter
def test_fused_deterministic_mode_is_bitwise_reproducible_and_tiling_invariant():
    """The same inputs give the same bits; one vocabulary tile per backward chunk and one or three forward splits
    give the same values within fp32 rounding."""
    from fastdistill_kernels.config import INTERPRETER_TILES

    x = make_inputs(seed=5, N=40, V=150, Vt=150)
    heads, _ = fused_case(x, 0.5)
    first = call_fused(x, heads, 0.5)
    again = call_fused(x, heads, 0.5)
    for a, b in zip((*first[0], *first[1]), (*again[0], *again[1]), strict=True):
        assert torch.equal(a, b)
    tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, 0.7)
    for cfg in (dataclasses.replace(INTERPRETER_TILES, vocab_splits=1, workspace_bytes=1),
                dataclasses.replace(INTERPRETER_TILES, vocab_splits=3)):
        other = call_fused(x, heads, 0.5, config=cfg)
        for name, a, b in zip(("div", "ent", "tent", "dropped", "dh", "dW", "db"), (*other[0], *other[1]),
                              (*first[0], *first[1]), strict=True):
            rel_close(a, b, tol, name)


@pytest.mark.interpreter
def test_fused_gradients_only_where_asked_and_never_to_the_teacher():
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    x = make_inputs(seed=6, N=9, V=70, Vt=70)
    ws = x["ws"].float().requires_grad_()
    ht, wt = x["ht"].float().requires_grad_(), x["wt"].float().requires_grad_()
    out = fused_dense_teacher_jsd(x["hs"].float(), ws, ht, wt, beta=1.0)
    out.divergence.sum().backward()
    assert ws.grad is not None and ht.grad is None and wt.grad is None
    ref = dense_rows_sum_grad_w(x)
    rel_close(ws.grad, ref, 3 * EPS32 * logit_error_scale(x), "dW")


def dense_rows_sum_grad_w(x):
    from fastdistill.loss.dense import Head, dense_rows

    return dense_rows(x["hs"], x["ws"], None, x["ht"], x["wt"], None, Head(1.0, None, 1.0), Head(1.0, None, 1.0),
                      1.0, need_dh=False, need_dw=True, need_db=False)[5]


@pytest.mark.interpreter
def test_fused_without_rows_returns_empty_results_and_zero_gradients():
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    hs, ws = torch.zeros(0, 8, requires_grad=True), torch.randn(70, 8, requires_grad=True)
    out = fused_dense_teacher_jsd(hs, ws, torch.zeros(0, 6), torch.randn(70, 6), beta=0.5)
    assert all(t.shape == (0,) for t in out)
    dh, dw = torch.autograd.grad(out.divergence.sum(), (hs, ws), allow_unused=True)
    assert dh.shape == (0, 8) and float(dw.abs().max()) == 0.0


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), v=st.integers(1, 140), pad=st.integers(0, 70), ds=st.integers(1, 40),
       dt=st.integers(1, 40), beta=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), temperature=st.floats(0.5, 2.0),
       softcap=st.sampled_from([None, 2.5]), seed=st.integers(0, 2**16))
def test_fused_kernels_match_the_float64_rows_on_any_shape(n, v, pad, ds, dt, beta, temperature, softcap, seed):
    """Shapes that are no tile multiples (a single row, a single vocabulary entry, hidden sizes below one step)."""
    x = make_inputs(seed=seed, N=n, Ds=ds, Dt=dt, V=v, Vt=v + pad)
    heads, (div, ent, tent, dropped, dh, dw, db) = fused_case(x, beta, T=temperature, softcap=softcap)
    out, grads = call_fused(x, heads, beta)
    tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, temperature)
    for name, a, b in (("divergence", out.divergence, div), ("entropy", out.entropy, ent),
                       ("teacher_entropy", out.teacher_entropy, tent), ("dropped", out.dropped, dropped),
                       ("dh", grads[0], dh), ("dW", grads[1], dw), ("db", grads[2], db)):
        if float(b.abs().max()) > 0:  # V = 1: every divergence, entropy and gradient is exactly 0
            rel_close(a, b, tol, name)
        else:
            assert float(a.detach().abs().max()) <= tol, name


@pytest.mark.interpreter
def test_fused_bfloat16_teacher_rows_with_a_float32_student():
    """The trainer's case: bfloat16 teacher rows as served, a float32 student; the oracle gets the same rounded rows."""
    x = make_inputs(seed=8, N=33, V=100, Vt=110)
    for k in ("ht", "wt", "bt"):
        x[k] = x[k].bfloat16().double()
    heads, (div, ent, tent, dropped, dh, dw, db) = fused_case(x, 0.0)
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    hs, ws, bs = (x[k].float().requires_grad_() for k in ("hs", "ws", "bs"))
    out = fused_dense_teacher_jsd(hs, ws, x["ht"].bfloat16(), x["wt"].bfloat16(), student_bias=bs,
                                  teacher_bias=x["bt"].bfloat16(), heads=heads, beta=0.0)
    grads = torch.autograd.grad((out.divergence * x["token_weights"].float()).sum(), (hs, ws, bs))
    tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, 0.7)
    for name, a, b in (("divergence", out.divergence, div), ("teacher_entropy", out.teacher_entropy, tent),
                       ("dropped", out.dropped, dropped), ("dh", grads[0], dh), ("dW", grads[1], dw)):
        rel_close(a, b, tol, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("change,message", [
    (dict(hs=torch.zeros(4, 8, dtype=torch.float64)), "student_hidden must be float32, bfloat16 or float16"),
    (dict(wt=torch.zeros(70, 5)), r"teacher hidden \(N, D\) and weight \(V, D\) disagree: \(4, 6\), \(70, 5\)"),
    (dict(bs=torch.zeros(69)), r"student bias must have shape \(70,\), got \(69,\)"),
    (dict(ht=torch.zeros(3, 6)), "teacher_hidden has 3 rows, student_hidden 4"),
    (dict(wt=torch.zeros(60, 6)), "teacher_weight has 60 vocabulary rows, fewer than the student's 70"),
    (dict(backward_mode="atomic"), r"backward_mode must be one of \('deterministic', 'fused'\), got 'atomic'"),
])
def test_fused_refuses_bad_inputs_with_a_reason(change, message):
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    args = dict(hs=torch.zeros(4, 8), ws=torch.zeros(70, 8), ht=torch.zeros(4, 6), wt=torch.zeros(70, 6), bs=None,
                backward_mode="deterministic")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fused_dense_teacher_jsd(args["hs"], args["ws"], args["ht"], args["wt"], student_bias=args["bs"],
                                backward_mode=args["backward_mode"])


def test_fused_needs_cuda_or_the_interpreter(monkeypatch):
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1"):
        fused_dense_teacher_jsd(torch.zeros(4, 8), torch.zeros(70, 8), torch.zeros(4, 6), torch.zeros(70, 6))


# ------------------------------------------------------------------------------------------------ compiled on a GPU
CUDA_COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
# Loss and gradients against the fp32 torch path on the same inputs. bf16 / fp16 round each raw logit of both sides
# once (2^-9 / 2^-12 relative, |x| ≲ 4 here): an error δ ≈ 8e-3 / 1e-3 shifts p by p·δ, and the gradient p − q
# (β = 0) is smaller than p where the two distributions agree, so its relative error is several δ. Measured in the
# CPU interpreter at N = 64, V = 1003 (bf16 loads, fp32 arithmetic): loss ≤ 4e-4 / 2e-5, gradients ≤ 2.4e-2 / 2.4e-3.
GPU_LOSS_RTOL = {torch.float32: 5e-5, torch.bfloat16: 5e-3, torch.float16: 1e-3}
GPU_GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@pytest.mark.skipif(not CUDA_COMPILED, reason="the compiled kernels need a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,T,softcap", [(0.0, 1.0, None), (0.5, 0.7, 3.0), (1.0, 1.3, 3.0)])
def test_compiled_path_matches_the_torch_path(backend, dtype, beta, T, softcap):
    """N, D, V no tile multiples, a padded teacher, bias, token weights, several chunks, on CUDA."""
    x = {k: v.cuda() for k, v in make_inputs(seed=21, N=333, Ds=64, Dt=48, V=5003, Vt=5067).items()}
    kw = dict(beta=beta, temperature=T, student_softcap=softcap, teacher_softcap=None if softcap is None else 4.0,
              student_logit_scale=1.2, teacher_logit_scale=0.9, chunk_rows=128)
    ref, ref_grads = run(x, torch.float32, "torch", **kw)
    xd = {k: v.to(dtype) if v.is_floating_point() and k != "token_weights" else v for k, v in x.items()}
    out, grads = run(xd, dtype, backend, **kw)
    for f in FIELDS:
        rel_close(getattr(out, f).float(), getattr(ref, f), GPU_LOSS_RTOL[dtype], f)
    for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
        assert g.dtype == dtype
        rel_close(g.float(), r, GPU_GRAD_RTOL[dtype], name)


@pytest.mark.skipif(not CUDA_COMPILED, reason="the compiled kernels need a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_compiled_peak_memory_does_not_grow_with_rows_times_vocabulary(backend):
    """Doubling N (8192 → 16384 rows, V = 32768, bf16) adds the O(N·D) buffers only: far less than the N×V bf16
    logits (512 MiB) that a materialising loss would add; the workspaces and chunk buffers are bounded."""
    from fastdistill import dense_teacher_jsd_loss

    V, D = 32768, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = (torch.randn(V, D, generator=g, device="cuda") / D**0.5).bfloat16().requires_grad_()
    wt = (torch.randn(V, D, generator=g, device="cuda") / D**0.5).bfloat16()
    extra = {}
    for n in (8192, 16384):
        hs = torch.randn(n, D, generator=g, device="cuda").bfloat16().requires_grad_()
        ht = torch.randn(n, D, generator=g, device="cuda").bfloat16()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = dense_teacher_jsd_loss(hs, ws, ht, wt, beta=0.5, backend=backend)
        out.loss.backward()
        torch.cuda.synchronize()
        extra[n] = torch.cuda.max_memory_allocated() - base
        del out, hs, ht
        ws.grad = None
    growth = extra[16384] - extra[8192]
    assert growth < 8192 * V * 2 / 8, (extra, growth)
