"""Student generation that names a LoRA adapter (``lora_sync="adapter"``): the request's ``model`` is the adapter of
the version the trainer last pushed, and the sample is stamped with the version the request actually used.

The trainer's weight sync keeps the last few adapter versions loaded (:mod:`fastdistill.sync.adapter`). A request
that names a version unloaded in the meantime is refused with HTTP 404 (``The model `...` does not exist``); it is
sent again naming the newest version, and stamped with that one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastdistill.adapter_names import ADAPTER_PREFIX, adapter_name
from fastdistill.errors import VLLMRequestError
from fastdistill.rollout.client import Generation, StudentClient

__all__ = ["ADAPTER_PREFIX", "MAX_ADAPTER_RETRIES", "adapter_name", "generate_with_adapter", "is_unknown_model"]

MAX_ADAPTER_RETRIES = 3  # versions to try after a 404, each newer than the last


def is_unknown_model(error: VLLMRequestError) -> bool:
    """Whether the server refused a request because it does not serve the ``model`` it named (an unloaded adapter)."""
    return error.status == 404 and "does not exist" in error.server_message


async def generate_with_adapter(
    student: StudentClient,
    prompt_ids: Any,
    *,
    current_version: Callable[[], int],
    model_for_version: Callable[[int], str | None],
    **sampling: Any,
) -> tuple[Generation, int]:
    """One completion from the student naming the model of the current version; returns it and that version.

    ``current_version()`` is read just before each request; ``model_for_version(v)`` is the ``model`` field for
    version ``v`` (None: the server's base model). When the server answers that the named model does not exist (its
    adapter was unloaded after the version was read), the request is sent again if a newer version names another
    model (up
    to :data:`MAX_ADAPTER_RETRIES` times); otherwise the refusal is raised. ``sampling`` goes to
    :meth:`StudentClient.generate`."""
    version = current_version()
    for _ in range(MAX_ADAPTER_RETRIES):
        try:
            return await student.generate(prompt_ids, model=model_for_version(version), **sampling), version
        except VLLMRequestError as error:
            newer = current_version()
            if not is_unknown_model(error) or model_for_version(newer) == model_for_version(version):
                raise
            version = newer
    return await student.generate(prompt_ids, model=model_for_version(version), **sampling), version
