"""The losses: sparse generalized JSD (public API, torch paths), the dense-teacher generalized JSD, the reverse-KL
policy gradient and its stabilizers, the student-side query estimators, sampled teacher candidates, normalisation, and
the on-policy levers (IW-OPD position weights, TOP-D's bounded-reward advantages)."""

from .api import SparseJSDOutput, sparse_jsd_loss
from .dense import DenseJSDOutput, dense_teacher_jsd_loss
from .estimators import ESTIMATORS, EstimatorOutput, query_reverse_kl_loss
from .normalization import scored_positions, window_loss_scale, window_token_count
from .opd_levers import position_weights, topd_advantages
from .policy_gradient import (
    PG_STABILIZERS,
    PolicyGradientOutput,
    importance_ratios,
    reverse_kl_pg_loss,
    sampled_token_logprobs,
    stabilized_ratios,
)
from .sampled import (
    SampledCandidates,
    SampledKDOutput,
    candidates_from_draws,
    sample_teacher_candidates,
    sampled_kd_loss,
)
from .support import fold_out_of_vocab, narrow_support

__all__ = [
    "ESTIMATORS",
    "PG_STABILIZERS",
    "DenseJSDOutput",
    "EstimatorOutput",
    "PolicyGradientOutput",
    "SampledCandidates",
    "SampledKDOutput",
    "SparseJSDOutput",
    "candidates_from_draws",
    "dense_teacher_jsd_loss",
    "fold_out_of_vocab",
    "importance_ratios",
    "narrow_support",
    "position_weights",
    "query_reverse_kl_loss",
    "reverse_kl_pg_loss",
    "sample_teacher_candidates",
    "sampled_kd_loss",
    "sampled_token_logprobs",
    "scored_positions",
    "stabilized_ratios",
    "topd_advantages",
    "sparse_jsd_loss",
    "window_loss_scale",
    "window_token_count",
]
