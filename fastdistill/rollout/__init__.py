"""Rollout: sampling completions from the student's vLLM server and scoring them with teachers' servers."""

from fastdistill.rollout.client import (
    Generation,
    ServedModel,
    StudentClient,
    TeacherClient,
    TeacherScores,
    parse_prompt_logprobs,
)
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.http import (
    RequestStats,
    RetryPolicy,
    VLLMError,
    VLLMRequestError,
    VLLMResponseError,
    VLLMUnavailableError,
)
from fastdistill.rollout.order import OnPolicyShare, epoch_order, is_on_policy, prompt_cursor, route_rows, row_of_prompt
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sample import RolloutSample
from fastdistill.rollout.table import PromptTable
from fastdistill.rollout.vocab import VocabularyMismatchError, check_shared_vocabulary
from fastdistill.rollout.worker import RolloutConfig, RolloutWorker, ServerDownError

__all__ = [
    "DroppedPrompt",
    "OnPolicyShare",
    "Generation",
    "PromptTable",
    "ReplicaPool",
    "RequestStats",
    "RetryPolicy",
    "RolloutConfig",
    "RolloutSample",
    "RolloutWorker",
    "ServedModel",
    "ServerDownError",
    "StudentClient",
    "TeacherClient",
    "TeacherScores",
    "VLLMError",
    "VLLMRequestError",
    "VLLMResponseError",
    "VLLMUnavailableError",
    "VocabularyMismatchError",
    "check_shared_vocabulary",
    "epoch_order",
    "parse_prompt_logprobs",
    "is_on_policy",
    "prompt_cursor",
    "route_rows",
    "row_of_prompt",
]
