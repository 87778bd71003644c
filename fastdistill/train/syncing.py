"""When and what the trainer pushes into the student's vLLM server: the weight-sync schedule.

A cold sync at start-up (version → version + 1), then every ``weight_sync_steps`` steps (each version's optimizer
step is kept in :class:`~fastdistill.train.staleness.PolicySteps`: staleness counts steps, not syncs); with
``weight_sync_overlap`` the weights are snapshotted on the training thread and pushed from a background thread while
the next step collects and trains. What travels is the model, its LoRA-merged weights (streamed one tensor at a time)
or, with ``lora_sync="adapter"``, a copy of the adapter. With ``verify_weight_sync`` every push is checked by the
served log-prob gap on two training prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastdistill.sync import served_logprob_gap, served_sampled_logprob_gap, snapshot_weights
from fastdistill.sync.lora import adapter_weights, merged_weights
from fastdistill.train.staleness import PolicySteps
from fastdistill.train.timing import PhaseClock


class WeightSyncSchedule:
    """Owns the policy version and the pushes of ``weight_sync`` (``init()``, ``push(model, version)``, ``close()``).

    ``on_served(version)`` is called once the server serves ``version`` (the rollout worker stamps rollouts with it),
    ``on_trained(step)`` after each optimizer step, before its sync (the worker's horizon follows it);
    ``probes`` are token-id prompts for ``verify_weight_sync``; ``student_model_name`` is the served model's id."""

    def __init__(self, weight_sync: Any, config: Any, hf_model: Any, *, clock: PhaseClock,
                 model_version: int = 0, probes: Sequence[Sequence[int]] = (), student_model_name: str | None = None):
        self.weight_sync = weight_sync
        self.config = config
        self.hf_model = hf_model
        self.clock = clock
        self.policy = PolicySteps(config.weight_sync_steps, version=model_version)
        self.probes = [list(p) for p in probes if len(p) >= 2]
        self.student_model_name = student_model_name
        self.on_served: Callable[[int], None] | None = None
        self.on_trained: Callable[[int], None] | None = None
        self._pending: Any = None  # the background push under weight_sync_overlap
        self._thread: Any = None

    @property
    def model_version(self) -> int:
        """The newest version pushed (the one the server serves once its push completes)."""
        return self.policy.version

    @model_version.setter
    def model_version(self, version: int) -> None:
        self.policy.version = int(version)

    @property
    def adapter_sync(self) -> bool:
        """Whether syncs send the LoRA adapter alone and generations name it (``lora_sync="adapter"``)."""
        return self.config.lora_r > 0 and self.config.lora_sync == "adapter"

    def start(self) -> dict[str, float]:
        """Open the weight-sync group (collective) and push the starting weights (the cold sync)."""
        if self.weight_sync is None:
            return {}
        self.weight_sync.init()
        return self.sync()

    def after_step(self, step: int) -> dict[str, float]:
        """Sync when ``step`` (steps trained so far) is a multiple of ``weight_sync_steps``; the push's metrics."""
        self.policy.step = step
        if self.on_trained is not None:
            self.on_trained(step)
        return self.sync() if step % self.config.weight_sync_steps == 0 else {}

    def sync(self) -> dict[str, float]:
        """Push the current weights as the next version (in the background with ``weight_sync_overlap`` once the
        server serves version 1)."""
        if self.weight_sync is None:
            return {}
        if self.config.weight_sync_overlap and self.model_version > 0:
            return self._sync_in_background()
        with self.clock.phase("weight_sync"):
            timings = dict(self.weight_sync.push(self.servable(), self.model_version + 1) or {})
        self.policy.pushed(self.model_version + 1)
        self.policy.served(self.model_version)
        if self.on_served is not None:
            self.on_served(self.model_version)
        if self.config.verify_weight_sync and self.probes:
            with self.clock.phase("sync_verify"):
                timings["sync/served_logprob_gap"] = self.served_gap()
        return timings

    def servable(self) -> Any:
        """What the server should serve: the model itself, or with LoRA its merged weights (a stream that merges one
        tensor at a time), or with ``lora_sync="adapter"`` a copy of the adapter."""
        if self.adapter_sync:
            return adapter_weights(self.hf_model)
        if self.config.lora_r > 0:
            return merged_weights(self.hf_model)
        return self.hf_model

    def _sync_in_background(self) -> dict[str, float]:
        """Snapshot the weights now and push them from a thread while the next step collects and trains. Returns the
        previous push's timings plus how long this step waited for it (``perf/weight_sync_wait_s``)."""
        started = time.perf_counter()
        with self.clock.phase("weight_sync"):  # waiting for the previous push, then the snapshot
            timings = dict(self._pending.result() or {}) if self._pending is not None else {}
            timings["perf/weight_sync_wait_s"] = time.perf_counter() - started
            # the LoRA stream is lazy: merge now, not during training; an adapter is a copy
            servable = self.servable()
            snapshot = servable if self.adapter_sync else snapshot_weights(servable)
        self.policy.pushed(self.model_version + 1)
        version = self.model_version
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="fastdistill-weight-sync")

        def push() -> dict[str, float]:
            result = self.weight_sync.push(snapshot, version)
            self.policy.served(version)
            if self.on_served is not None:
                self.on_served(version)
            return result

        self._pending = self._thread.submit(push)
        return timings

    def served_gap(self) -> float:
        """Max |served − trainer| log-prob on the probe prompts (a full forward of the model on one process)."""
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            config = self.config
            adapter = getattr(self.weight_sync, "served_model_name", None)
            if adapter is not None:  # the adapter's check takes the generation path (see the function)
                return served_sampled_logprob_gap(config.vllm_server_base_url, self.hf_model, self.probes, adapter,
                                                  api_key=config.vllm_server_api_key)
            return served_logprob_gap(config.vllm_server_base_url, self.hf_model, self.probes,
                                      served_model_name=self.student_model_name, api_key=config.vllm_server_api_key)
        finally:
            self.hf_model.train(was_training)

    def close(self, stack: Any) -> None:
        """Register, on an ``ExitStack``, what ends the syncs: the pending push (its error propagates), the thread,
        the weight-sync group (closed last)."""
        if self.weight_sync is not None:
            stack.callback(self.weight_sync.close)
        if self._thread is not None:
            stack.callback(self._thread.shutdown)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            stack.callback(pending.result)
