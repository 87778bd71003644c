"""One fastdistill training run with student snapshots (a helper of bench_e2e.py).

``python benchmarks/e2e_ours_run.py config.yaml SNAPSHOT_EVERY``: ``fastdistill train --config config.yaml``'s run
(the same trainer, config and logging), plus the snapshot hook of ``e2e_quality.Snapshotter`` on the trainer's
``on_step_end`` (rank 0, after a step's record is logged: after its optimizer step and weight sync), writing into
``<output_dir>/snapshots``; SNAPSHOT_EVERY 0 takes none.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(config_path: str, every: int) -> None:
    from e2e_quality import Snapshotter

    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = AsyncDistillationConfig.from_yaml(config_path, [])
    holder: list[AsyncDistillationTrainer] = []
    hook = None
    if every > 0:
        snapshot = Snapshotter(Path(config.output_dir) / "snapshots", every, config.max_steps)

        def hook(step: int, _metrics: dict[str, float]) -> None:
            snapshot(step, holder[0].hf_model)

    holder.append(AsyncDistillationTrainer(config, on_step_end=hook))
    summary = holder[0].train()
    logging.getLogger("fastdistill.bench").info("trained %d steps, %.1f trained tokens/s", summary["steps"],
                                                summary["trained_tokens_per_s"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
