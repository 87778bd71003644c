"""Rollout: sampling completions from the student's vLLM server and scoring them with teachers' servers."""

from fastdistill.rollout.client import Generation, ServedModel, StudentClient, TeacherClient, TeacherScores
from fastdistill.rollout.http import (
    RetryPolicy,
    VLLMError,
    VLLMRequestError,
    VLLMResponseError,
    VLLMUnavailableError,
)
from fastdistill.rollout.sample import RolloutSample
from fastdistill.rollout.vocab import VocabularyMismatchError, check_shared_vocabulary
from fastdistill.rollout.worker import RolloutConfig, RolloutWorker, epoch_order, prompt_cursor

__all__ = [
    "Generation",
    "RetryPolicy",
    "RolloutConfig",
    "RolloutSample",
    "RolloutWorker",
    "ServedModel",
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
    "prompt_cursor",
]
