"""The chunked-logits Triton path (``backend="triton-chunked"``, ``fastdistill_kernels.chunked_logits_sparse_jsd``).

Without CUDA the two Triton passes run in the CPU interpreter on tiny shapes (N=40, D=32, V=200, vocabulary blocks
of 64 columns, chunks forced to 16 rows so that every call walks several chunks), against the float64 dense
reference: loss, metrics, dh, dW and db. With CUDA the ``cuda_compiled`` tests compare the compiled path with the
torch path. The compile test AOT-compiles both kernels for sm_80 / sm_90 in bf16 at a Qwen-like chunk in a
subprocess (this session runs Triton in its interpreter, which replaces ``@triton.jit`` kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported: kernels run on the CPU
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

import fastdistill_kernels  # noqa: E402
from fastdistill_kernels import chunked_logits_sparse_jsd, logits_chunk  # noqa: E402
from loss_cases import make_case, rel_close  # noqa: E402

import fastdistill.loss.api as api  # noqa: E402
import fastdistill.loss.routing as routing  # noqa: E402
from fastdistill import sparse_jsd_loss  # noqa: E402
from fastdistill.loss.chunked import LossConfig  # noqa: E402
from fastdistill.loss.support import canonical_mask  # noqa: E402

cuda_compiled = pytest.mark.skipif(not CUDA or INTERPRETER, reason="the compiled kernels need a CUDA GPU "
                                   "(and TRITON_INTERPRET unset)")

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher")
FP32_RTOL = 1e-5
# Half precision: the raw logits are rounded once to the dtype (the GEMM output), and dL/dx is rounded to it for the
# dh / dW GEMMs, as on a GPU. Measured against the float64 reference of the rounded inputs: loss and metrics
# ≤ 1.1e-4 (bf16) / 3.4e-5 (fp16), gradients ≤ 8.2e-3 / 1.4e-3 of their largest entry; about 2× margin here.
HALF_LOSS_RTOL = {torch.bfloat16: 2.5e-4, torch.float16: 7e-5}
HALF_GRAD_RTOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
CHUNK = 16  # rows per chunk in the interpreter tests: N = 40 → chunks of 16, 16, 8


def _case(seed: int, **kw):
    """N=40, D=32, V=200 (not a multiple of the 64-column block), K=5 (+ the realised token), 3 rows unscored."""
    return make_case(seed=seed, N=40, D=32, V=200, K=5, empty_rows=3, **kw)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


def _chunked(h, w, b, ids, lps, mask, *, chunk_rows=CHUNK, teacher_index=None, num_teachers=1, token_weights=None,
             **kw):
    """``sparse_jsd_loss(..., backend="triton-chunked")`` with a forced chunk size (the API's validation first)."""
    api._validate(h, w, b, ids, lps, mask, kw.get("logit_scale", 1.0), kw.get("softcap"), kw.get("beta", 0.0),
                  kw.get("temperature", 1.0), kw.get("add_tail_bucket", True), kw.get("tail_mode", "exact"),
                  teacher_index, num_teachers, "triton-chunked")
    cfg = LossConfig(logit_scale=kw.get("logit_scale", 1.0), softcap=kw.get("softcap"), beta=kw.get("beta", 0.0),
                     temperature=kw.get("temperature", 1.0), add_tail_bucket=kw.get("add_tail_bucket", True),
                     tail_mode=kw.get("tail_mode", "exact"))
    return api._triton_chunked_sparse_jsd(h, w, b, ids, lps, mask, cfg, teacher_index, num_teachers, token_weights,
                                          chunk_rows=chunk_rows)


def _reference(h, w, b, ids, lps, mask, **kw):
    """The float64 dense reference of the (rounded) inputs and its gradients."""
    leaves = [None if x is None else x.detach().double().requires_grad_(True) for x in (h, w, b)]
    ref = sparse_jsd_loss(*leaves[:2], ids, lps, mask, bias=leaves[2], backend="reference", **kw)
    return ref, _grads(ref.loss, leaves)


GRID = [
    # beta, add_tail_bucket, tail_mode, softcap, temperature, logit_scale, bias, token weights
    (0.0, True, "exact", None, 1.0, 1.0, True, False),
    (0.0, True, "trl", 4.0, 0.7, 1.5, False, True),
    (0.0, False, "exact", None, 1.3, 1.5, True, False),
    (0.5, True, "exact", 4.0, 1.3, 1.5, True, True),
    (0.5, True, "trl", None, 0.7, 1.0, True, False),
    (0.5, False, "exact", 4.0, 1.0, 1.5, False, True),
    (1.0, True, "exact", None, 0.7, 1.5, True, True),
    (1.0, True, "trl", 4.0, 1.3, 1.0, True, False),
]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("beta,tail,mode,softcap,T,scale,bias,weighted", GRID)
def test_matches_float64_reference(beta, tail, mode, softcap, T, scale, bias, weighted):
    """Padded, duplicated and masked slots, unscored rows, two teachers, three chunks; fp32."""
    case = _case(seed=int(beta * 10) + int(T * 7) + 3 * bias)
    ids, lps, mask = case.narrowed(beta)
    kw = dict(beta=beta, temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=scale,
              teacher_index=case.teacher_index, num_teachers=2)
    weights = torch.rand(40, generator=torch.Generator().manual_seed(1)) * 2 if weighted else None
    h, w, b = case.leaves(bias=bias)
    out = _chunked(h, w, b, ids, lps, mask, token_weights=weights, **kw)
    ref, ref_grads = _reference(h, w, b, ids, lps, mask, token_weights=weights, **kw)

    assert int(out.num_tokens) == int(ref.num_tokens) < 40
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), FP32_RTOL, f)
    for name, g, r, x in zip(("dh", "dW", "db"), _grads(out.loss, (h, w, b)), ref_grads, (h, w, b), strict=False):
        assert g.dtype == x.dtype
        rel_close(g, r, FP32_RTOL, name)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,softcap", [(0.0, None), (0.5, 4.0), (1.0, None)])
