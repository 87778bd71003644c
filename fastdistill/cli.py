"""The ``fastdistill`` command line.

- ``fastdistill train --config run.yaml [key=value ...]``: one training run (wrap with ``torchrun`` for several ranks);
- ``fastdistill serve-teacher MODEL`` / ``serve-student MODEL``: start vLLM with the flags each role needs (anything
  after ``--`` goes to vLLM unchanged);
- ``fastdistill eval --model DIR --student-url URL --teacher-url URL --dataset FILE``: held-out evaluation of a saved
  model (the student server must serve it), written as JSON;
- ``fastdistill score --dataset SRC --teacher-url URL --output DIR --top-k K``: score a dataset's own completions with a
  teacher once into a teacher cache (resumable; ``--shard i/n`` splits the work between machines; ``--candidates
  sampled --num-samples S`` stores S draws from the teacher's full distribution instead of its top-K);
- ``fastdistill demo [--output-dir DIR]``: the end-to-end CPU demo;
- ``fastdistill launch cluster.yaml [field=value ...]``: a multi-host run from one config (servers, then ``torchrun``
  on every trainer host through ssh, srun, ...; :mod:`fastdistill.launch`);
- ``fastdistill supervise [--keepalive-s S] [--torchrun-status] -- COMMAND ...``: what the launcher runs on each host
  (:mod:`fastdistill.supervise`).

A fastdistill error exits with the status :func:`fastdistill.errors.exit_status` gives its class (2: refused input,
69: a server unavailable, 75: a trainer peer lost, ...; ``docs/multinode.md``), recorded in torchrun's error file
when torchrun runs the command.

Messages go through the ``fastdistill`` logger, to stderr, prefixed ``fastdistill:``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from fastdistill.errors import EXIT_OTHER, CacheError, ConfigError, exit_status, record_for_torchrun
from fastdistill.options import CANDIDATE_MODES, LOGPROB_DTYPES, SYNC_BACKENDS, TEACHER_SIGNALS
from fastdistill.supervise import add_arguments as add_supervise_arguments
from fastdistill.supervise import run_parsed as run_supervised

if TYPE_CHECKING:
    from fastdistill.serve import VLLMServer

logger = logging.getLogger("fastdistill.cli")  # not __name__: under `python -m` that is "__main__"


def _train(args: argparse.Namespace) -> int:
    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    config = AsyncDistillationConfig.from_yaml(args.config, args.overrides)
    summary = AsyncDistillationTrainer(config).train()
    logger.info("trained %d steps, model version %d, %.1f trained tokens/s; output in %s", summary["steps"],
                summary["model_version"], summary["trained_tokens_per_s"], config.output_dir)
    return 0


def _teacher_urls(values: list[str]) -> dict[str, str | list[str]]:
    """``--teacher-url`` values (``URL`` or ``ID=URL``, repeatable; one id twice lists replicas) as the config's
    ``teacher_server_urls``."""
    urls: dict[str, list[str]] = {}
    for value in values:
        teacher_id, sep, url = value.partition("=")
        if not sep:
            teacher_id, url = "default", value
        if not teacher_id or not url:
            raise ConfigError(f"--teacher-url {value!r} must look like URL or ID=URL")
        urls.setdefault(teacher_id, []).append(url)
    return {tid: found[0] if len(found) == 1 else found for tid, found in urls.items()}


def _eval(args: argparse.Namespace) -> int:
    import json

    from fastdistill.train import AsyncDistillationConfig
    from fastdistill.train.evaluate import evaluate_saved_model

    overrides = list(args.overrides)
    # JSON-quoted: a path or URL is a YAML string whatever characters it holds
    for field, value in (("model_name_or_path", args.model), ("vllm_server_base_url", args.student_url),
                         ("eval_dataset", args.dataset)):
        if value is not None:
            overrides.append(f"{field}={json.dumps(value)}")
    if args.teacher_url:
        # with the other fields, so that teacher_signal / teacher_model_paths may name these teachers' ids
        overrides.append(f"teacher_server_urls={json.dumps(_teacher_urls(args.teacher_url))}")
        overrides.append("teacher_api_keys=")  # None: read from the environment for these teacher ids
    config = AsyncDistillationConfig.from_yaml(args.config, overrides)
    model = config.model_name_or_path
    if model.startswith((os.sep, ".")) and not Path(model).is_dir():  # a path (not a hub id) that is not a folder
        raise ConfigError(f"model folder {model!r} does not exist")
    if config.eval_dataset is None:
        raise ConfigError("no held-out rows: pass --dataset FILE (or set eval_dataset in the config)")
    result = evaluate_saved_model(config, show_completions=not args.no_completions)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    shown = {k: v for k, v in result.items() if k.startswith("eval/")}
    logger.info("%s: %s; wrote %s", config.model_name_or_path,
                ", ".join(f"{k} {v:.4g}" for k, v in shown.items()), args.output)
    return 0


def _score(args: argparse.Namespace) -> int:
    from fastdistill.auth import teacher_api_key_from_env
    from fastdistill.cache.score import parse_shard, score_dataset

    summary = score_dataset(args.dataset, args.teacher_url, args.output, top_k=args.top_k,
                            candidates=args.candidates, num_samples=args.num_samples, seed=args.seed,
                            tokenizer=args.tokenizer, shard=parse_shard(args.shard), rows_per_shard=args.rows_per_shard,
                            concurrency=args.concurrency, logprob_dtype=args.logprob_dtype, split=args.split,
                            dataset_config=args.dataset_config, api_key=teacher_api_key_from_env("default"))
    logger.info("%d shards written (%d rows scored), %d already finished; %d rows skipped because the teacher "
                "server rejected them (listed with its message in %s)", summary.shards_written, summary.rows_scored,
                summary.shards_skipped, summary.rows_rejected, Path(args.output) / "shard-*.json")
    if summary.manifest_written:
        logger.info("every shard is finished: wrote %s", Path(args.output) / "manifest.json")
    else:
        logger.info("other shards are not finished yet: the run that finishes the last one writes the manifest")
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the role's environment variable (``FASTDISTILL_STUDENT_API_KEY`` /
    ``FASTDISTILL_TEACHER_API_KEY``, or the file their ``_FILE`` forms name); ``VLLM_API_KEY`` is read by the launcher
    after these."""
    from fastdistill.auth import student_api_key_from_env, teacher_api_key_from_env

    if args.api_key is not None:
        return args.api_key
    if args.role == "student":
        return student_api_key_from_env(generated=False)
    return teacher_api_key_from_env("default", generated=False)


