"""Checkpoint/resume: sharded model + optimizer state (torch.distributed.checkpoint), scheduler, RNG, model version
and the rollout cursor; plus a Hugging Face folder export that vLLM can serve.

Layout of ``<output_dir>/checkpoint-<step>/``:

- ``state/``: the DCP checkpoint of ``{"model", "optim"}`` (each rank writes its shards);
- ``trainer_state.json``: step, model version, scheduler state;
- ``rng_state_<rank>.pt``: python / numpy / torch RNG states of every rank;
- ``rollout_state.json``: TRL's keys ``prompt_index`` (first prompt not yet trained) and ``model_version``, plus ours,
  ``trained_prompt_ids_after`` (prompts beyond ``prompt_index`` already trained), so that a resume trains every
  prompt exactly once (TRL 1.16 resumes at its first untrained prompt and replays everything after it), and
  ``data``, what the prompt ids refer to (row count, seed, shuffle flag, epochs and a fingerprint of the data: see
  :class:`~fastdistill.train.ledger.DataIdentity`), which a resume checks.

A checkpoint is written to ``checkpoint-<step>.tmp`` and renamed once every rank is done, so a run killed while
saving leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from fastdistill.sync.peers import await_main
from fastdistill.train.lora import export_merged
from fastdistill.train.model import WRAPPER_PREFIX

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RolloutState:
    """Which prompts are trained: all ids below ``prompt_index`` plus ``trained_after`` (ids above it); ``data``:
    the JSON form of the run's :class:`~fastdistill.train.ledger.DataIdentity` (None when unknown)."""

    prompt_index: int = 0
    trained_after: set[int] = field(default_factory=set)
    data: dict[str, Any] | None = None

    def add(self, prompt_id: int) -> None:
        """Mark ``prompt_id`` trained and advance ``prompt_index`` over the contiguous prefix."""
        if prompt_id < self.prompt_index or prompt_id in self.trained_after:
            raise RuntimeError(f"prompt {prompt_id} trained twice")
        self.trained_after.add(prompt_id)
        while self.prompt_index in self.trained_after:
            self.trained_after.remove(self.prompt_index)
            self.prompt_index += 1

    def is_trained(self, prompt_id: int) -> bool:
        return prompt_id < self.prompt_index or prompt_id in self.trained_after

    def count_below(self, limit: int) -> int:
        """Number of trained prompts with id < ``limit``."""
        return min(self.prompt_index, limit) + sum(1 for p in self.trained_after if p < limit)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` folder with the highest step, or None."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return max(found)[1] if found else None


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    model_version: int,
    rollout: RolloutState,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` (every rank calls this; it is collective). Returns the final folder."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f"checkpoint-{step}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging / "state"))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        staging / f"rng_state_{rank}.pt",
    )
    if rank == 0:
        (staging / "trainer_state.json").write_text(json.dumps(
            {"step": step, "model_version": model_version, "scheduler": scheduler.state_dict()}, indent=1))
        (staging / "rollout_state.json").write_text(json.dumps({
            "prompt_index": rollout.prompt_index,
            "model_version": model_version,
            "trained_prompt_ids_after": sorted(rollout.trained_after),
            **({"data": rollout.data} if rollout.data is not None else {}),
        }))
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        if save_total_limit is not None:
            older = sorted((int(m.group(1)), p) for p in output_dir.iterdir()
                           if p.is_dir() and (m := _CHECKPOINT.match(p.name)))
            for _, path in older[:-save_total_limit]:
                shutil.rmtree(path, ignore_errors=True)
    _barrier()
    return final


@dataclass
class ResumedState:
    step: int
    model_version: int
    rollout: RolloutState


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> ResumedState:
    """Restore model, optimizer, scheduler and this rank's RNG from ``path``; return step, version and cursor."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a fastdistill checkpoint (no trainer_state.json)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    scheduler.load_state_dict(trainer_state["scheduler"])
    rng_path = path / f"rng_state_{_rank()}.pt"
    if rng_path.is_file():
        rng = torch.load(rng_path, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return ResumedState(int(trainer_state["step"]), int(trainer_state["model_version"]), read_rollout_state(path))


def read_rollout_state(path: str | Path) -> RolloutState:
    """The rollout cursor and data record of checkpoint folder ``path`` (``rollout_state.json``; no model read)."""
    rollout_json = json.loads((Path(path) / "rollout_state.json").read_text())
    return RolloutState(int(rollout_json["prompt_index"]), set(rollout_json.get("trained_prompt_ids_after", [])),
                        rollout_json.get("data"))


def export_hf(model: torch.nn.Module, hf_model: torch.nn.Module, tokenizer: Any, path: str | Path,
              prefix: str = "") -> Path | None:
    """Gather the full state dict (collective) and, on rank 0, write a Hugging Face folder (safetensors weights,
    config, tokenizer) that ``from_pretrained`` and vLLM load. ``prefix`` is stripped from the state-dict names
    (the wrapper's attribute holding ``hf_model``)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() != 0:
        await_main()  # rank 0 writes alone: wait in the store (heartbeat-bounded), not in the barrier
        _barrier()
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name.removeprefix(prefix): tensor for name, tensor in state.items()}
    hf_model.save_pretrained(path, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    await_main()
    _barrier()
    return path


def export_final_model(config: Any, model: torch.nn.Module, hf_model: torch.nn.Module, tokenizer: Any,
                       path: str | Path, is_main: bool) -> Path | None:
    """With ``export_final_model``: the trained model as a Hugging Face folder at ``path`` (collective; rank 0
    writes), the LoRA adapters merged in when ``lora_r`` > 0. Returns the folder on rank 0."""
    if not config.export_final_model:
        return None
    if config.lora_r > 0:
        return export_merged(hf_model, tokenizer, path, is_main)
    return export_hf(model, hf_model, tokenizer, path, WRAPPER_PREFIX)
