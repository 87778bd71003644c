"""API keys of the vLLM servers: where they come from, how they are sent, how they stay out of logs, and the
middleware that makes a vLLM server require one on every route.

A key is read from, in order: the explicit value (config field, command-line flag, constructor argument), then
these environment variables:

- ``FASTDISTILL_STUDENT_API_KEY``: the student server's key;
- ``FASTDISTILL_TEACHER_API_KEY_<ID>``: teacher ``<ID>``'s key (the teacher id upper-cased, every character other
  than ``A-Z`` and ``0-9`` replaced by ``_``: teacher ``"math-v2"`` reads ``FASTDISTILL_TEACHER_API_KEY_MATH_V2``);
- ``FASTDISTILL_TEACHER_API_KEY``: the key of every teacher without a variable of its own.

An empty variable counts as unset. Each variable also has a ``_FILE`` form (``FASTDISTILL_STUDENT_API_KEY_FILE``,
``FASTDISTILL_TEACHER_API_KEY_<ID>_FILE``, ``FASTDISTILL_TEACHER_API_KEY_FILE``) naming a file that holds the key, read
when the variable itself is unset (mode 0600: a file that other users may read is refused). Last comes the key that
``fastdistill serve-<role>`` generated when it was given none (:func:`default_key_file`, ``~/.cache/fastdistill/keys/
<role>.key``), so a trainer run by the same user finds it. Clients send the key as ``Authorization: Bearer <key>``.

The mask ``"***"`` that saved configs and trackers show in place of a key is never a key: a config copied from a run's
saved one fails with a :class:`~fastdistill.errors.ConfigError` naming the field instead of sending ``***``.

vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) only guards the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``: the dev-mode routes a student needs for weight sync (``/collective_rpc``, ``/pause``,
``/init_weight_transfer_engine``, ``/update_weights``, ``/server_info``, ...) and ``/tokenize`` stay open.
:class:`RequireAPIKey` guards every route but ``/health`` and ``/ping``; the launcher
(:class:`fastdistill.serve.VLLMServer`) adds it to every server started with a key. This module imports nothing
outside the standard library but :mod:`fastdistill.errors` (itself import-free): it runs inside vLLM's API server and
in the rollout worker's CUDA-free child.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from fastdistill.errors import ConfigError

STUDENT_KEY_ENV = "FASTDISTILL_STUDENT_API_KEY"
TEACHER_KEY_ENV = "FASTDISTILL_TEACHER_API_KEY"
VLLM_KEY_ENV = "VLLM_API_KEY"  # what vLLM's server (and RequireAPIKey) read
MASK = "***"
# Fields of fastdistill's configs that hold keys (masked by mask_secrets).
SECRET_FIELDS = frozenset({"vllm_server_api_key", "teacher_api_keys", "student_api_key", "api_key"})
# Routes RequireAPIKey leaves open: liveness probes, which the launcher and load balancers poll without a key.
OPEN_PATHS = frozenset({"/health", "/ping"})
MIDDLEWARE = "fastdistill.auth.RequireAPIKey"  # the value of vLLM's --middleware flag

_KEY_PATTERN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: a header value without spaces or line breaks


def teacher_key_env(teacher_id: str) -> str:
    """The environment variable of teacher ``teacher_id``'s key: ``FASTDISTILL_TEACHER_API_KEY_<ID>``."""
    return f"{TEACHER_KEY_ENV}_{re.sub(r'[^A-Z0-9]', '_', teacher_id.upper())}"


def _env(name: str, environ: Mapping[str, str] | None) -> str | None:
    """``$name``, else the key in the file ``$name_FILE`` names, else None."""
    environ = os.environ if environ is None else environ
    if value := environ.get(name):
        return value
    if path := environ.get(f"{name}_FILE"):
        return read_key_file(path, what=f"${name}_FILE")
    return None


