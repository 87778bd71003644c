"""Every error fastdistill raises on purpose, in one module below all the others.

Each layer (``data``, ``cache``, ``rollout``, ``sync``, ``loss``, ``train``) raises these and imports nothing above it
to do so. The classes keep their historical homes as re-exports (``fastdistill.train.config.ConfigError`` is this
``ConfigError``), so ``except`` clauses written against either name catch the same thing.
"""

from __future__ import annotations


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
