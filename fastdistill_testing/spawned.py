"""Run a function in several spawned processes (one per rank) and collect what each reports (tests)."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any


def file_rendezvous() -> str:
    """An ``init_method`` for ``torch.distributed.init_process_group`` through a new file: unlike a free TCP port
    picked in advance, nothing else on the machine can take it before the ranks meet. The folder is removed when this
    process exits."""
    folder = tempfile.mkdtemp(prefix="fastdistill-rendezvous-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return "file://" + os.path.join(folder, "store")


def run_ranks(target: Callable[..., None], args: Sequence[Any], *, world_size: int = 2, timeout_s: float = 120.0,
              join_s: float = 30.0) -> list[dict[str, Any]]:
    """Start ``target(rank, *args, results)`` in ``world_size`` spawned processes; each puts one dict with a
    ``"rank"`` key into ``results``. Returns the dicts sorted by rank once every process exited with code 0;
    raises AssertionError naming the exit codes otherwise (a rank that does not report within ``timeout_s`` raises
    ``queue.Empty``). Processes still alive ``join_s`` seconds after the results are killed."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=target, args=(rank, *args, results)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        outcomes = sorted((results.get(timeout=timeout_s) for _ in procs), key=lambda o: o["rank"])
    finally:
        for proc in procs:
            proc.join(timeout=join_s)
            if proc.is_alive():
                proc.kill()
    exit_codes = [proc.exitcode for proc in procs]
    assert exit_codes == [0] * world_size, f"rank exit codes {exit_codes}"
    return outcomes
