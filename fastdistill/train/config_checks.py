"""The config's field checks: the helpers that raise a :class:`ConfigError` naming the field, the options of
the loss types (the policy-gradient stabilizers and the student queries the estimators read) and those of a
cross-tokenizer teacher (what it composes with)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastdistill.auth import check_api_keys, student_api_key_from_env, teacher_api_keys_with_env
from fastdistill.cross_tokenizer import check_teacher_tokenizers
from fastdistill.errors import ConfigError
from fastdistill.loss.opd_levers import POSITION_WEIGHTINGS
from fastdistill.loss.policy_gradient import PG_STABILIZERS
from fastdistill.rollout.behaviour import samples_route_problem
from fastdistill.rollout.horizon import HORIZON_SCHEDULES

LOSS_TYPES = ("jsd", "reverse_kl_pg", "reverse_kl_mc", "reverse_kl_student_topk", "topd_pg")
# the policy-gradient family (pg_stabilizer applies) and the loss types that read student queries, with their kind
PG_LOSS_TYPES = ("reverse_kl_pg", "reverse_kl_mc", "topd_pg")
# the losses on the sampled token alone (its teacher log-prob and rollout log-prob): the plain and TOP-D's advantage
SAMPLED_TOKEN_LOSS_TYPES = ("reverse_kl_pg", "topd_pg")
QUERY_LOSS_TYPES = {"reverse_kl_mc": "samples", "reverse_kl_student_topk": "topk"}
CROSS_TOKENIZER_LOSSES = ("hybrid", "uld")


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
            problem = samples_route_problem(config.top_k, queries)  # the rollout's own check (0: disabled)
            check(problem is None, "top_k", config.top_k, f"a top-k with loss_type='reverse_kl_mc': {problem}")
    else:
        check(queries == 0, "num_student_queries", queries,
              f"0 with loss_type={loss!r} (only {list(QUERY_LOSS_TYPES)} read student queries)")


def validate_teacher_cache(config: Any) -> None:
    """``teacher_cache`` replaces the servers: the options that need them, or the rollout policy's log-probs, are
    refused with the reason."""
    cache = config.teacher_cache
    value_range(config, "lmbda", 0.0, 1.0)
    check(config.lmbda == 0.0 or cache is not None, "lmbda", config.lmbda,
          "0.0 without teacher_cache (it is the on-policy share of a run that mixes in a teacher cache)")
    if config.lmbda_final is not None:
        value_range(config, "lmbda_final", 0.0, 1.0)
        check(cache is not None, "lmbda_final", config.lmbda_final,
              "None without teacher_cache (it is where the on-policy share of a run that mixes in a teacher "
              "cache ends)")
    if cache is None:
        return
    check(isinstance(cache, str) and cache != "", "teacher_cache", cache, "None or a cache folder path")
    why = "a cached completion was not sampled by the student: it has no rollout policy log-prob"
    check(config.train_dataset is None, "train_dataset", config.train_dataset,
          "None with teacher_cache (the cache holds the training rows, and their prompts when lmbda > 0)")
    check(config.loss_type == "jsd", "loss_type", config.loss_type, f"'jsd' with teacher_cache ({why})")
    check(config.stale_policy == "drop", "stale_policy", config.stale_policy, f"'drop' with teacher_cache ({why})")
    check(config.async_mode or not config.mixes_on_policy, "async_mode", config.async_mode,
          "True with teacher_cache and lmbda > 0 or lmbda_final > 0 (the mixed run takes its on-policy share "
          "from the rollout worker)")
    if not config.mixes_on_policy:  # the cache alone: no server at all
        check(config.eval_dataset is None, "eval_dataset", config.eval_dataset,
              "None with teacher_cache and lmbda=0 (held-out evaluation asks a student server serving the "
              "trained weights; evaluate the exported model with fastdistill eval, or set lmbda > 0)")
        check(not config.verify_weight_sync, "verify_weight_sync", config.verify_weight_sync,
              "False with teacher_cache and lmbda=0 (no student server is synced)")


def validate_opd_levers(config: Any) -> None:
    """The position weights (``position_weighting``, ``position_weight_gamma``), TOP-D's ``topd_alpha`` and the
    rollout horizon (``rollout_horizon``, ``rollout_horizon_schedule``, ``rollout_horizon_growth``; docs/loss.md and
    docs/rollout.md); a ConfigError naming the field, and the other option of a pair that cannot work."""
    choice(config, "position_weighting", POSITION_WEIGHTINGS)
    gamma = config.position_weight_gamma
    check(number(gamma) and gamma >= 0, "position_weight_gamma", gamma, "a finite number >= 0")
    check(config.position_weighting == "none" or config.teacher_cache is None, "position_weighting",
          config.position_weighting, "'none' with teacher_cache (a cached completion was not sampled by the "
          "student: it has no rollout policy log-prob to weigh the teacher against)")
    alpha = config.topd_alpha
    check(number(alpha) and 0 < alpha < 1, "topd_alpha", alpha, "a number in (0, 1) (TOP-D's proximal mix)")
    choice(config, "rollout_horizon_schedule", HORIZON_SCHEDULES)
    horizon, length = config.rollout_horizon, config.max_completion_length
    ok = horizon is None or (is_int(horizon) and 1 <= horizon <= length) or (
        isinstance(horizon, float) and 0 < horizon <= 1)
    check(ok, "rollout_horizon", horizon, f"None (max_completion_length), a token count in [1, max_completion_length="
          f"{length}] or a fraction of it in (0, 1] (a float)")
    growth = config.rollout_horizon_growth
    check(number(growth) and 0 < growth <= 1, "rollout_horizon_growth", growth,
          "a fraction of the run's steps in (0, 1]")


def validate_staleness(config: Any) -> None:
    """``freshness_weight`` and ``freshness_scale``, and ``weight_sync_steps`` against ``max_staleness`` (both in
    optimizer steps, docs/train.md "Staleness"): the
    served weights are up to ``weight_sync_steps − 1`` steps behind the trainer's when a rollout starts, so under
    ``stale_policy='drop'`` a wider gap than ``max_staleness`` would drop, and regenerate, samples for ever."""
    check(isinstance(config.freshness_weight, bool), "freshness_weight", config.freshness_weight, "a bool")
    scale = config.freshness_scale
    check(number(scale) and scale > 0, "freshness_scale", scale, "a finite number > 0 (nats of drift per e-fold)")
    check(not (config.freshness_weight and config.teacher_cache is not None), "freshness_weight",
          config.freshness_weight, "False with teacher_cache (a cached completion was not sampled by the student: it "
          "has no behaviour log-prob to measure the drift from)")
    gap = config.weight_sync_steps - 1
    check(config.stale_policy != "drop" or gap <= config.max_staleness, "weight_sync_steps", config.weight_sync_steps,
          f"at most max_staleness + 1 = {config.max_staleness + 1} with stale_policy='drop' (rollouts start on "
          f"weights up to weight_sync_steps - 1 = {gap} optimizer steps old, beyond max_staleness="
          f"{config.max_staleness}: every such sample would be dropped and generated again)")


def validate_cross_tokenizer(config: Any) -> None:
    """``teacher_tokenizers`` (by :func:`~fastdistill.cross_tokenizer.check_teacher_tokenizers`, the rules the
    rollout's config checks too), ``cross_tokenizer_loss`` and ``cross_tokenizer_weights``, and the trainer's options
    a cross-tokenizer teacher does not compose with (docs/train.md, "What composes"); a ConfigError naming both."""
    named = config.teacher_tokenizers
    choice(config, "cross_tokenizer_loss", CROSS_TOKENIZER_LOSSES)
    weights = config.cross_tokenizer_weights
    check(weights is None or (isinstance(weights, (list, tuple)) and len(weights) == 2
                              and all(number(w) and w >= 0 for w in weights) and sum(weights) > 0),
          "cross_tokenizer_weights", weights, "None (GOLD's adaptive weights) or [w_shared, w_unshared], two finite "
          "numbers >= 0, not both 0")
    if named is None or (isinstance(named, Mapping) and not named):
        check(config.cross_tokenizer_loss == "hybrid", "cross_tokenizer_loss", config.cross_tokenizer_loss,
              "'hybrid' (the default) without teacher_tokenizers (it is the loss of cross-tokenizer teachers' "
              "samples)")
        check(weights is None, "cross_tokenizer_weights", weights,
              "None without teacher_tokenizers (they weigh the loss of cross-tokenizer teachers' samples)")
        return
    cross = check_teacher_tokenizers(named, config.teacher_ids, hidden_ids=config.hidden_teacher_ids,
                                     student_queries=config.student_queries,
                                     signal_option=("teacher_signal", config.teacher_signal),
                                     queries_option=("loss_type", config.loss_type))
    what = f"with teacher_tokenizers (cross-tokenizer teachers {cross})"
    check(config.teacher_cache is None, "teacher_cache", config.teacher_cache,
          f"None {what}: a teacher cache stores candidate ids in the student's vocabulary")
    check(config.pg_stabilizer == "none", "pg_stabilizer", config.pg_stabilizer,
          f"'none' {what}: the group policy gradient has no stabilizer (pg_importance_ratio and pg_ratio_clip apply)")
    check(config.stale_policy == "drop", "stale_policy", config.stale_policy,
          f"'drop' {what}: the cross-tokenizer losses take no per-token importance weights")
    check(config.position_weighting == "none", "position_weighting", config.position_weighting,
          f"'none' {what}: the cross-tokenizer losses take no per-token weights")
    check(not config.freshness_weight, "freshness_weight", config.freshness_weight,
          f"False {what}: the cross-tokenizer losses take no per-token weights")
    check(config.loss_type != "topd_pg", "loss_type", config.loss_type,
          f"'jsd' or 'reverse_kl_pg' {what}: TOP-D's returns run over the student's tokens, the cross-tokenizer "
          "losses over aligned groups")
    check(config.add_tail_bucket, "add_tail_bucket", config.add_tail_bucket,
          f"True {what}: the cross-tokenizer JSD compares two distributions over the shared tokens plus an exact "
          "tail bucket on each side")
    check(config.tail_mode == "exact", "tail_mode", config.tail_mode,
          f"'exact' {what}: the cross-tokenizer JSD's tails are exact")
    if config.loss_type == "reverse_kl_pg":
        why = "with loss_type='reverse_kl_pg' (cross-tokenizer samples then take the group policy gradient)"
        check(config.cross_tokenizer_loss == "hybrid", "cross_tokenizer_loss", config.cross_tokenizer_loss,
              f"'hybrid' (the default) {why}")
        check(weights is None, "cross_tokenizer_weights", weights, f"None {why}")
    check(config.cross_tokenizer_loss == "hybrid" or weights is None, "cross_tokenizer_weights", weights,
          "None with cross_tokenizer_loss='uld' (ULD has one term)")


def validate_rank_heartbeat(config: Any) -> None:
    """``rank_heartbeat_timeout_s``: 0 (off) or a number below ``ddp_timeout``, so that a silent trainer rank is
    named before the collective timeout fires without a name (docs/multinode.md)."""
    heartbeat = config.rank_heartbeat_timeout_s
    check(number(heartbeat) and heartbeat >= 0, "rank_heartbeat_timeout_s", heartbeat,
          "a finite number >= 0 (0 turns the trainer ranks' heartbeat off)")
    check(heartbeat == 0 or heartbeat < config.ddp_timeout, "rank_heartbeat_timeout_s", heartbeat,
          f"below ddp_timeout ({config.ddp_timeout:g}) or 0: a silent rank must be named before the collective "
          "timeout fires without a name")


def validate_servers(config: Any) -> None:
    """The weight-sync rendezvous address and port, the API keys (a key left None is read from the environment or
    the key files ``fastdistill serve-*`` generated, :mod:`fastdistill.auth`; never quoted in an error) and the
    servers' URLs of ``config``; a ConfigError naming the field."""
    address = config.weight_sync_master_address
    check(address is None or (isinstance(address, str) and address != "" and not any(c in address for c in " /")),
          "weight_sync_master_address", address, "None (automatic) or a host name or IP address of the trainer")
    port = config.weight_sync_port
    check(port is None or (is_int(port) and 1 <= port <= 65535), "weight_sync_port", port,
          "None (a free port) or an int in [1, 65535]")
    urls = config.teacher_server_urls
    teacher_ids = list(urls) if isinstance(urls, Mapping) else []
    if config.vllm_server_api_key is None:
        config.vllm_server_api_key = student_api_key_from_env()
    if config.teacher_api_keys is None or isinstance(config.teacher_api_keys, Mapping):
        config.teacher_api_keys = teacher_api_keys_with_env(teacher_ids, config.teacher_api_keys)
    try:
        check_api_keys(config.vllm_server_api_key, config.teacher_api_keys, teacher_ids,
                       student_field="vllm_server_api_key")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check(isinstance(urls, Mapping) and len(urls) > 0, "teacher_server_urls", urls,
          "a non-empty mapping of teacher id to URL (or list of replica URLs)")
    for teacher_id, value in urls.items():
        replicas = [value] if isinstance(value, str) else value
        ok = isinstance(teacher_id, str) and teacher_id != "" and isinstance(replicas, Sequence) and replicas
        ok = ok and all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in replicas)
        check(ok, f"teacher_server_urls[{teacher_id!r}]", value, "an http(s) URL or a non-empty list of them")
    student = config.vllm_server_base_url
    # one server: the weight sync and its check push to and read from one student (RolloutConfig would take
    # replicas, but they would serve weights no sync reaches)
    check(isinstance(student, str) and student.startswith(("http://", "https://")), "vllm_server_base_url", student,
          "an http(s) URL, one server (a list of student replicas is not supported: the weight sync updates one "
          "student server)")


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