def _served_key(args: argparse.Namespace) -> str | None:
    """The key ``serve-<role>`` starts the server with: ``--api-key``, else the key in ``--api-key-file`` (generated
    there when the file does not exist), else the role's variables or ``$VLLM_API_KEY``, else none with
    ``--no-api-key`` (a dev-mode server must then listen on loopback), else a key generated into (or reused from)
    :func:`fastdistill.auth.default_key_file`. Says on stderr where a key file is and how the trainer reads it; never
    prints the key. ``--dry-run`` writes nothing."""
    import secrets

    from fastdistill.auth import VLLM_KEY_ENV, default_key_file, key_from_file_or_new, read_key_file

    if args.api_key is not None and (args.api_key_file is not None or args.no_api_key):
        raise ConfigError("give one of --api-key, --api-key-file and --no-api-key, not both")
    path = args.api_key_file
    if path is None:
        if (key := _api_key(args) or os.environ.get(VLLM_KEY_ENV) or None) is not None or args.no_api_key:
            return key
        path = default_key_file(args.role)
    if args.no_api_key:
        raise ConfigError("give --api-key-file or --no-api-key, not both")
    if args.dry_run and not path.expanduser().exists():
        logger.info("would generate an API key into %s (mode 0600)", path)
        return secrets.token_urlsafe(32)
    if args.dry_run:
        key, new = read_key_file(path, what="--api-key-file"), False
    else:
        key, new = key_from_file_or_new(path)
    variable = f"FASTDISTILL_{args.role.upper()}_API_KEY_FILE"
    found = ("a trainer run by this user finds it there" if path == default_key_file(args.role)
             else f"the trainer reads it with {variable}={path}")
    logger.info("API key %s %s (mode 0600): %s; elsewhere, give it with %s", "generated into" if new else "read from",
                path, found, variable)
    return key


