"""One trainer process in a process group its caller created: the student is FSDP2-sharded over a group of one rank
(the multi-GPU code path on one device, what the GPU step check runs over NCCL) and trains exactly like the same
process without a group; the options that need an unsharded process are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fastdistill.errors import ConfigError
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.distributed import check_world_size
from fastdistill.train.trainer import AsyncDistillationTrainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_cases import offline_config, synthetic_run_samples, tiny_student_dir  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


def train(student_dir: Path, output: Path, samples: list) -> tuple[AsyncDistillationTrainer, list[float]]:
    losses: list[float] = []
    config = offline_config(student_dir, output, max_steps=STEPS, per_device_train_batch_size=2)
    trainer = AsyncDistillationTrainer(config, samples=samples, on_step_end=lambda step, logged: losses.append(
        logged["loss"]))
    trainer.train()
    return trainer, losses


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def test_one_rank_in_a_group_trains_sharded_exactly_like_one_process_without_a_group(student_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    samples = synthetic_run_samples(2 * STEPS)
    plain, plain_losses = train(student_dir, tmp_path / "plain", samples)
    assert not plain.dist.sharded and not any(isinstance(p, DTensor) for p in plain.model.parameters())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded, sharded_losses = train(student_dir, tmp_path / "sharded", samples)
        assert sharded.dist.sharded and sharded.dist.world_size == 1
        assert all(isinstance(p, DTensor) for p in sharded.model.parameters())
        # Float32 on one rank: FSDP2's reduce-scatter of one rank and its DTensor norm for clipping do the same
        # arithmetic as the plain process, so the runs agree to float32 rounding (a few ulps per step).
        assert sharded_losses == pytest.approx(plain_losses, rel=1e-5)
        expected, got = full_weights(plain.model), full_weights(sharded.model)
        assert expected.keys() == got.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved = max((value - w).abs().max().item() for value, w in zip(
            expected.values(), full_weights(AsyncDistillationTrainer(
                offline_config(student_dir, tmp_path / "untrained"), samples=samples).model).values(), strict=True))
        assert moved > 1e-4  # the runs trained: the comparison is not between two untouched models
    finally:
        dist.destroy_process_group()


def test_options_that_need_an_unsharded_process_are_refused_for_one_sharded_rank():
    for name in ("verify_weight_sync", "weight_sync_overlap"):
        config = AsyncDistillationConfig(model_name_or_path="m", **{name: True})
        check_world_size(config, 1, sharded=False)
        with pytest.raises(ConfigError, match=rf"{name}=True needs a single trainer process, but its student is "
                                              r"FSDP2-sharded over a process group of one rank"):
            check_world_size(config, 1, sharded=True)
