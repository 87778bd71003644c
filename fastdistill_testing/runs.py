"""What the end-to-end tests and benchmarks set up again and again: the tiny student/teacher folders, the "Count to
n." prompt set, a ``fastdistill train`` run through the CLI and its ``metrics.jsonl``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config


def save_tiny_pair(root: Path, seeds: tuple[int, int] = (1, 2)) -> tuple[Path, Path]:
    """The tiny Qwen3 student (``seeds[0]``) and teacher (``seeds[1]``) saved with the tiny tokenizer under
    ``root/student`` and ``root/teacher``; returns both folders."""
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tuple(Path(save_pretrained_dir(build_model(config, seed=seed), tokenizer, root / name))
                 for name, seed in zip(("student", "teacher"), seeds, strict=True))  # type: ignore[return-value]


def count_prompts(n: int) -> list[dict[str, Any]]:
    """``n`` chat rows ``{"prompt": [user: "Count to k."]}``, k cycling through 1..9."""
    return chat_prompts(f"Count to {i % 9 + 1}." for i in range(n))


def chat_prompts(texts: Iterable[str]) -> list[dict[str, Any]]:
    """One chat row ``{"prompt": [user: text]}`` per text."""
    return [{"prompt": [{"role": "user", "content": text}]} for text in texts]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write ``rows`` one JSON object per line; returns ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (``[]`` when it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_command(config: Path, *overrides: str) -> list[str]:
    """``fastdistill train --config <config> [key=value ...]`` with this interpreter's entry point."""
    return [str(Path(sys.executable).parent / "fastdistill"), "train", "--config", str(config), *overrides]


def train_through_cli(config: dict[str, Any], path: Path, overrides: Sequence[str] = (), *,
                      timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Write ``config`` as YAML to ``path``, run ``fastdistill train`` on it and return the run's ``metrics.jsonl``
    records; a non-zero exit raises AssertionError with the ends of its output."""
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(train_command(path, *overrides), capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_jsonl(Path(config["output_dir"]) / "metrics.jsonl")