def read_key_file(path: str | Path, *, what: str = "the key file") -> str:
    """The key held in the file ``path`` (surrounding whitespace ignored).

    Raises :class:`ConfigError` naming ``what`` when the file is missing, when users other than its owner may read
    or write it (``chmod 600`` it), or when it holds no valid key; the message never quotes the file's content."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{what}: cannot read API key file {str(path)!r} ({error.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what}: API key file {str(path)!r} is open to other users (mode {stat.S_IMODE(mode):o}): "
                          f"chmod 600 {path}")
    key = text.strip()
    if problem := api_key_problem(key):
        raise ConfigError(f"{what}: the API key in {str(path)!r} must be {problem}")
    return key


def write_new_key_file(path: str | Path) -> str:
    """Generate a key (32 random bytes, URL-safe base64), write it to the new file ``path`` with mode 0600 (its
    folder is created with mode 0700 when missing) and return it. Raises ``FileExistsError`` when ``path`` exists."""
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(key + "\n")
    return key


def key_from_file_or_new(path: str | Path) -> tuple[str, bool]:
    """The key in ``path`` (:func:`read_key_file`) when the file exists, else a new one written there
    (:func:`write_new_key_file`); the flag says whether it is new."""
    if Path(path).expanduser().exists():
        return read_key_file(path, what="--api-key-file"), False
    return write_new_key_file(path), True


def default_key_file(role: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where ``fastdistill serve-<role>`` keeps the key it generates when given none, and where the trainer looks for
    it when it has no other: ``$XDG_CACHE_HOME/fastdistill/keys/<role>.key`` (default ``~/.cache/...``). One key per
    user and role: the replicas of a server, and every teacher, share it."""
    cache = (os.environ if environ is None else environ).get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fastdistill" / "keys" / f"{role}.key"


def _generated_key(role: str, environ: Mapping[str, str] | None) -> str | None:
    path = default_key_file(role, environ)
    return read_key_file(path, what=f"the key fastdistill serve-{role} generated") if path.exists() else None


def student_api_key_from_env(environ: Mapping[str, str] | None = None, *, generated: bool = True) -> str | None:
    """``$FASTDISTILL_STUDENT_API_KEY`` (or the file ``$FASTDISTILL_STUDENT_API_KEY_FILE`` names), else, with
    ``generated``, the key ``fastdistill serve-student`` generated (:func:`default_key_file`) when it exists, else
    None."""
    key = _env(STUDENT_KEY_ENV, environ)
    return key if key is not None or not generated else _generated_key("student", environ)


def teacher_api_key_from_env(
    teacher_id: str, environ: Mapping[str, str] | None = None, *, generated: bool = True
) -> str | None:
    """Teacher ``teacher_id``'s key from ``$FASTDISTILL_TEACHER_API_KEY_<ID>``, else ``$FASTDISTILL_TEACHER_API_KEY``
    (each or its ``_FILE`` form), else, with ``generated``, the key ``fastdistill serve-teacher`` generated when it
    exists, else None."""
    key = _env(teacher_key_env(teacher_id), environ) or _env(TEACHER_KEY_ENV, environ)
    return key if key is not None or not generated else _generated_key("teacher", environ)


