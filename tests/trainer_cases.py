"""What the offline trainer tests share: a tiny student folder, synthetic scored samples and a config without
servers (``samples=`` runs: no rollout, no weight sync)."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig

TEACHERS = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}


def tiny_student_dir(tmp_path_factory: Any) -> Path:
    """A tiny Qwen3-shaped student (seed 7) saved as a Hugging Face folder with its tokenizer."""
    tokenizer = build_tokenizer()
    model = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("student"))


def synthetic_run_samples(count: int) -> list:
    """``count`` samples scored by a tiny teacher (seed 3), routed over :data:`TEACHERS`."""
    from run_trainer import teacher_and_samples

    return teacher_and_samples(count, seed=3, teacher_ids=list(TEACHERS))


def offline_config(student_dir: Path, output_dir: Path, **overrides: Any) -> AsyncDistillationConfig:
    """A config for ``samples=`` runs: no weight sync, fixed-count batches, no export or checkpoints unless asked."""
    values = dict(model_name_or_path=str(student_dir), output_dir=str(output_dir), teacher_server_urls=TEACHERS,
                  weight_sync_backend="none", learning_rate=1e-3, num_train_epochs=1, gradient_checkpointing=False,
                  disable_tqdm=True, save_strategy="no", token_budget=0, export_final_model=False)
    values.update(overrides)
    return AsyncDistillationConfig(**values)


class QueueWorker:
    """The rollout worker's surface that ``WorkerSource`` reads, over a fixed list of samples: a sample queue,
    health (the queue running dry is a test failure) and the prompts handed back for regeneration."""

    def __init__(self, samples: list[Any]):
        self.samples: queue.Queue = queue.Queue()
        for sample in samples:
            self.samples.put(sample)
        self.redone: list[int] = []

    def check_health(self, stale_after_s: float) -> None:
        raise AssertionError("the queue ran dry")

    def redo(self, prompt_ids: list[int]) -> None:
        self.redone.extend(prompt_ids)


def with_rollout_logprobs(samples: list[Any], model: Any, shift: float, versions: list[int]) -> list[Any]:
    """Copies of ``samples`` stamped with ``versions`` (one per sample) whose rollout (behaviour) log-probs are
    ``model``'s own log-probs of the completion tokens minus ``shift`` (so π_θ/μ = e^shift on every token)."""
    import dataclasses

    import torch

    out = []
    for sample, version in zip(samples, versions, strict=True):
        ids = torch.tensor(sample.input_ids[None].astype("int64"))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
        completion = torch.tensor(sample.completion_ids.astype("int64"))
        own = logprobs[sample.prompt_length - 1 : -1].gather(1, completion[:, None]).squeeze(1)
        out.append(dataclasses.replace(sample, model_version=version,
                                       rollout_logprobs=(own - shift).numpy().astype("float32")))
    return out
