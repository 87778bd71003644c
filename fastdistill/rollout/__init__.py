"""Rollout: sampling completions from the student's vLLM server and scoring them with teachers' servers.

Nothing imported here imports torch (the rollout worker's child imports this package): the hidden-state teacher's
client, which decodes with torch, is loaded on first use.
"""

import importlib
from typing import Any

from fastdistill.errors import (
    ServerDownError,
    VLLMError,
    VLLMRequestError,
    VLLMResponseError,
    VLLMUnavailableError,
    VocabularyMismatchError,
)
from fastdistill.rollout.child import WorkerExhausted
from fastdistill.rollout.client import Generation, ServedModel, StudentClient, TeacherClient
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.decode import TeacherScores, parse_prompt_logprobs
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.http import RequestStats, RetryPolicy
from fastdistill.rollout.order import OnPolicyShare, epoch_order, is_on_policy, prompt_cursor, row_of_prompt
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sample import RolloutSample
from fastdistill.rollout.sequence import Rollouts, open_clients, teacher_client
from fastdistill.rollout.vocab import check_shared_vocabulary
from fastdistill.rollout.worker import RolloutWorker

_LAZY = {"HiddenTeacherClient": "fastdistill.rollout.hidden", "TeacherHiddenStates": "fastdistill.rollout.hidden"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastdistill.rollout' has no attribute {name!r}")


__all__ = [
    "DroppedPrompt",
    "OnPolicyShare",
    "Generation",
    "HiddenTeacherClient",
    "ReplicaPool",
    "RequestStats",
    "RetryPolicy",
    "RolloutConfig",
    "RolloutSample",
    "RolloutWorker",
    "Rollouts",
    "ServedModel",
    "ServerDownError",
    "StudentClient",
    "TeacherClient",
    "TeacherHiddenStates",
    "TeacherScores",
    "VLLMError",
    "VLLMRequestError",
    "VLLMResponseError",
    "VLLMUnavailableError",
    "VocabularyMismatchError",
    "WorkerExhausted",
    "check_shared_vocabulary",
    "epoch_order",
    "parse_prompt_logprobs",
    "is_on_policy",
    "open_clients",
    "prompt_cursor",
    "row_of_prompt",
    "teacher_client",
]
