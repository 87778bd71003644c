"""The trainer's process group: init_distributed joins it, Distributed.close destroys it only if it made it, and
options that need a single trainer process are refused at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fastdistill.errors import ConfigError
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.distributed import check_world_size, init_distributed
from fastdistill_testing.spawned import file_rendezvous, run_ranks


def _rank(rank: int, init_method: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    group = init_distributed(init_method)
    joined = dist.is_initialized() and dist.get_world_size() == 2 and group.rank == rank and group.owns_group
    total = group.all_reduce_sum(__import__("torch").tensor([rank + 1.0])).item()
    group.close()
    destroyed = not dist.is_initialized()
    group.close()  # again: nothing to do
    results.put({"rank": rank, "joined": joined, "total": total, "destroyed": destroyed})


def test_close_destroys_the_group_init_distributed_created():
    outcomes = run_ranks(_rank, (file_rendezvous(),))
    assert [o["joined"] for o in outcomes] == [True, True] and [o["total"] for o in outcomes] == [3.0, 3.0]
    assert [o["destroyed"] for o in outcomes] == [True, True]


def test_close_leaves_a_group_it_did_not_create(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "1")
        single = init_distributed()
        assert not single.owns_group
        single.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_single_process_options_are_refused_at_start_up_with_several_ranks():
    verify = AsyncDistillationConfig(model_name_or_path="m", verify_weight_sync=True)
    check_world_size(verify, 1)
    with pytest.raises(ConfigError, match=r"verify_weight_sync=True needs a single trainer process, but 2 run"):
        check_world_size(verify, 2)
    overlap = AsyncDistillationConfig(model_name_or_path="m", weight_sync_overlap=True)
    with pytest.raises(ConfigError, match=r"weight_sync_overlap=True needs a single trainer process, but 4 run"):
        check_world_size(overlap, 4)
    check_world_size(AsyncDistillationConfig(model_name_or_path="m"), 8)


def test_a_file_rendezvous_folder_is_removed_when_the_process_ends():
    code = "from fastdistill_testing.spawned import file_rendezvous; print(file_rendezvous())"
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    folder = Path(printed.strip().removeprefix("file://")).parent
    exists = folder.exists()
    shutil.rmtree(folder, ignore_errors=True)
    assert folder.name.startswith("fastdistill-rendezvous-") and not exists
