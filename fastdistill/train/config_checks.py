"""The config's field checks: the helpers that raise a :class:`ConfigError` naming the field, and the options of
the loss types (the policy-gradient stabilizers and the student queries the estimators read)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastdistill.errors import ConfigError
from fastdistill.loss.policy_gradient import PG_STABILIZERS
from fastdistill.rollout.behaviour import samples_route_problem

LOSS_TYPES = ("jsd", "reverse_kl_pg", "reverse_kl_mc", "reverse_kl_student_topk")
# the policy-gradient family (pg_stabilizer applies) and the loss types that read student queries, with their kind
PG_LOSS_TYPES = ("reverse_kl_pg", "reverse_kl_mc")
QUERY_LOSS_TYPES = {"reverse_kl_mc": "samples", "reverse_kl_student_topk": "topk"}


def validate_loss_options(config: Any) -> None:
    """The policy-gradient and student-query options of ``config`` against its ``loss_type`` (docs/loss.md,
    "Student-side reverse-KL estimators"); a ConfigError naming the field."""
    loss = config.loss_type
    ratio = loss == "reverse_kl_mc" or config.pg_importance_ratio  # reverse_kl_mc always weights by π_θ/μ
    clip = config.pg_ratio_clip
    check(clip is None or (number(clip) and clip > 0 and loss in PG_LOSS_TYPES and ratio), "pg_ratio_clip", clip,
          "None, or a number > 0 together with pg_importance_ratio=True (loss_type 'reverse_kl_pg') or with "
          "loss_type 'reverse_kl_mc'")
    choice(config, "pg_stabilizer", PG_STABILIZERS)
    stabilizer = config.pg_stabilizer
    if stabilizer != "none":
        check(loss in PG_LOSS_TYPES, "pg_stabilizer", stabilizer,
              f"'none' with loss_type={loss!r} (it stabilizes the policy-gradient family {list(PG_LOSS_TYPES)})")
        check(ratio, "pg_stabilizer", stabilizer, "'none' with loss_type='reverse_kl_pg' and "
              "pg_importance_ratio=False (a stabilizer acts on the importance ratio π_θ/μ)")
        check(clip is None, "pg_ratio_clip", clip,
              f"None with pg_stabilizer={stabilizer!r} (the stabilizer clips the ratio itself)")
    check(number(config.pg_clip_eps) and 0 < config.pg_clip_eps < 1, "pg_clip_eps", config.pg_clip_eps, "in (0, 1)")
    positive(config, "m2po_budget")
    queries = config.num_student_queries
    if loss in QUERY_LOSS_TYPES:
        check(is_int(queries) and queries >= 1, "num_student_queries", queries,
              f"an int >= 1 with loss_type={loss!r} (the ids per position it reads)")
        if loss == "reverse_kl_mc":
            problem = samples_route_problem(-1 if config.top_k == 0 else config.top_k, queries)
            check(problem is None, "top_k", config.top_k, f"a top-k with loss_type='reverse_kl_mc': {problem}")
    else:
        check(queries == 0, "num_student_queries", queries,
              f"0 with loss_type={loss!r} (only {list(QUERY_LOSS_TYPES)} read student queries)")


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check(ok: bool, name: str, value: Any, expected: str) -> None:
    """ConfigError ``<name> must be <expected>, got <value>`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def choice(config: Any, name: str, choices: Sequence[str]) -> None:
    """Field ``name`` of ``config`` is one of ``choices``."""
    value = getattr(config, name)
    check(value in choices, name, value, f"one of {list(choices)}")


def number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def value_range(config: Any, name: str, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Field ``name`` is a number in [low, high] (open ends as asked)."""
    value = getattr(config, name)
    ok = number(value) and (value > low if low_open else value >= low) and (value < high if high_open else
                                                                             value <= high)
    check(ok, name, value, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


def positive(config: Any, *names: str) -> None:
    """Each field of ``names`` is a finite number > 0."""
    for name in names:
        value = getattr(config, name)
        check(number(value) and value > 0, name, value, "a finite number > 0")


def at_least(config: Any, low: int, *names: str) -> None:
    """Each field of ``names`` is an int >= ``low``."""
    for name in names:
        value = getattr(config, name)
        check(is_int(value) and value >= low, name, value, f"an int >= {low}")
