"""Rollout: sampling completions from the student's vLLM server and scoring them with teachers' servers."""

from fastdistill.rollout.client import Generation, ServedModel, StudentClient, TeacherClient, TeacherScores
from fastdistill.rollout.http import (
    RetryPolicy,
    VLLMError,
    VLLMRequestError,
    VLLMResponseError,
    VLLMUnavailableError,
)

__all__ = [
    "Generation",
    "RetryPolicy",
    "ServedModel",
    "StudentClient",
    "TeacherClient",
    "TeacherScores",
    "VLLMError",
    "VLLMRequestError",
    "VLLMResponseError",
    "VLLMUnavailableError",
]
