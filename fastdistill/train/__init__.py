"""The trainer: config, loop, checkpoint/resume, metrics, held-out evaluation."""

from fastdistill.errors import ConfigError
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer, DistillationModel

__all__ = ["AsyncDistillationConfig", "AsyncDistillationTrainer", "ConfigError", "DistillationModel"]
