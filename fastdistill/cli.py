"""The ``fastdistill`` command line.

- ``fastdistill train --config run.yaml [key=value ...]``: one training run (wrap with ``torchrun`` for several ranks);
- ``fastdistill serve-teacher MODEL`` / ``serve-student MODEL``: start vLLM with the flags each role needs (anything
  after ``--`` goes to vLLM unchanged);
- ``fastdistill demo [--output-dir DIR]``: the end-to-end CPU demo.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    config = AsyncDistillationConfig.from_yaml(args.config, args.overrides)
    summary = AsyncDistillationTrainer(config).train()
    print(f"fastdistill: trained {summary['steps']} steps, model version {summary['model_version']}, "
          f"{summary['trained_tokens_per_s']:.1f} trained tokens/s; output in {config.output_dir}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from fastdistill.testing.vllm_server import VLLMServer

    extra = list(args.vllm_args)
    backend = None
    if args.role == "student" and args.weight_transfer != "none":
        backend = args.weight_transfer
    import torch

    dtype = args.dtype or ("auto" if torch.cuda.is_available() else "float32")
    try:
        server = VLLMServer(args.model, role=args.role, host=args.host, port=args.port, dtype=dtype,
                            max_model_len=args.max_model_len, extra_args=extra, weight_transfer_backend=backend,
                            cpus=args.cpus)
    except ValueError as error:
        print(f"fastdistill: {error}", file=sys.stderr)
        return 2
    command = server.command()
    pinned = f"taskset -c {','.join(map(str, args.cpus))} " if args.cpus else ""
    print("fastdistill: " + pinned + " ".join(command), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # vLLM and all its processes inherit it
    return subprocess.call(command, env=server.environment())


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastdistill", description="Asynchronous on-policy distillation.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run training from a YAML config plus key=value overrides")
    train.add_argument("--config", type=Path, default=None, help="YAML file of AsyncDistillationConfig fields")
    train.add_argument("overrides", nargs="*", help="field=value (parsed as YAML), e.g. beta=0.5")
    train.set_defaults(handler=_train)

    for role in ("teacher", "student"):
        serve = commands.add_parser(f"serve-{role}", help=f"start a vLLM server configured as a {role}")
        serve.add_argument("model", help="model folder or hub id")
        serve.add_argument("--host", default="127.0.0.1")
        serve.add_argument("--port", type=int, default=8001 if role == "teacher" else 8000)
        serve.add_argument("--dtype", default=None,
                           help="default: auto with CUDA, float32 on CPU (matches the trainer)")
        serve.add_argument("--max-model-len", type=int, default=4096)
        serve.add_argument("--cpus", type=_cpu_list, default=None,
                           help="pin the whole server to these cores, e.g. 0 or 0,2-3 (OpenMP threads follow)")
        if role == "student":
            serve.add_argument("--weight-transfer", choices=("auto", "gloo", "nccl", "none"), default="auto",
                               help="weight-transfer engine (auto: nccl with CUDA, gloo without)")
        serve.add_argument("--dry-run", action="store_true", help="print the command and exit")
        serve.set_defaults(handler=_serve, role=role)

    demo = commands.add_parser("demo", help="end-to-end distillation of tiny models through real vLLM servers")
    demo.add_argument("--output-dir", type=Path, default=Path("demo_output"))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true")
    demo.set_defaults(handler=_demo)
    return parser


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
    from fastdistill.train.config import ConfigError

    try:
        return args.handler(args)
    except ConfigError as error:
        parser.exit(2, f"fastdistill: config error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
