"""``AsyncDistillationConfig``: every knob of a run, with TRL 1.16's field names and defaults where they exist.

Loadable from YAML plus ``key=value`` overrides (:meth:`AsyncDistillationConfig.from_yaml`). Every field is
validated at construction with a message that names the field, including the ones TRL 1.16 leaves unchecked
(``teacher_top_k``, ``teacher_temperature``, ``weight_sync_steps``, ``max_staleness``, ``queue_maxsize``, …).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fastdistill.auth import mask_secrets
from fastdistill.errors import ConfigError
from fastdistill.loss.options import BACKENDS as LOSS_BACKENDS
from fastdistill.loss.options import TAIL_MODES
from fastdistill.options import HIDDEN_DTYPES, SYNC_BACKENDS, TEACHER_SIGNALS
from fastdistill.rollout.config import processes_problem
from fastdistill.train.config_checks import (
    LOSS_TYPES,
    QUERY_LOSS_TYPES,
    validate_loss_options,
    validate_opd_levers,
    validate_rank_heartbeat,
    validate_servers,
    validate_staleness,
    validate_teacher_cache,
)
from fastdistill.train.config_checks import at_least as _at_least
from fastdistill.train.config_checks import check as _check
from fastdistill.train.config_checks import choice as _choice
from fastdistill.train.config_checks import is_int as _is_int
from fastdistill.train.config_checks import positive as _positive
from fastdistill.train.config_checks import validate_cross_tokenizer as _validate_cross_tokenizer
from fastdistill.train.config_checks import value_range as _range

STALE_POLICIES = ("drop", "importance", "importance_all")
STALENESS_UNITS = ("sample", "token")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
DTYPES = ("float32", "bfloat16", "float16", "auto")
LORA_SYNCS = ("merged", "adapter")
REPORTERS = ("tensorboard", "wandb", "trackio")
SAVE_STRATEGIES = ("steps", "no")


DEFAULT_LOOKAHEAD_STEPS = 3  # max_lookahead_steps=None (docs/train.md, "Staleness")


@dataclass
class AsyncDistillationConfig:
    """Configuration of an asynchronous on-policy distillation run.

    TRL 1.16's field names and defaults unless marked *ours*. Sizes are in
    tokens, times in seconds. ``teacher_server_urls`` maps teacher id to a URL or a list of replica URLs.
    """

    # --- model and data
    model_name_or_path: str = ""
    output_dir: str = "fastdistill-output"
    # a .json/.jsonl/.parquet/.csv file, a dataset folder or a Hugging Face dataset name (docs/data.md)
    train_dataset: str | None = None
    eval_dataset: str | None = None  # held-out prompts: greedy completions scored at start, eval_steps, end
    dataset_config: str | None = None  # TRL's script arguments: load_dataset(name, dataset_config, split=...)
    dataset_train_split: str = "train"  # the split of a dataset folder or name that train_dataset uses
    dataset_test_split: str = "test"  # the split of a dataset folder or name that eval_dataset uses
    eval_steps: int | None = None  # evaluate every this many steps too (None: at the start and the end only)
    # ours: train from an offline teacher cache folder (`fastdistill score`) instead of a student and teacher server
    teacher_cache: str | None = None
    # TRL GKD's name: with teacher_cache, this fraction of the prompts is generated on-policy (student and teacher
    # servers, weight sync) and the rest trained on the cache's completions; 0: the cache alone
    lmbda: float = 0.0
    # ours: anneal that share linearly from lmbda at the first prompt to lmbda_final at the run's last (None: fixed)
    lmbda_final: float | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    model_init_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # --- optimisation
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    seed: int = 42
    gradient_checkpointing: bool = True
    lora_r: int = 0  # ours: > 0 trains LoRA adapters of this rank (peft)
    lora_sync: str = "merged"  # ours: what a LoRA sync sends: merged full weights, or the adapter alone ("adapter")
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: Any = "all-linear"  # peft's target_modules: "all-linear" or a list of module names
    bf16: bool | None = None  # None: bf16 mixed precision on CUDA, fp32 on CPU
    # --- logging and checkpoints
    logging_steps: int = 1
    report_to: list[str] = field(default_factory=list)
    run_name: str | None = None
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    export_final_model: bool = True  # ours: write a Hugging Face folder to <output_dir>/final at the end
    disable_tqdm: bool = False
    # --- servers and rollout
    vllm_server_base_url: str = "http://localhost:8000"
    vllm_server_timeout: float = 240.0
    teacher_server_urls: dict[str, str | list[str]] | None = None
    request_timeout: float = 600.0
    weight_sync_timeout: float = 1800.0
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_inflight_tasks: int = -1
    max_lookahead_steps: int | None = None  # ours: steps' samples in flight and queued together; None: 3
    queue_maxsize: int | None = None  # TRL: 1024; None: one step's samples (see resolved_queue_maxsize)
    rollout_processes: int = 1  # ours: rollout worker processes sharing the prompt stream (docs/rollout.md)
    heartbeat_stale_after_s: float = 300.0
    ddp_timeout: float = 1800.0  # HF's: seconds a collective of the trainer ranks may take (torch's default)
    rank_heartbeat_timeout_s: float = 60.0  # ours: a trainer rank silent this long ends the run naming it; 0: off
    shuffle: bool = True  # ours: TRL never shuffles
    skip_long_prompts: bool = False  # ours: skip prompts that cannot fit a server's max_model_len (else an error)
    # --- loss
    beta: float = 0.0
    teacher_temperature: float = 1.0
    teacher_top_k: int = 8
    add_tail_bucket: bool = True
    tail_mode: str = "exact"  # ours: "trl" reproduces TRL's clamped tail
    # ours: "reverse_kl_pg" = AsyncOPD's learner-time-advantage policy gradient on the sampled token; "reverse_kl_mc"
    # = the same over num_student_queries draws from the rollout policy μ per position, importance-weighted by π_θ/μ;
    # "reverse_kl_student_topk" = the exact reverse KL over the rollout student's top-num_student_queries ids plus a
    # tail bucket (docs/loss.md, "Student-side reverse-KL estimators"); "topd_pg" = reverse_kl_pg on TOP-D's advantages
    loss_type: str = "jsd"
    pg_importance_ratio: bool = False  # ours: reverse_kl_pg weights tokens by π_θ(y)/μ(y) (reverse_kl_mc always does)
    pg_ratio_clip: float | None = None  # ours: upper clip of that ratio (reverse_kl_pg and reverse_kl_mc)
    # ours: S, the student queries per completion position of reverse_kl_mc / reverse_kl_student_topk (0 otherwise)
    num_student_queries: int = 0
    # ours: the policy-gradient family's stabilizer: "none", "ppo_clip" (clip π_θ/μ to [1 − pg_clip_eps, 1 +
    # pg_clip_eps] in PPO's min form), "decoupled_ppo" (the same on π_θ/π_prox, π_prox the step-start weights,
    # IS weight π_prox/μ) or "m2po" (mask the largest (log π_θ/μ)² until their mean ≤ m2po_budget)
    pg_stabilizer: str = "none"
    pg_clip_eps: float = 0.2
    m2po_budget: float = 0.01
    # ours (docs/loss.md, "Position weights and the bounded reward"): "iw_opd" weighs each completion position by the
    # share of its sample's teacher–behaviour disagreement still ahead (any loss type); TOP-D's α of loss "topd_pg"
    position_weighting: str = "none"
    position_weight_gamma: float = 0.5
    topd_alpha: float = 0.2
    # ours (docs/rollout.md, "Horizon"): a training rollout's max_tokens (None: max_completion_length throughout;
    # int: tokens; float in (0, 1]: that fraction), "fixed" or grown "linear"ly to full over rollout_horizon_growth
    # of the steps; by default half the length, grown to full over the first half of the run
    rollout_horizon: int | float | None = 0.5
    rollout_horizon_schedule: str = "linear"
    rollout_horizon_growth: float = 0.5
    loss_backend: str = "auto"  # ours
    # ours: what each teacher server returns: "topk" (prompt_logprobs, the default) or "hidden" (final hidden states,
    # `fastdistill serve-teacher --signal hidden`; the trainer applies the teacher's lm_head: the full vocabulary);
    # one value for every teacher, or a mapping teacher id -> signal (unnamed teachers: "topk")
    teacher_signal: str | dict[str, str] = "topk"
    teacher_hidden_dtype: str = "bfloat16"  # ours: the hidden states on the wire, "bfloat16" or "float32"
    # ours: teacher id -> local checkpoint folder whose lm_head turns a hidden teacher's states into logits; None (or
    # a teacher left out): the folder the teacher server serves (its /v1/models id), when that is a local folder
    teacher_model_paths: dict[str, str] | None = None
    # ours: teacher id -> the teacher's own tokenizer folder (usually the teacher model's): a cross-tokenizer teacher
    # (docs/cross_tokenizer.md); None or a teacher left out: the student's tokenizer (the start-up probe checks it)
    teacher_tokenizers: dict[str, str] | None = None
    # ours: the loss of cross-tokenizer samples with loss_type "jsd": "hybrid" (GOLD's: the generalized JSD on the
    # tokens both vocabularies share + the sorted-probability ULD on the rest) or "uld" (ULD on every token)
    cross_tokenizer_loss: str = "hybrid"
    # ours: the hybrid's [w_shared, w_unshared]; None: GOLD's adaptive weights per teacher (VocabularyMap.gold_weights)
    cross_tokenizer_weights: list[float] | None = None
    # --- batching, staleness, weight sync
    token_budget: int | None = None
    max_staleness: int = 4
    # ours: "importance" keeps samples beyond max_staleness, weighting their tokens by a clipped ratio π_θ/μ;
    # "importance_all" keeps them too and weights every stale sample (at least one optimizer step old) so
    stale_policy: str = "drop"
    importance_ratio_clip: float = 2.0  # ours
    # ours: weight each stale sample by exp(-drift / freshness_scale), drift = mean |log π_θ(y) - log μ(y)| over its
    # sampled tokens (loss/freshness.py)
    freshness_weight: bool = False
    freshness_scale: float = 1.0
    # ours: what max_staleness and the importance corrections read: "sample" = the version a rollout was dispatched
    # on (TRL's), "token" = the version each token was generated by (a sample's mean for the drop; docs/train.md)
    staleness_unit: str = "sample"
    weight_sync_steps: int = 1
    weight_sync_backend: str = "auto"  # ours: gloo on CPU, nccl on CUDA, "none" never syncs (tests)
    verify_weight_sync: bool = False  # ours: after each sync compare served log-probs with the trainer's
    weight_sync_overlap: bool = False  # ours: push a snapshot from a thread while the next step runs (1 process)
    weight_sync_one_call: bool | None = None  # ours: one /collective_rpc instead of /pause…/resume; None: with gloo
    # ours: the trainer address and port the student server's workers join for weight sync; None: the local address
    # that routes to the server (127.0.0.1 for a loopback server) and a free port
    weight_sync_master_address: str | None = None
    weight_sync_port: int | None = None
    # ours: API keys (bearer tokens), never in repr or to_dict; None: $FASTDISTILL_STUDENT_API_KEY and per teacher
    # $FASTDISTILL_TEACHER_API_KEY_<ID>, else $FASTDISTILL_TEACHER_API_KEY (fastdistill.auth, docs/serving.md)
    vllm_server_api_key: str | None = field(default=None, repr=False)
    teacher_api_keys: dict[str, str] | None = field(default=None, repr=False)
    async_mode: bool = True  # ours: False waits for the current weights' samples (a synchronous baseline)

    def __post_init__(self) -> None:
        if self.teacher_server_urls is None:
            self.teacher_server_urls = {"default": "http://localhost:8001"}
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        self.validate()

    # ------------------------------------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid field."""
        _check(isinstance(self.model_name_or_path, str) and self.model_name_or_path != "", "model_name_or_path",
               self.model_name_or_path, "a model folder or hub id (non-empty string)")
        _check(bool(self.output_dir), "output_dir", self.output_dir, "a non-empty path")
        for name in ("train_dataset", "eval_dataset", "dataset_config"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), name, value,
                   "None or a non-empty string (a file, a dataset folder or a Hugging Face dataset name)"
                   if name != "dataset_config" else "None or a non-empty string (the dataset's configuration name)")
        for name in ("dataset_train_split", "dataset_test_split"):
            _check(isinstance(getattr(self, name), str) and getattr(self, name) != "", name, getattr(self, name),
                   "a split name (non-empty string)")
        _choice(self, "dtype", DTYPES)
        _choice(self, "lr_scheduler_type", SCHEDULERS)
        _choice(self, "save_strategy", SAVE_STRATEGIES)
        _choice(self, "tail_mode", TAIL_MODES)
        _choice(self, "loss_type", LOSS_TYPES)
        _choice(self, "loss_backend", LOSS_BACKENDS)
        _choice(self, "stale_policy", STALE_POLICIES)
        _choice(self, "staleness_unit", STALENESS_UNITS)
        _choice(self, "weight_sync_backend", SYNC_BACKENDS)
        _choice(self, "lora_sync", LORA_SYNCS)
        unknown = [name for name in self.report_to if name not in REPORTERS]
        _check(not unknown, "report_to", self.report_to, f"a list drawn from {list(REPORTERS)}")
        _range(self, "beta", 0.0, 1.0)
        _positive(self, "learning_rate", "teacher_temperature", "temperature", "adam_epsilon", "request_timeout",
                  "weight_sync_timeout", "vllm_server_timeout", "heartbeat_stale_after_s", "num_train_epochs",
                  "ddp_timeout")
        validate_rank_heartbeat(self)
        # The loss would divide the student's logits by T, but the teacher's log-probs come from vLLM's
        # prompt_logprobs, which are computed from the raw logits whatever the request's temperature: the two sides
        # would be at different temperatures.
        _check(self.teacher_temperature == 1.0, "teacher_temperature", self.teacher_temperature,
               "1.0: served teachers score at temperature 1 (vLLM's prompt_logprobs ignore the request temperature, "
               "so the student at another temperature would be matched to a temperature-1 teacher)")
        _range(self, "adam_beta1", 0.0, 1.0, high_open=True)
        _range(self, "adam_beta2", 0.0, 1.0, high_open=True)
        _range(self, "top_p", 0.0, 1.0, low_open=True)
        _range(self, "warmup_ratio", 0.0, 1.0)
        _check(self.min_p is None or 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "None or in [0, 1]")
        _positive(self, "repetition_penalty")
        _check(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, ">= 0 (0 disables clipping)")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _at_least(self, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "teacher_top_k",
                  "weight_sync_steps", "max_completion_length", "logging_steps", "save_steps", "rollout_processes")
        _check(self.queue_maxsize is None or (_is_int(self.queue_maxsize) and self.queue_maxsize >= 1),
               "queue_maxsize", self.queue_maxsize, "None (automatic) or an int >= 1")
        _at_least(self, 0, "max_staleness", "warmup_steps", "lora_r")
        _check(self.eval_steps is None or (_is_int(self.eval_steps) and self.eval_steps >= 1), "eval_steps",
               self.eval_steps, "None (at the start and the end) or an int >= 1")
        validate_teacher_cache(self)
        _positive(self, "lora_alpha")
        _check(not (self.lora_sync == "adapter" and not self.lora_r), "lora_sync", self.lora_sync,
               "'merged' when lora_r=0 (adapter sync needs LoRA training: set lora_r > 0)")
        _range(self, "lora_dropout", 0.0, 1.0, high_open=True)
        _check(isinstance(self.lora_target_modules, str) or (isinstance(self.lora_target_modules, list) and all(
            isinstance(m, str) for m in self.lora_target_modules)), "lora_target_modules", self.lora_target_modules,
            '"all-linear" or a list of module names')
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "0 or -1 (disabled) or a positive int")
        _check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", self.max_steps, "-1 (from epochs) or >= 1")
        _check(self.max_inflight_tasks == -1 or self.max_inflight_tasks >= 1, "max_inflight_tasks",
               self.max_inflight_tasks, "-1 (automatic) or >= 1")
        cap = self.rollout_processes if self.max_inflight_tasks == -1 else self.max_inflight_tasks  # -1: automatic
        fits = processes_problem(self.rollout_processes, cap) is None
        _check(self.rollout_processes == 1 or self.async_mode and fits, "rollout_processes",
               self.rollout_processes, "1 with async_mode=False (synchronous waves run in the trainer's process), "
               "and at most max_inflight_tasks (each process needs a rollout in flight)")
        lookahead = self.max_lookahead_steps
        _check(lookahead is None or (_is_int(lookahead) and lookahead >= 1), "max_lookahead_steps", lookahead,
               "None (3 steps) or an int >= 1")
        _check(lookahead is None or self.max_inflight_tasks == -1, "max_lookahead_steps", lookahead,
               f"None with an explicit max_inflight_tasks={self.max_inflight_tasks} (that sets the in-flight cap "
               "itself; set one of the two)")
        _check(self.token_budget is None or _is_int(self.token_budget), "token_budget", self.token_budget,
               "None (the student's max_model_len), <= 0 (fixed count per row) or a token count")
        if self.token_budget is not None and self.token_budget > 0:
            _check(self.token_budget > self.max_completion_length, "token_budget", self.token_budget,
                   f"> max_completion_length ({self.max_completion_length}) so that a full-length sample with its "
                   "prompt fits in a row")
        _check(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit",
               self.save_total_limit, "None or >= 1")
        _check(self.importance_ratio_clip >= 1.0, "importance_ratio_clip", self.importance_ratio_clip, ">= 1")
        _check(self.bf16 is None or isinstance(self.bf16, bool), "bf16", self.bf16, "None (automatic) or a bool")
        validate_loss_options(self)
        validate_opd_levers(self)
        validate_staleness(self)
        _check(not (self.weight_sync_overlap and self.verify_weight_sync), "weight_sync_overlap",
               self.weight_sync_overlap, "False with verify_weight_sync=True (the trainer moves on during the push)")
        _check(self.weight_sync_one_call in (None, True, False), "weight_sync_one_call", self.weight_sync_one_call,
               "None (automatic), True or False")
        _check(not (self.weight_sync_one_call and self.weight_sync_backend == "nccl"), "weight_sync_one_call",
               self.weight_sync_one_call, "None or False with weight_sync_backend='nccl' (GPU engines overlap steps)")
        _check(not (self.weight_sync_overlap and not self.async_mode), "weight_sync_overlap",
               self.weight_sync_overlap, "False with async_mode=False (a synchronous step waits for the new weights)")
        validate_servers(self)  # the rendezvous address, the server URLs and the API keys
        self._validate_teacher_signal()
        _validate_cross_tokenizer(self)
        for name in ("model_init_kwargs", "chat_template_kwargs"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, Mapping), name, value, "None or a mapping")

    def _validate_teacher_signal(self) -> None:
        """``teacher_signal``, ``teacher_hidden_dtype`` and ``teacher_model_paths``, and the options a hidden-state
        teacher cannot serve."""
        signal, ids = self.teacher_signal, self.teacher_ids
        if isinstance(signal, Mapping):
            unknown = [key for key in signal if key not in ids]
            _check(not unknown, "teacher_signal", signal, f"a mapping whose keys are teacher ids {ids} (unknown: "
                   f"{unknown})")
            _check(all(value in TEACHER_SIGNALS for value in signal.values()), "teacher_signal", signal,
                   f"a mapping of teacher id to one of {list(TEACHER_SIGNALS)}")
        else:
            _check(signal in TEACHER_SIGNALS, "teacher_signal", signal,
                   f"one of {list(TEACHER_SIGNALS)} or a mapping of teacher id to one of them")
        _choice(self, "teacher_hidden_dtype", HIDDEN_DTYPES)
        paths, hidden = self.teacher_model_paths, self.hidden_teacher_ids
        if paths is not None:
            _check(isinstance(paths, Mapping) and all(isinstance(v, str) and v != "" for v in paths.values()),
                   "teacher_model_paths", paths, "None or a mapping of teacher id to a local checkpoint folder")
            extra = [key for key in paths if key not in hidden]
            _check(not extra, "teacher_model_paths", paths, f"a mapping whose keys are hidden-signal teachers "
                   f"{hidden} (teacher_signal 'hidden'); {extra} are not")
        if not hidden:
            return
        _check(self.teacher_cache is None, "teacher_cache", self.teacher_cache,
               f"None with a hidden-signal teacher (teacher_signal 'hidden' for {hidden}): a teacher cache holds "
               "top-K log-probs, not hidden states")

    # ----------------------------------------------------------------------------------------------- derived values

    def teacher_signal_of(self, teacher_id: str) -> str:
        """``"topk"`` or ``"hidden"``: what teacher ``teacher_id``'s server returns."""
        if isinstance(self.teacher_signal, Mapping):
            return self.teacher_signal.get(teacher_id, "topk")
        return self.teacher_signal

    @property
    def hidden_teacher_ids(self) -> list[str]:
        """The teachers scored with final hidden states (``teacher_signal`` ``"hidden"``), in configuration order."""
        return [teacher_id for teacher_id in self.teacher_ids if self.teacher_signal_of(teacher_id) == "hidden"]

    @property
    def cross_tokenizer_teacher_ids(self) -> list[str]:
        """The teachers with their own tokenizer (``teacher_tokenizers``), in configuration order."""
        named = self.teacher_tokenizers or {}
        return [teacher_id for teacher_id in self.teacher_ids if teacher_id in named]

    @property
    def teacher_ids(self) -> list[str]:
        """Teacher ids in configuration order; index i is ``teacher_index`` i in the loss."""
        return list(self.teacher_server_urls)

    @property
    def student_queries(self) -> str:
        """What the rollout asks the student server for per position (``RolloutConfig.student_queries``):
        ``"samples"`` for reverse_kl_mc, ``"topk"`` for reverse_kl_student_topk, else ``"none"``."""
        return QUERY_LOSS_TYPES.get(self.loss_type, "none")

    @property
    def mixes_on_policy(self) -> bool:
        """A run with a teacher cache that also generates a share of its prompts on-policy (``lmbda`` or
        ``lmbda_final`` > 0)."""
        return self.teacher_cache is not None and (self.lmbda > 0.0 or (self.lmbda_final or 0.0) > 0.0)

    def samples_per_step(self, world_size: int) -> int:
        """Samples one optimizer step takes with the fixed-count batcher: batch × GA × world (an estimate under a
        token budget)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size

    def resolved_max_inflight_tasks(self, world_size: int) -> int:
        """The rollout worker's in-flight cap: ``max_inflight_tasks``, or the whole lookahead when -1 (the queued
        samples then count against it, see :meth:`resolved_max_lookahead`)."""
        if self.max_inflight_tasks != -1:
            return self.max_inflight_tasks
        return self.resolved_max_lookahead(world_size)

    def resolved_max_lookahead(self, world_size: int) -> int | None:
        """How many samples the worker may have in flight and queued together: when ``max_inflight_tasks`` is -1,
        ``max_lookahead_steps`` (None: 3) steps' samples (at most ``max_staleness − (weight_sync_steps − 1)`` steps, the
        served weights' own lag taken off, at least one); None with an
        explicit ``max_inflight_tasks`` (TRL's meaning: that many in flight, the queue aside).

        Counting the queue in the budget (as AsyncOPD's pending-sample semaphore does) lets the whole lookahead
        generate whenever the trainer keeps up, which gives the student server bigger batches, and holds it back
        when the trainer falls behind, so samples never get staler than the lookahead allows. TRL keeps
        ``max_staleness`` steps in flight on top of a 1024-sample queue (``docs/train.md``)."""
        if self.max_inflight_tasks != -1:
            return None
        bound = self.max_staleness - (self.weight_sync_steps - 1)  # steps a sample may wait once it is dispatched
        steps = max(1, min(self.max_lookahead_steps or DEFAULT_LOOKAHEAD_STEPS, bound))
        return steps * self.samples_per_step(world_size)

    def resolved_queue_maxsize(self, world_size: int) -> int:
        """``queue_maxsize``, or one step's samples when None.

        Rollouts in flight plus queued ones are the trainer's lookahead: with TRL's 1024-sample queue it runs far
        more than ``max_staleness`` steps ahead, and the surplus is generated only to be dropped as stale (the
        "wasted" column of the end-to-end runs in benchmarks/RESULTS.md). Here the queue only bounds what waits:
        queued samples count against the lookahead budget (:meth:`resolved_max_lookahead`)."""
        return self.queue_maxsize if self.queue_maxsize is not None else self.samples_per_step(world_size)

    def resolved_max_steps(self, num_prompts: int, world_size: int) -> int:
        """``max_steps``, or ceil(epochs × prompts / (batch × GA × world)) when it is -1: exact for the fixed-count
        batcher, an initial estimate under a token budget (the trainer corrects it as rows are packed and trains every
        prompt whatever it says)."""
        if self.max_steps != -1:
            return self.max_steps
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size
        return max(1, math.ceil(self.num_train_epochs * num_prompts / per_step))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, API keys included: ``AsyncDistillationConfig(**config.to_dict())`` is an equal
        config. What leaves the process (trackers, logs, saved configs) takes :meth:`to_masked_dict`."""
        return dataclasses.asdict(self)

    def to_masked_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with every API key masked as ``"***"`` (:func:`~fastdistill.auth.mask_secrets`): what
        trackers and saved configs get. Fed back as a config, a mask is a :class:`ConfigError` naming the field."""
        return mask_secrets(self.to_dict())

    # --------------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AsyncDistillationConfig:
        """Build from a mapping; an unknown key is a :class:`ConfigError` suggesting the closest field."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown config field {key!r}{hint}")
        try:
            return cls(**dict(values))
        except TypeError as error:  # e.g. a value of a type the comparisons cannot handle
            raise ConfigError(str(error)) from error

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: Sequence[str] = ()) -> AsyncDistillationConfig:
        """Load a YAML mapping (or nothing when ``path`` is None) and apply ``key=value`` overrides.

        Override values are parsed as YAML (``beta=0.5``, ``report_to=[tensorboard]``, ``dtype=bfloat16``)."""
        values: dict[str, Any] = {}
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist")
            loaded = yaml.safe_load(path.read_text())
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
            values.update(loaded or {})
        for override in overrides:
            key, sep, raw = override.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"override {override!r} must look like key=value")
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        return cls.from_dict(values)