def test_half_precision_inputs_in_the_interpreter(dtype, beta, softcap):
    """bf16 / fp16 leaves: gradients come back in the leaves' dtype, close to float64 of the rounded inputs."""
    case = _case(seed=40 + int(10 * beta))
    ids, lps, mask = case.narrowed(beta)
    kw = dict(beta=beta, softcap=softcap, temperature=0.8, logit_scale=1.2)
    h, w, b = case.leaves(dtype)
    out = _chunked(h, w, b, ids, lps, mask, **kw)
    ref, ref_grads = _reference(h, w, b, ids, lps, mask, **kw)
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), HALF_LOSS_RTOL[dtype], f)
    for name, g, r, x in zip(("dh", "dW", "db"), _grads(out.loss, (h, w, b)), ref_grads, (h, w, b), strict=True):
        assert g.dtype == x.dtype
        rel_close(g, r, HALF_GRAD_RTOL[dtype], name)


@pytest.mark.interpreter
@pytest.mark.parametrize("tail_mode", ["exact", "trl"])
def test_rows_whose_candidates_cover_the_vocabulary(tail_mode):
    """No non-candidate column in rows 0..2 (exact tail bucket absent), a real tail in rows 3..5; V = 70 spans two
    vocabulary blocks, chunks of 4 rows."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 6, 32, 70
    h = torch.randn(N, D, generator=g).requires_grad_(True)
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_(True)
    b = (0.1 * torch.randn(V, generator=g)).requires_grad_(True)
    teacher = torch.log_softmax(torch.randn(N, V, generator=g), dim=-1)
    ids = torch.randperm(V, generator=g).repeat(N, 1)
    mask = torch.ones(N, V, dtype=torch.bool)
    mask[3:, 5:] = False
    for beta in (0.0, 0.5, 1.0):
        kw = dict(beta=beta, tail_mode=tail_mode, softcap=3.0, temperature=1.1)
        out = _chunked(h, w, b, ids, teacher, mask, chunk_rows=4, **kw)
        ref, ref_grads = _reference(h, w, b, ids, teacher, mask, **kw)
        for f in FIELDS:
            rel_close(getattr(out, f), getattr(ref, f), FP32_RTOL, f"{f}, beta={beta}")
        for name, a, r in zip(("dh", "dW", "db"), _grads(out.loss, (h, w, b)), ref_grads, strict=True):
            rel_close(a, r, FP32_RTOL, f"{name}, beta={beta}")


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("chunk_rows", [1, 7, 40, None])
def test_chunk_size_does_not_change_the_result(chunk_rows):
    """One row per chunk, uneven chunks, one chunk, the default rule: the same loss and gradients."""
    case = _case(seed=12)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves()
    out = _chunked(h, w, b, ids, lps, mask, chunk_rows=chunk_rows, softcap=5.0)
    h2, w2, b2 = case.leaves()
    base = _chunked(h2, w2, b2, ids, lps, mask, chunk_rows=CHUNK, softcap=5.0)
    rel_close(out.loss, base.loss, 1e-6, "loss")
    for name, a, r in zip(("dh", "dW", "db"), _grads(out.loss, (h, w, b)), _grads(base.loss, (h2, w2, b2)),
                          strict=True):
        rel_close(a, r, 1e-6, name)


def test_chunk_rows_rule():
    """At most 4096 rows, at most N, the (C, V) buffer within the byte budget, at least one row."""
    assert logits_chunk.chunk_rows_for(10**6, 32000, torch.float32) == 4096  # 500 MiB of fp32
    assert logits_chunk.chunk_rows_for(10**6, 152064, torch.float32) == 960 * 2**20 // (152064 * 4) == 1654
    assert logits_chunk.chunk_rows_for(100, 152064, torch.bfloat16) == 100
    assert logits_chunk.chunk_rows_for(100, 10**9, torch.float32) == 1


@pytest.mark.interpreter
def test_only_the_weighted_sum_is_differentiable():
    """Gradients are computed in the forward for ``loss``: any scalar upstream gradient works, a gradient through
    the per-row divergences (a non-scalar upstream) raises a clear error."""
    case = _case(seed=8)
    ids, lps, mask = case.narrowed(0.5)
    valid = canonical_mask(ids, lps, mask)
    keep = valid.any(dim=1)
    h, w, b = case.leaves()
    h = h[keep].detach().requires_grad_(True)
    out = chunked_logits_sparse_jsd(h, w, ids[keep], lps[keep], valid[keep], bias=b, beta=0.5, chunk_rows=CHUNK)
    base = chunked_logits_sparse_jsd(h, w, ids[keep], lps[keep], valid[keep], bias=b, beta=0.5, chunk_rows=CHUNK)
    base.loss.backward()
    dh = h.grad.clone()
    h.grad = None
    (2.5 * out.loss).backward(retain_graph=True)
    torch.testing.assert_close(h.grad, 2.5 * dh)
    # the gradients were scaled in place and handed over: a second backward of the same loss raises
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()
    with pytest.raises(RuntimeError, match="non-scalar upstream gradient"):
        (out.divergence * torch.linspace(0, 1, h.shape[0])).sum().backward()
    assert not out.entropy.requires_grad and not out.teacher_entropy.requires_grad


@pytest.mark.interpreter
def test_only_requested_gradients_are_computed():
    case = _case(seed=9)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves()
    w.requires_grad_(False)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, backend="triton-chunked")
    out.loss.backward()
    assert w.grad is None and h.grad is not None and b.grad is not None


def test_public_api_routes_the_backend_name(monkeypatch):
    """``backend="triton-chunked"`` reaches the chunked-logits path, for CPU and (claimed) CUDA tensors alike."""
    taken = []
    monkeypatch.setattr(api, "_triton_chunked_sparse_jsd", lambda *a, **k: taken.append("chunked") or "sentinel")
    monkeypatch.setattr(api, "_triton_sparse_jsd", lambda *a, **k: taken.append("triton"))
    monkeypatch.setattr(api, "torch_sparse_jsd", lambda *a, **k: taken.append("torch"))
    case = _case(seed=2)
    args = (*case.leaves()[:2], *case.narrowed(0.0))
    assert "triton-chunked" in api.BACKENDS
    assert sparse_jsd_loss(*args, backend="triton-chunked") == "sentinel"
    monkeypatch.setattr(routing, "_is_cuda", lambda x: True)
    sparse_jsd_loss(*args, backend="triton-chunked")
    assert taken == ["chunked", "chunked"]


def test_cpu_tensors_without_the_interpreter_get_the_triton_backends_error(monkeypatch):
    case = _case(seed=2)
    args = (*case.leaves()[:2], *case.narrowed(0.0))
    with pytest.raises(ValueError, match="takes float32, bfloat16 or float16 hidden"):
        sparse_jsd_loss(args[0].double(), *args[1:], backend="triton-chunked")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    messages = []
    for backend in ("triton", "triton-chunked"):
        with pytest.raises(ValueError, match="use CUDA tensors, or set TRITON_INTERPRET=1") as err:
            sparse_jsd_loss(*args, backend=backend)
        messages.append(str(err.value).replace(repr(backend), "<backend>"))
    assert messages[0] == messages[1]
    with pytest.raises(ValueError, match="need CUDA tensors, or TRITON_INTERPRET=1"):  # the op itself
        chunked_logits_sparse_jsd(args[0], args[1], args[2].clamp_min(0), args[3], args[4])


def test_kernel_package_does_not_import_fastdistill():
    source = (ROOT / "kernels" / "fastdistill_kernels" / "logits_chunk.py").read_text()
    assert "import fastdistill" not in source and "from fastdistill " not in source
    assert fastdistill_kernels.chunked_logits_sparse_jsd is chunked_logits_sparse_jsd


# ------------------------------------------------------------------------------------------------ compiled on a GPU
GPU_VARIANTS = [
    # beta, add_tail_bucket, tail_mode, softcap, temperature, bias
    (0.0, True, "exact", None, 1.0, True),
    (0.5, True, "trl", 4.0, 0.7, False),
    (1.0, True, "exact", 4.0, 1.3, True),
    (0.5, False, "exact", None, 1.0, True),
]
GPU_LOSS_RTOL = {torch.float32: 5e-5, torch.bfloat16: 1e-3, torch.float16: 2e-4}
GPU_GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@cuda_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,tail,mode,softcap,T,bias", GPU_VARIANTS)
def test_compiled_path_matches_the_torch_path(dtype, beta, tail, mode, softcap, T, bias):
    """Loss, metrics, dh, dW and db on CUDA against the torch path on the same inputs (N, D, V no tile multiples;
    token weights; several chunks)."""
    case = make_case(seed=int(10 * beta) + 3, N=333, D=192, V=5003, K=8, empty_rows=4)
    ids, lps, mask = (x.cuda() for x in case.narrowed(beta))
    h, w, b = (x.detach().cuda().requires_grad_(True) for x in case.leaves(dtype))
    b = b if bias else None
    weights = torch.rand(333, device="cuda") * 2
    kw = dict(beta=beta, temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=1.5,
              teacher_index=case.teacher_index.cuda(), num_teachers=2, token_weights=weights)
    out = _chunked(h, w, b, ids, lps, mask, chunk_rows=128, **kw)
    refs = [None if x is None else x.detach().clone().requires_grad_(True) for x in (h, w, b)]
    ref = sparse_jsd_loss(refs[0], refs[1], ids, lps, mask, bias=refs[2], backend="torch", **kw)
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), GPU_LOSS_RTOL[dtype], f)
    for name, g, r in zip(("dh", "dW", "db"), _grads(out.loss, (h, w, b)), _grads(ref.loss, refs), strict=False):
        rel_close(g, r, GPU_GRAD_RTOL[dtype], name)


# ------------------------------------------------------------------------------------------------ AOT compile
COMPILE_SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path

ROOT = Path(sys.argv[1])
sys.path.insert(0, str(ROOT / "kernels"))
spec = importlib.util.spec_from_file_location("compile_report", ROOT / "benchmarks" / "compile_report.py")
cr = importlib.util.module_from_spec(spec)
sys.modules["compile_report"] = cr
spec.loader.exec_module(cr)
problem = cr.toolchain_problem()
if problem:
    print(problem, file=sys.stderr)
    sys.exit(2)
jobs = []  # (key, launch, target), compiled together at the end (cr.compile_launches: one per core)
for tname in cr.selected_targets():
    target = cr.TARGETS[tname]
    launches = cr.record_chunk_launches("bf16", target)  # as chunked_logits_rows launches them
    assert [(f, launch.kernel) for f, launch in launches] == [
        (f, k) for f in ("plain", "bias+softcap") for k in ("_chunk_stats_kernel", "_chunk_grad_out_kernel")]
    jobs += [(f"{tname}/{features}/{launch.kernel}", launch, target) for features, launch in launches]
out = {}
for (key, launch, target), m in zip(jobs, cr.compile_launches([job[1:] for job in jobs]), strict=True):
    row = {k: m.get(k) for k in ("error", "registers", "spill_store_bytes", "spill_load_bytes",
                                 "stack_frame_bytes", "shared_bytes", "static_shared_bytes", "num_warps")}
    row["sass_spill_store"] = m.get("sass", {}).get("spill_store")
    row["sass_instructions"] = m.get("sass", {}).get("instructions")
    row["smem_limit"] = target.smem_per_block
    row["grid"] = list(launch.grid)
    out[key] = row
print(json.dumps(out))
"""


