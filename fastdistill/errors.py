"""Every error fastdistill raises on purpose, in one module below all the others.

Each layer (``data``, ``cache``, ``rollout``, ``sync``, ``loss``, ``train``) raises these and imports nothing above it
to do so. The classes keep their historical homes as re-exports (``fastdistill.train.config.ConfigError`` is this
``ConfigError``), so ``except`` clauses written against either name catch the same thing.
"""

from __future__ import annotations

import json
import os
import time


class ConfigError(ValueError):
    """A configuration value is out of range, of the wrong type, unknown, or refused in combination with another."""


class CacheError(ValueError):
    """A cache folder is missing a piece, is corrupted, or does not match what it is used with."""


class TeacherHeadError(ValueError):
    """The teacher folder does not hold what the head needs (config, safetensors, the head's tensors)."""


class VocabularyMismatchError(ValueError):
    """A teacher's tokenizer differs from the student's."""


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says which step, what the server answered and, where known, the fix."""


class LostRankError(RuntimeError):
    """A collective failed because another trainer rank is gone (its process killed, its host lost); the message
    names the rank(s) and their address."""


class CollectiveTimeoutError(RuntimeError):
    """A collective of the trainer ranks did not finish within ``ddp_timeout`` while every rank's heartbeat was
    current (a rank alive but not joining it); the message says which collective failed and how."""


class VLLMError(RuntimeError):
    """Base class of every error the HTTP clients raise about a vLLM server."""


class VLLMRequestError(VLLMError):
    """The server rejected the request (a 4xx other than 429). Not retried: the same request would fail again."""

    def __init__(self, url: str, status: int, server_message: str, hint: str | None = None):
        self.url = url
        self.status = status
        self.server_message = server_message
        self.hint = hint
        text = f"{url} answered HTTP {status}: {server_message}"
        super().__init__(f"{text}\n{hint}" if hint else text)


class VLLMUnavailableError(VLLMError):
    """Every attempt failed with a transient error; ``__cause__`` holds the last one."""


class VLLMResponseError(VLLMError):
    """The server answered 2xx but the body is not the JSON the client expects."""


class ServerDownError(RuntimeError):
    """A server (all its replicas) answered nothing successfully for longer than ``server_down_deadline_s``."""


class RolloutsFailingError(RuntimeError):
    """``max_consecutive_failures`` rollouts in a row were rejected or answered with a malformed body: every rollout
    fails, so the run stops with the servers' last error instead of walking through the dataset."""


class VLLMServerError(RuntimeError):
    """A server process exited or did not become healthy in time; the message ends with its log tail."""


class SourceExhausted(Exception):
    """A finite source has no more samples."""


class NonFiniteLossError(FloatingPointError):
    """A step's loss or gradient norm is not finite: the optimizer did not step and the step's prompts are not marked
    trained, so a resume from the last checkpoint trains them again."""


class AlignmentError(ValueError):
    """A completion cannot be aligned across two tokenizers: its tokens' bytes are not valid UTF-8, or the teacher's
    tokenizer does not give back the completion's text byte for byte (a normaliser, an unknown-token fallback, a
    special token's text inside the completion). The rollout drops such a sample rather than train on a misaligned
    one."""


# ---------------------------------------------------------------------------------------------- exit statuses

EXIT_OTHER = 1  # an error not in EXIT_STATUSES (a bug, a library's own error): read the log
EXIT_CONFIG = 2  # refused input: fix the config, the cache or the model folder; resuming does not help
EXIT_DATA = 65  # sysexits' EX_DATAERR: the numbers went bad (a non-finite loss); resuming repeats the same steps
EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: a server or host unavailable; resume once it is back
EXIT_TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: a trainer peer lost or stuck; resume with resume_from_checkpoint=latest
EXIT_STATUSES: dict[type[BaseException], int] = {
    ConfigError: EXIT_CONFIG, CacheError: EXIT_CONFIG, TeacherHeadError: EXIT_CONFIG,
    VocabularyMismatchError: EXIT_CONFIG,
    NonFiniteLossError: EXIT_DATA,
    ServerDownError: EXIT_UNAVAILABLE, VLLMServerError: EXIT_UNAVAILABLE, VLLMUnavailableError: EXIT_UNAVAILABLE,
    WeightSyncError: EXIT_UNAVAILABLE,
    LostRankError: EXIT_TEMPFAIL, CollectiveTimeoutError: EXIT_TEMPFAIL,
}
EXIT_MEANINGS = {
    0: "success",
    EXIT_OTHER: "an unexpected error: read the log",
    EXIT_CONFIG: "refused input: fix the config; resuming does not help",
    EXIT_DATA: "a non-finite loss: resuming repeats the same steps",
    EXIT_UNAVAILABLE: "a server or host unavailable: resume once it is back",
    EXIT_TEMPFAIL: "a trainer peer lost or stuck: resume with resume_from_checkpoint=latest",
}


def exit_status(error: BaseException) -> int:
    """The process exit status that says what ``error`` means (the nearest class listed in
    :data:`EXIT_STATUSES`, else :data:`EXIT_OTHER`)."""
    for cls in type(error).__mro__:
        if cls in EXIT_STATUSES:
            return EXIT_STATUSES[cls]
    return EXIT_OTHER


def record_for_torchrun(error: BaseException, *, formatted_traceback: str = "") -> None:
    """Write ``error`` into torchrun's error file for this worker (``TORCHELASTIC_ERROR_FILE``; nothing without
    one), in torchelastic's format: torchrun copies the first failing worker's file to its own error file, with the
    worker's exit status as ``errorCode`` (see :func:`read_torchrun_error_file`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": formatted_traceback, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as out:
            json.dump(data, out)
    except OSError:  # the exit status still says what happened
        pass


def read_torchrun_error_file(path: str) -> tuple[int | None, str]:
    """``(errorCode, message)`` of a torchrun error file (its first failing worker's exit status and its
    ``Class: message`` line); ``(None, "")`` when the file is missing or not in torchelastic's format."""
    try:
        with open(path) as source:
            message = json.load(source).get("message")
    except (OSError, ValueError, AttributeError):
        return None, ""
    if not isinstance(message, dict):
        return None, str(message or "")
    code = message.get("errorCode")
    return (code if isinstance(code, int) else None), str(message.get("message", ""))
