"""The rollout settings: servers, sampling, lookahead, prompt order and failure handling (one frozen dataclass)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdistill.adapter_names import adapter_name
from fastdistill.auth import check_api_keys
from fastdistill.cross_tokenizer import check_teacher_tokenizers
from fastdistill.options import HIDDEN_DTYPES, QUERY_KINDS, STUDENT_ROUTES, TEACHER_SIGNALS
from fastdistill.rollout.behaviour import samples_route_problem
from fastdistill.rollout.horizon import HorizonSchedule
from fastdistill.rollout.http import RetryPolicy
from fastdistill.rollout.order import OnPolicyShare
from fastdistill.rollout.replicas import normalize_urls


def processes_problem(rollout_processes: int, max_inflight_tasks: int) -> str | None:
    """Why ``rollout_processes`` rollout processes cannot share ``max_inflight_tasks`` rollouts in flight (every
    process needs one), or None when they can."""
    if rollout_processes > max_inflight_tasks:
        return (f"rollout_processes={rollout_processes} is more than max_inflight_tasks={max_inflight_tasks}: every "
                "process needs a rollout in flight")
    return None


@dataclass(frozen=True)
class RolloutConfig:
    """Servers and sampling settings of the worker.

    Servers: ``student_url`` and each value of ``teacher_urls`` (teacher id -> URL) is one base URL or a sequence of
    replica URLs serving the same model; requests go to the replica with the fewest in flight, a replica that fails
    with a transient error is skipped for ``replica_cooldown_s`` (doubling while it keeps failing) and the request
    fails over to another replica. ``student_model`` is the ``model`` field of generation requests (default: the
    id the student's ``/v1/models`` reports). ``student_adapter_prefix`` (``lora_sync="adapter"``): generation
    requests of model version v >= 1 name the LoRA adapter ``"<prefix>-v<v>"`` instead, and the sample is stamped
    with the version its request used (see :func:`fastdistill.rollout.adapters.generate_with_adapter`).
    ``student_api_key`` and ``teacher_api_keys`` (teacher id -> key) are the servers' API keys, sent as bearer
    tokens (None: no key); they are left out of the repr.

    Sampling: ``teacher_top_k`` is K (the teacher arrays are K+1 wide); ``max_tokens`` bounds the completion length
    in tokens; ``horizon`` (None: none) truncates it further for the rollouts it is given to, by the training step
    a rollout is dispatched at (:class:`~fastdistill.rollout.horizon.HorizonSchedule`, at most ``max_tokens``);
    ``eos_token_ids`` (add the pad id if generation can end on it) tell a finished completion from a clipped one
    for ``completions/clipped_ratio`` (without them, a completion is clipped when it has as many tokens as its
    request's limit). ``generation_seed`` (None: the server's own randomness): each generation request carries the seed
    ``generation_seed + dataset row`` (evaluation's reproducible completions).

    Teacher signal: ``teacher_signals`` maps a teacher id to ``"topk"`` (``prompt_logprobs``, the default for a
    teacher it does not name) or ``"hidden"`` (a ``fastdistill serve-teacher --signal hidden`` server, scored with
    :class:`~fastdistill.rollout.hidden.HiddenTeacherClient`: the sample carries the teacher's final hidden states
    in ``teacher_hidden``, in ``teacher_hidden_dtype``, and no candidates).

    Student queries: ``student_queries`` (one of :data:`~fastdistill.options.QUERY_KINDS`) asks for
    ``num_student_queries`` ids per completion position besides the teacher's top-K: ``"samples"`` draws them from
    the distribution the student server sampled from (column 0 is the realised token), ``"topk"`` takes the
    student's top ids; the sample carries them with their rollout log-probs and the teacher's log-probs at them
    (``RolloutSample.query_*``).

    ``student_route`` (one of :data:`~fastdistill.options.STUDENT_ROUTES`): ``"generate"`` samples through vLLM's
    ``/inference/v1/generate`` (a student started with ``--enable-scale-out``), whose weight-version spans give each
    sample's ``token_versions``; ``"completions"`` through ``/v1/completions``.

    Teacher tokenizers: ``teacher_tokenizers`` maps a teacher id to that teacher's own tokenizer (a local folder,
    usually the teacher model's): a **cross-tokenizer teacher**. It scores the student's completion text rendered its
    own way (its chat template for the row's ``prompt`` with ``chat_template_kwargs``, its tokenization of the text),
    and the sample carries per-student-position targets (``RolloutSample.cross_targets``, see
    :mod:`fastdistill.rollout.cross_scoring`) instead of candidate ids. ``student_tokenizer`` is the student's
    tokenizer folder (required with any cross-tokenizer teacher). Teachers it does not name share the student's
    tokenizer.

    Lookahead: at most ``max_inflight_tasks`` rollouts are in flight, reached by a slow start from
    ``initial_inflight_tasks`` (None: at once); ``max_lookahead`` (None: no such bound) caps rollouts in flight plus
    samples waiting in the queue, so that the worker never runs further ahead of the trainer than that.

    Processes: ``rollout_processes`` child processes share the prompt stream (each dispatches the prompt ids
    :func:`~fastdistill.rollout.dispatch.owner_of` gives it) and the one sample queue; the lookahead bounds above
    hold for all of them together.

    Order: ``seed`` seeds the per-epoch shuffle (epoch e uses ``default_rng((seed, e))``); ``start_index`` is the
    resume cursor (a ``prompt_id``, counting across epochs); ``end_index`` (None: endless) is the first prompt id the
    cursor does not dispatch (the run's last prompt + 1); ``skip_prompt_ids`` are prompt ids the worker never
    dispatches (on resume: prompts beyond the cursor that were already trained); ``skip_rows`` are dataset rows never
    dispatched in any epoch (prompts too long for a server); with ``on_policy`` (a run mixing in a teacher cache) the
    cursor dispatches only the prompt ids that :class:`~fastdistill.rollout.OnPolicyShare` selects.

    Failures: a rollout that failed because a server was unavailable (transient errors until ``retry`` gave up) is
    re-dispatched (only the scoring when the generation succeeded), up to ``max_rollout_attempts`` attempts per
    prompt; a request to a server whose replicas are all cooling down waits for the cooldown. A server with no
    successful answer for ``server_down_deadline_s`` seconds since its first failure stops the child with an error
    naming it. A prompt given up on (rejected by a server, or out of attempts) is put into the sample queue as a
    :class:`~fastdistill.rollout.dropped.DroppedPrompt` naming it, the reason and the server's message, so that the
    consumer can count it as done.
    ``max_consecutive_failures`` rollouts in a row rejected by a server or answered with a malformed body (a
    misconfiguration, not one bad prompt) stop the child with the last error.
    """

    student_url: str | Sequence[str]
    teacher_urls: Mapping[str, str | Sequence[str]]
    teacher_top_k: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_inflight_tasks: int = 128
    initial_inflight_tasks: int | None = None
    max_lookahead: int | None = None
    shuffle: bool = True
    seed: int = 0
    start_index: int = 0
    end_index: int | None = None
    skip_prompt_ids: frozenset[int] = frozenset()
    on_policy: OnPolicyShare | None = None
    skip_rows: frozenset[int] = frozenset()
    student_model: str | None = None
    student_adapter_prefix: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_consecutive_failures: int = 100
    max_rollout_attempts: int = 3
    server_down_deadline_s: float = 600.0
    replica_cooldown_s: float = 2.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    student_api_key: str | None = field(default=None, repr=False)
    teacher_api_keys: Mapping[str, str] | None = field(default=None, repr=False)
    teacher_signals: Mapping[str, str] | None = None
    teacher_hidden_dtype: str = "bfloat16"
    generation_seed: int | None = None
    student_queries: str = "none"
    num_student_queries: int = 0
    rollout_processes: int = 1
    teacher_tokenizers: Mapping[str, str] | None = None
    student_tokenizer: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    horizon: HorizonSchedule | None = None
    student_route: str = "completions"

    def __post_init__(self) -> None:
        if self.student_route not in STUDENT_ROUTES:
            raise ValueError(f"student_route must be one of {list(STUDENT_ROUTES)}, got {self.student_route!r}")
        if self.student_queries not in QUERY_KINDS:
            raise ValueError(f"student_queries must be one of {list(QUERY_KINDS)}, got {self.student_queries!r}")
        if (self.student_queries == "none") != (self.num_student_queries == 0) or self.num_student_queries < 0:
            raise ValueError(f"num_student_queries must be >= 1 with student_queries={self.student_queries!r} and 0 "
                             f"without, got {self.num_student_queries}")
        if self.student_queries == "samples" and (problem := samples_route_problem(self.top_k,
                                                                                  self.num_student_queries)):
            raise ValueError(problem)
        if not self.teacher_urls:
            raise ValueError("teacher_urls is empty: at least one teacher is needed")
        for teacher_id, signal in (self.teacher_signals or {}).items():
            if teacher_id not in self.teacher_urls or signal not in TEACHER_SIGNALS:
                raise ValueError(f"teacher_signals maps teacher ids of teacher_urls to one of {list(TEACHER_SIGNALS)}, "
                                 f"got {teacher_id!r}: {signal!r}")
        self._check_teacher_tokenizers()
        if self.teacher_hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"teacher_hidden_dtype must be one of {list(HIDDEN_DTYPES)}, got "
                             f"{self.teacher_hidden_dtype!r}")
        normalize_urls(self.student_url, "student_url")
        for teacher_id, urls in self.teacher_urls.items():
            normalize_urls(urls, f"teacher {teacher_id!r}")
        check_api_keys(self.student_api_key, self.teacher_api_keys, self.teacher_urls)
        positive = (
            "teacher_top_k",
            "max_tokens",
            "max_inflight_tasks",
            "max_consecutive_failures",
            "max_rollout_attempts",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.rollout_processes, bool) or not isinstance(self.rollout_processes, (int, np.integer)) \
                or self.rollout_processes < 1:
            raise ValueError(f"rollout_processes must be an int >= 1, got {self.rollout_processes!r}")
        if problem := processes_problem(self.rollout_processes, self.max_inflight_tasks):
            raise ValueError(problem)
        if self.start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {self.start_index}")
        if self.end_index is not None and self.end_index < self.start_index:
            raise ValueError(f"end_index must be None or >= start_index={self.start_index}, got {self.end_index}")
        if self.max_lookahead is not None and (not isinstance(self.max_lookahead, (int, np.integer))
                                               or self.max_lookahead < 1):
            raise ValueError(f"max_lookahead must be None or an int >= 1, got {self.max_lookahead!r}")
        if self.initial_inflight_tasks is not None and not 1 <= self.initial_inflight_tasks <= self.max_inflight_tasks:
            raise ValueError(f"initial_inflight_tasks must be None or in [1, max_inflight_tasks="
                             f"{self.max_inflight_tasks}], got {self.initial_inflight_tasks}")
        if self.server_down_deadline_s <= 0 or self.replica_cooldown_s < 0:
            raise ValueError(
                f"server_down_deadline_s must be > 0 and replica_cooldown_s >= 0, got {self.server_down_deadline_s} "
                f"and {self.replica_cooldown_s}"
            )
        if self.horizon is not None and (not isinstance(self.horizon, HorizonSchedule)
                                         or self.horizon.full_tokens > self.max_tokens):
            raise ValueError(f"horizon must be None or a HorizonSchedule whose full_tokens is at most max_tokens="
                             f"{self.max_tokens}, got {self.horizon!r}")
        if self.on_policy is not None and not isinstance(self.on_policy, OnPolicyShare):
            raise ValueError(f"on_policy must be None or an OnPolicyShare, got {self.on_policy!r}")
        bad = [i for i in self.skip_prompt_ids if not isinstance(i, (int, np.integer)) or i < 0]
        if bad:
            raise ValueError(f"skip_prompt_ids must be prompt ids >= 0, got {sorted(map(repr, bad))[:5]}")
        object.__setattr__(self, "skip_prompt_ids", frozenset(int(i) for i in self.skip_prompt_ids))
        object.__setattr__(self, "skip_rows", frozenset(int(i) for i in self.skip_rows))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def _check_teacher_tokenizers(self) -> None:
        ids = list(self.teacher_urls)
        cross = check_teacher_tokenizers(
            self.teacher_tokenizers, ids, hidden_ids=[i for i in ids if self.teacher_signal(i) == "hidden"],
            student_queries=self.student_queries, signal_option=("teacher_signals", self.teacher_signals),
            queries_option=("student_queries", self.student_queries))
        if not cross:
            return
        if not self.student_tokenizer:
            raise ValueError(f"teacher_tokenizers gives teachers {cross} their own tokenizers: "
                             "student_tokenizer (the student's tokenizer folder) is needed to align the completions")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a mapping or None, got {self.chat_template_kwargs!r}")

    def max_tokens_at(self, step: int) -> int:
        """The completion limit of a rollout dispatched after ``step`` training steps: the horizon's, or
        ``max_tokens``."""
        return self.max_tokens if self.horizon is None else self.horizon.tokens_at_step(step)

    def student_model_for_version(self, version: int) -> str | None:
        """The ``model`` of a generation request made at model version ``version``: the adapter of that version
        with ``student_adapter_prefix`` (from version 1 on), else None (``student_model`` or the served model)."""
        if self.student_adapter_prefix is None or version < 1:
            return None
        return adapter_name(version, self.student_adapter_prefix)

    def student_replicas(self) -> tuple[str, ...]:
        """The student's replica URLs."""
        return normalize_urls(self.student_url, "student_url")

    def teacher_signal(self, teacher_id: str) -> str:
        """``"topk"`` or ``"hidden"``: what teacher ``teacher_id``'s server returns."""
        return (self.teacher_signals or {}).get(teacher_id, "topk")

    def teacher_replicas(self, teacher_id: str) -> tuple[str, ...]:
        """The replica URLs of teacher ``teacher_id``."""
        return normalize_urls(self.teacher_urls[teacher_id], f"teacher {teacher_id!r}")