def build_server(args: argparse.Namespace, api_key: str | None = None) -> VLLMServer:
    """The :class:`fastdistill.serve.VLLMServer` that ``serve-<role>`` starts (raises ValueError on bad settings).
    ``api_key`` (default: ``--api-key`` or the role's variables, see :func:`_api_key`) is the server's key."""
    import torch

    from fastdistill.serve import VLLMServer

    backend = args.weight_transfer if args.role == "student" and args.weight_transfer != "none" else None
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("auto" if cuda else "float32")
    return VLLMServer(args.model, role=args.role, host=args.host, port=args.port, dtype=dtype, cpu=not cuda,
                      max_model_len=args.max_model_len, extra_args=list(args.vllm_args),
                      weight_transfer_backend=backend, cpus=args.cpus, api_key=api_key or _api_key(args),
                      max_lora_rank=args.max_lora_rank if getattr(args, "enable_lora", False) else None,
                      max_loras=getattr(args, "max_loras", 4), signal=getattr(args, "signal", "topk"),
                      stop_grace_s=args.stop_grace_s)


def _serve(args: argparse.Namespace) -> int:
    """Start the server in the foreground (:meth:`VLLMServer.run_in_foreground`: stopping this process stops it)."""
    try:
        server = build_server(args, api_key=_served_key(args))
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        logger.error("%s", error)
        return 2
    pinned = f"taskset -c {','.join(map(str, args.cpus))} " if args.cpus else ""
    guarded = " (API key in $VLLM_API_KEY)" if server.api_key else ""
    logger.info("%s%s%s", pinned, " ".join(server.command()), guarded)
    if args.dry_run:
        return 0
    return server.run_in_foreground()