def teacher_api_keys_with_env(
    teacher_ids: Iterable[str], explicit: Mapping[str, str] | None, environ: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """Teacher id -> key: the ``explicit`` entries, then the environment for the other teachers; None when no
    teacher has a key."""
    keys = dict(explicit or {})
    for teacher_id in teacher_ids:
        if keys.get(teacher_id) is None:
            key = teacher_api_key_from_env(teacher_id, environ)
            if key is not None:
                keys[teacher_id] = key
    return {teacher_id: key for teacher_id, key in keys.items() if key is not None} or None


def api_key_problem(key: object) -> str | None:
    """Why ``key`` cannot be an API key (None when it can). Never quotes the key."""
    if not isinstance(key, str):
        return f"a string (got a {type(key).__name__})"
    if key == MASK:
        return (f"the real key, not the mask {MASK!r} that saved configs and trackers show in its place (give the key "
                "or leave the field out and set its environment variable)")
    if not _KEY_PATTERN.fullmatch(key):
        return "a non-empty string of visible ASCII characters without spaces (the value is not shown)"
    return None


def check_api_key(key: object, what: str = "api_key") -> None:
    """Raise ``ValueError`` ``<what> must be ...`` unless ``key`` is None (no key) or a valid key; what every client
    and server launcher checks its key with. Never quotes the key."""
    if key is not None and (problem := api_key_problem(key)):
        raise ValueError(f"{what} must be {problem}")


def check_api_keys(
    student_key: object,
    teacher_keys: object,
    teacher_ids: Iterable[str],
    *,
    student_field: str = "student_api_key",
    teachers_field: str = "teacher_api_keys",
) -> None:
    """Raise ``ValueError`` naming the field when the student's key or a teacher's is not a valid key, or
    ``teacher_keys`` (None or a mapping of teacher id to key) names a teacher that is not in ``teacher_ids``. The
    messages never quote a key."""
    if student_key is not None and (problem := api_key_problem(student_key)):
        raise ValueError(f"{student_field} must be None or {problem}")
    if teacher_keys is None:
        return
    if not isinstance(teacher_keys, Mapping):
        raise ValueError(f"{teachers_field} must be None or a mapping of teacher id to key, "
                         f"got a {type(teacher_keys).__name__}")
    known = list(teacher_ids)
    for teacher_id, key in teacher_keys.items():
        if teacher_id not in known:
            raise ValueError(f"{teachers_field} names teacher {teacher_id!r}, which is not among the teachers {known}")
        if key is not None and (problem := api_key_problem(key)):
            raise ValueError(f"{teachers_field}[{teacher_id!r}] must be None or {problem}")


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}``, or ``{}`` without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def mask_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` (e.g. a config's ``to_dict()``, for its ``to_masked_dict()``) with every key in
    :data:`SECRET_FIELDS` masked: a string becomes ``"***"``, a mapping keeps its keys (teacher ids) with masked
    values; None stays None."""
    masked = dict(values)
    for name in SECRET_FIELDS & masked.keys():
        value = masked[name]
        if isinstance(value, Mapping):
            masked[name] = {key: None if item is None else MASK for key, item in value.items()}
        elif value is not None:
            masked[name] = MASK
    return masked


# ------------------------------------------------------------------------------------------------ server side

_Scope = dict[str, Any]
_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequireAPIKey:
    """ASGI middleware for vLLM's API server (``--middleware fastdistill.auth.RequireAPIKey``): every HTTP or
    websocket request needs ``Authorization: Bearer <$VLLM_API_KEY>``, except ``OPTIONS`` (CORS preflight) and
    :data:`OPEN_PATHS`; others get 401 ``{"error": "Unauthorized"}``, as vLLM's own check answers.

    vLLM builds it with the app alone, so the key comes from ``$VLLM_API_KEY`` (comma-separated for several keys).
    Without one it refuses to start: a guard that guards nothing would be a silent hole.
    """

    def __init__(self, app: Callable[[_Scope, _Receive, _Send], Awaitable[None]]):
        tokens = [token for token in os.environ.get(VLLM_KEY_ENV, "").split(",") if token]
        if not tokens:
            raise RuntimeError(f"{MIDDLEWARE} needs the server's key in ${VLLM_KEY_ENV}")
        self.app = app
        self._digests = [hashlib.sha256(token.encode()).digest() for token in tokens]

    def _authorized(self, scope: _Scope) -> bool:
        value = b""
        for name, header in scope.get("headers") or []:
            if name.lower() == b"authorization":
                value = header
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        matched = False
        for expected in self._digests:  # compare with every key: the time taken tells nothing
            matched |= secrets.compare_digest(digest, expected)
        return matched

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps({"error": "Unauthorized"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return None
