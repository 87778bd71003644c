"""The trainer: config, loop, checkpoint/resume, metrics."""