def _cpu_list(text: str) -> list[int]:
    """ "0,2-3" -> [0, 2, 3]."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected core ids like 0,2-3, got {text!r}") from None
    return cores


def _demo(args: argparse.Namespace) -> int:
    from fastdistill import demo

    argv = ["--output-dir", str(args.output_dir), "--seed", str(args.seed)] + (["--quick"] if args.quick else [])
    return demo.main(argv)


def _launch(args: argparse.Namespace) -> int:
    from fastdistill.launch import run

    return run(args.cluster, args.overrides)


def _supervise(args: argparse.Namespace) -> int:
    return run_supervised(args.parser, args, args.vllm_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastdistill", description="Asynchronous on-policy distillation.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run training from a YAML config plus key=value overrides")
    train.add_argument("--config", type=Path, default=None, help="YAML file of AsyncDistillationConfig fields")
    train.add_argument("overrides", nargs="*", help="field=value (parsed as YAML), e.g. beta=0.5")
    train.set_defaults(handler=_train)

    for role in ("teacher", "student"):
        variable = f"FASTDISTILL_{role.upper()}_API_KEY"
        serve = commands.add_parser(f"serve-{role}", help=f"start a vLLM server configured as a {role}")
        serve.add_argument("model", help="model folder or hub id")
        serve.add_argument("--host", default="127.0.0.1")
        serve.add_argument("--port", type=int, default=8001 if role == "teacher" else 8000)
        serve.add_argument("--dtype", default=None,
                           help="default: auto with CUDA, float32 on CPU (matches the trainer)")
        serve.add_argument("--max-model-len", type=int, default=4096)
        serve.add_argument("--cpus", type=_cpu_list, default=None,
                           help="pin the whole server to these cores, e.g. 0 or 0,2-3 (OpenMP threads follow)")
        serve.add_argument("--api-key", default=None,
                           help=f"require this key on every route but /health (default: ${variable}, then "
                                "$VLLM_API_KEY, then a generated key, see --api-key-file); prefer the variable: "
                                "arguments show in the process list")
        serve.add_argument("--api-key-file", type=Path, default=None,
                           help=f"read the key from this file (mode 0600), or generate one into it when it does not "
                                f"exist; without a key from anywhere: ~/.cache/fastdistill/keys/{role}.key, where a "
                                f"trainer of the same user finds it. The trainer reads another file with "
                                f"{variable}_FILE=PATH")
        serve.add_argument("--no-api-key", action="store_true",
                           help="when no key is given (--api-key, the variables), serve without one instead of "
                                "generating one (loopback only for a student): every local user can then use the "
                                "server" + (" and replace its weights" if role == "student" else ""))
        if role == "teacher":
            serve.add_argument("--signal", choices=TEACHER_SIGNALS, default="topk",
                               help="what the teacher serves: topk (default) prompt log-probs on /v1/completions, or "
                                    "hidden: every token's final hidden state on /pooling (vLLM's pooling runner), "
                                    "for full-vocabulary distillation with the teacher's head in the trainer")
        if role == "student":
            serve.add_argument("--weight-transfer", choices=SYNC_BACKENDS, default="auto",
                               help="weight-transfer engine (auto: nccl with CUDA, gloo without)")
            serve.add_argument("--enable-lora", action="store_true",
                               help="load LoRA adapters at run time (what lora_sync='adapter' needs)")
            serve.add_argument("--max-lora-rank", type=int, default=16,
                               help="with --enable-lora: the largest adapter rank, at least lora_r (one of 1, 8, 16, "
                                    "32, 64, 128, 256, 320, 512; default 16)")
            serve.add_argument("--max-loras", type=int, default=4,
                               help="with --enable-lora: adapters one batch may mix (default 4)")
        serve.add_argument("--stop-grace-s", type=float, default=15.0,
                           help="seconds a stopped server (SIGTERM, SIGINT, SIGHUP) has to exit before it is killed "
                                "(default 15)")
        serve.add_argument("--dry-run", action="store_true", help="print the command and exit")
        serve.set_defaults(handler=_serve, role=role)

    evaluate = commands.add_parser(
        "eval", help="held-out evaluation of a saved model: greedy answers from the student server (which must serve "
        "that model), scored by the teachers, divergence measured with the model; JSON out")
    evaluate.add_argument("--model", default=None, help="the saved model folder (default: the config's "
                          "model_name_or_path)")
    evaluate.add_argument("--student-url", default=None, help="the vLLM server serving --model")
    evaluate.add_argument("--teacher-url", action="append", default=[],
                          help="URL or ID=URL of a teacher (repeat for several teachers or replicas)")
    evaluate.add_argument("--dataset", default=None, help="held-out rows: a .json/.jsonl/.parquet/.csv file, a dataset "
                          "folder or a Hugging Face dataset name (split: dataset_test_split), with 'prompt' or "
                          "'messages', optionally 'teacher_id' and 'answer' (for exact-match accuracy)")
    evaluate.add_argument("--config", type=Path, default=None, help="YAML file of AsyncDistillationConfig fields "
                          "(teacher_top_k, max_completion_length, beta, teacher_signal, teacher_model_paths, ... and "
                          "the servers)")
    evaluate.add_argument("--output", type=Path, default=Path("eval.json"), help="where to write the JSON result")
    evaluate.add_argument("--no-completions", action="store_true", help="leave the decoded completions out of the "
                          "JSON")
    evaluate.add_argument("overrides", nargs="*", help="field=value (parsed as YAML), e.g. max_completion_length=64")
    evaluate.set_defaults(handler=_eval)

    score = commands.add_parser("score", help="score a dataset's completions with a teacher once, into a teacher "
                                "cache of shards plus a manifest (resumable)")
    score.add_argument("--dataset", required=True, help="a .json/.jsonl/.parquet/.csv file, a dataset folder or a "
                       "Hugging Face dataset name, with 'messages' (the last assistant turn is scored) or 'prompt' "
                       "and 'completion' columns")
    score.add_argument("--split", default="train", help="split of a dataset folder or name (default train)")
    score.add_argument("--dataset-config", default=None, help="configuration name of a Hugging Face dataset")
    score.add_argument("--teacher-url", action="append", required=True,
                       help="the teacher server's URL (repeat for replicas of the same model); its key: "
                       "$FASTDISTILL_TEACHER_API_KEY")
    score.add_argument("--output", required=True, type=Path, help="the cache folder (created; re-running resumes)")
    score.add_argument("--candidates", choices=CANDIDATE_MODES, default="topk",
                       help="topk (default): the teacher's top-K per position; sampled: S tokens drawn per position "
                       "from the teacher's full distribution (an unbiased forward-KL estimate; the server must run "
                       "with --max-logprobs -1)")
    score.add_argument("--top-k", type=int, default=None, help="teacher candidates kept per position (K; topk)")
    score.add_argument("--num-samples", type=int, default=None, help="draws per position (S, 1 to 255; sampled)")
    score.add_argument("--seed", type=int, default=0, help="seed of the draws, combined with each dataset row's "
                       "index (sampled; default 0)")
    score.add_argument("--shard", default="0/1", help="i/n: score only the i-th of n blocks of shards (0-based), so "
                       "n machines can share the work (default 0/1: all)")
    score.add_argument("--rows-per-shard", type=int, default=1024, help="dataset rows per shard (default 1024)")
    score.add_argument("--tokenizer", default=None, help="the teacher's model folder (default: the folder the "
                       "teacher server serves)")
    score.add_argument("--concurrency", type=int, default=16, help="scoring requests in flight (default 16)")
    score.add_argument("--logprob-dtype", choices=LOGPROB_DTYPES, default="float16",
                       help="stored log-prob precision (default float16)")
    score.set_defaults(handler=_score)

    demo = commands.add_parser("demo", help="end-to-end distillation of tiny models through real vLLM servers")
    demo.add_argument("--output-dir", type=Path, default=Path("demo_output"))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true")
    demo.set_defaults(handler=_demo)

    launch = commands.add_parser("launch", help="start a multi-host run from one config: the student and teacher "
                                 "servers, then torchrun on every trainer host (ssh, srun, ...), until the nodes exit")
    launch.add_argument("cluster", type=Path, help="the cluster YAML: hosts, addresses, ports, models, key files, the "
                        "trainer config (examples/multinode/cluster.yaml)")
    launch.add_argument("overrides", nargs="*", help="field=value for fastdistill train, e.g. max_steps=100")
    launch.set_defaults(handler=_launch)

    supervise = commands.add_parser(
        "supervise", help="run a command in its own process group, stopped with it, when its stdin closes or stays "
        "silent (--keepalive-s: the launcher's ssh link), its status taken from torchrun's error file "
        "(--torchrun-status): what `fastdistill launch` runs on each host; the command goes after --")
    add_supervise_arguments(supervise)
    supervise.set_defaults(handler=_supervise, parser=supervise)
    return parser


def _log_to_stderr() -> logging.Handler:
    """Send the ``fastdistill`` logger's INFO and above to the current stderr, prefixed ``fastdistill:``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fastdistill: %(message)s"))
    root = logging.getLogger("fastdistill")
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(argv)
    args.vllm_args = vllm_args
    if getattr(args, "weight_transfer", None) == "auto":
        import torch

        args.weight_transfer = "nccl" if torch.cuda.is_available() else "gloo"
    handler = _log_to_stderr()
    try:
        return args.handler(args)
    except Exception as error:  # its class's exit status (torchrun's error file says which class failed first)
        record_for_torchrun(error, formatted_traceback=traceback.format_exc())
        if isinstance(error, ConfigError):
            parser.exit(2, f"fastdistill: config error: {error}\n")
        if isinstance(error, CacheError):
            parser.exit(2, f"fastdistill: teacher cache error: {error}\n")
        if exit_status(error) == EXIT_OTHER:
            raise
        # through the installed hook, as an uncaught error would print: under a process group torch's prefixes
        # every line with "[rank N]: ", so a multi-rank log still says which rank failed
        sys.excepthook(*sys.exc_info())
        return exit_status(error)
    finally:
        logging.getLogger("fastdistill").removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