def compile_targets() -> tuple[str, ...]:
    """The GPU targets the compile tests check (``compile_report.selected_targets``: all, or
    ``$FASTDISTILL_COMPILE_TARGETS``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_report", ROOT / "benchmarks" / "compile_report.py")
    report = importlib.util.module_from_spec(spec)
    sys.modules["compile_report"] = report  # dataclasses look their module up
    spec.loader.exec_module(report)
    return report.selected_targets()


@pytest.fixture(scope="module")
def compiled() -> dict:
    """The kernels compiled for each selected target (sm_80, sm_90) by ``compile_report.record_chunk_launches``: the
    default chunk at N=16384 × V=152064, S=65, plain and bias+softcap, on fp32 logits with dL/dx in bf16 over them,
    as the chunked path launches them."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default a launch gets; silences triton 3.9's notice
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=600, env=env)
    if proc.returncode == 2:  # an unusable toolchain (no NVIDIA backend, no ptxas)
        pytest.skip(proc.stderr.strip()[-500:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.compile
@pytest.mark.parametrize("target", compile_targets())
@pytest.mark.parametrize("features", ["plain", "bias+softcap"])
@pytest.mark.parametrize("kernel", ["_chunk_stats_kernel", "_chunk_grad_out_kernel"])
def test_kernels_compile_for_gpu_targets(compiled, target, features, kernel):
    """Compiles; dynamic + static shared memory within the target's opt-in limit; no spills; one program per row."""
    m = compiled[f"{target}/{features}/{kernel}"]
    assert m["error"] is None, m["error"]
    assert m["registers"] > 0 and m["sass_instructions"] > 0
    assert m["shared_bytes"] + m["static_shared_bytes"] <= m["smem_limit"], m
    assert (m["spill_store_bytes"], m["spill_load_bytes"], m["sass_spill_store"]) == (0, 0, 0), m
    assert m["grid"] == [logits_chunk.chunk_rows_for(16384, 152064)]
