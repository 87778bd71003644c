"""The enumerated option values of servers, rollouts, weight sync and the teacher cache, spelled once: the configs
check against them and the command line offers them as ``choices=`` (the loss's own are in
:mod:`fastdistill.loss.options`). Imports nothing, so the command line and the torch-free rollout child read it
at no cost."""

from __future__ import annotations

# what a teacher server returns: its top-K prompt_logprobs, or every token's final hidden state
TEACHER_SIGNALS = ("topk", "hidden")
# the wire dtype of a hidden-state teacher's rows
HIDDEN_DTYPES = ("bfloat16", "float32")
# which ids per completion position the teacher also scores for the student-side estimators: none, N draws from the
# rollout policy μ (the realised token first), or the rollout student's top-N ids
QUERY_KINDS = ("none", "samples", "topk")
# how the rollout asks the student for a completion: vLLM's /v1/completions (TRL's, any vLLM) or its token-in/token-out
# /inference/v1/generate (--enable-scale-out), whose answer labels each token with the weights that generated it
STUDENT_ROUTES = ("completions", "generate")
# the engines that move the weights into the student server: gloo (CPU servers) or NCCL (GPU servers)
TRANSFER_BACKENDS = ("gloo", "nccl")
# weight_sync_backend and `fastdistill serve-student --weight-transfer`: auto (NCCL with CUDA, gloo without), one of
# the engines, or none
SYNC_BACKENDS = ("auto", *TRANSFER_BACKENDS, "none")
# the teacher cache's candidates per position: the teacher's top-K, or draws from its full distribution
CANDIDATE_MODES = ("topk", "sampled")
# the teacher cache's stored log-prob precision
LOGPROB_DTYPES = ("float16", "bfloat16")
