"""fastdistill's Triton kernels: fused lm_head + sparse candidates + tail bucket + generalized JSD.

Self-contained (imports only torch and triton). Runs on CUDA GPUs and, for tests, in Triton's CPU interpreter
(``TRITON_INTERPRET=1``). Entry points: :func:`fused_sparse_jsd` (no logits materialised, 8·N·D·V FLOPs) and
:func:`chunked_logits_sparse_jsd` (cuBLAS logits per row chunk + two Triton passes, 6·N·D·V FLOPs); against a dense
teacher's lm_head, :func:`fused_dense_teacher_jsd` (both heads fused into the tiles, no logits in memory) and
:func:`chunked_dense_teacher_jsd` (the chunked-logits design). The per-row
bucket math (:mod:`fastdistill_kernels.buckets`) needs only torch and is shared with fastdistill's torch path, so the
Triton-backed names are imported lazily: ``import fastdistill_kernels`` works without triton installed.
"""

from importlib import import_module

from .buckets import bucket_divergence, logit_gradients

# Which designs have run on a real GPU is recorded per design, keyed by its modules' sources, the triton version and
# the launch patterns that ran, in validated.json (:mod:`fastdistill_kernels.validation`, written from a passing
# benchmarks/gpu_check.py run). fastdistill's ``backend="auto"`` picks only validated designs; ``backend="triton"`` /
# ``"triton-chunked"`` always select theirs. ``KERNELS_VALIDATED_ON_GPU`` is True when every design matches the
# record (computed once per process, as the record is read once: neither changes under a running process).

_LAZY = {
    "BACKWARD_MODES": ".backward",
    "SortedCandidates": ".candidates",
    "sort_candidates": ".candidates",
    "TileConfig": ".config",
    "default_config": ".config",
    "FusedSparseJSD": ".ops",
    "RowLosses": ".ops",
    "fused_sparse_jsd": ".ops",
    "ChunkedLosses": ".logits_chunk",
    "chunked_logits_sparse_jsd": ".logits_chunk",
    "DenseChunkedLosses": ".dense_chunk",
    "DenseHeads": ".dense_chunk",
    "chunked_dense_teacher_jsd": ".dense_chunk",
    "DenseRowLosses": ".dense_fused",
    "fused_dense_teacher_jsd": ".dense_fused",
    "DESIGNS": ".validation",
    "design_code_key": ".validation",
    "is_validated": ".validation",
    "launch_pattern": ".validation",
    "validated_designs": ".validation",
}

__all__ = ["KERNELS_VALIDATED_ON_GPU", "bucket_divergence", "logit_gradients", *_LAZY]


def __getattr__(name: str):
    if name == "KERNELS_VALIDATED_ON_GPU":
        validation = import_module(".validation", __name__)
        return validation.validated_designs() == frozenset(validation.DESIGNS)
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
