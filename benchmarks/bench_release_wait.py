"""The wait a parked rank adds after rank 0's solo work: :func:`fastdistill.sync.peers.await_main` at 2 ranks.

Rank 0 (this process) hosts a TCPStore, as torchrun's agent does, and a second process is rank 1. Per trial rank 0
works alone for ``W`` seconds (a sleep: rollouts, an evaluation) while rank 1 waits in
``MainRelease.wait`` (what ``await_main`` runs); rank 0 notes ``time.monotonic()`` just before its release, rank 1
just after its wait returns (one clock: ``CLOCK_MONOTONIC`` is the host's, shared by both processes). The added wait
is the difference: what every multi-rank step pays on top of rank 0's work. Each rank's store is a client of its
own with the key prefix the trainer uses, and the watch that tells rank 0's failure is present (not started).

    python benchmarks/bench_release_wait.py --label after            # table + benchmarks/results/...json
    python benchmarks/bench_release_wait.py --work 0.01 0.1 --repeats 3 --label quick
    git show 0898f7b:fastdistill/sync/peers.py > /tmp/peers_poll.py    # an earlier version, in the same load:
    python benchmarks/bench_release_wait.py --peers /tmp/peers_poll.py --label before
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_peers(path: str | None):
    """``fastdistill.sync.peers``, or the module at ``path`` (another version of it, for a before/after)."""
    if path is None:
        from fastdistill.sync import peers as module

        return module
    spec = importlib.util.spec_from_file_location("peers_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peers = load_peers(next((sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == "--peers"), None))

RESULTS = Path(__file__).resolve().parent / "results"


def release_for(port: int, rank: int) -> peers.MainRelease:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600),
                           wait_for_workers=False)
    store = peers.prefixed(client, "bench/")
    watch = peers.PeerWatch(store, rank, 2, timeout_s=60.0)  # not started: the failure reads only
    if rank == 0:
        watch.beat()
    return peers.MainRelease(store, rank, watch)


def run_rank1(port: int, trials: int) -> None:
    control = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    release = release_for(port, 1)
    control.set("rank1/ready", "1")
    for trial in range(trials):
        release.wait()
        control.set(f"back/{trial}", repr(time.monotonic()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=float, nargs="+", default=[0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0],
                        help="rank 0's solo work per trial, seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="run", help="names the JSON file: results/release_wait_<label>.json")
    parser.add_argument("--peers", help="a peers.py to measure instead of fastdistill.sync.peers (another version)")
    parser.add_argument("--rank1", type=int, help=argparse.SUPPRESS)  # the port: run as rank 1
    parser.add_argument("--trials", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank1 is not None:
        run_rank1(args.rank1, args.trials)
        return
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plan = [work for work in args.work for _ in range(args.repeats)]
    child = subprocess.Popen([sys.executable, __file__, "--rank1", str(master.port), "--trials", str(len(plan))]
                             + (["--peers", args.peers] if args.peers else []))
    try:
        release = release_for(master.port, 0)
        master.wait(["rank1/ready"])
        added: dict[float, list[float]] = {work: [] for work in args.work}
        for trial, work in enumerate(plan):
            time.sleep(work)  # rank 0 alone; rank 1 entered its wait right after its previous one returned
            released = time.monotonic()
            release.wait()
            added[work].append(float(master.get(f"back/{trial}")) - released)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    rows = [{"work_s": work, "added_ms_median": 1e3 * statistics.median(xs), "added_ms_min": 1e3 * min(xs),
             "added_ms_max": 1e3 * max(xs), "share_of_work_pct": 100 * statistics.median(xs) / work, "n": len(xs)}
            for work, xs in added.items()]
    print(f"{'work (s)':>9} {'added median (ms)':>18} {'min':>8} {'max':>8} {'% of work':>10}")
    for row in rows:
        print(f"{row['work_s']:>9g} {row['added_ms_median']:>18.2f} {row['added_ms_min']:>8.2f} "
              f"{row['added_ms_max']:>8.2f} {row['share_of_work_pct']:>10.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"release_wait_{args.label}.json"
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": platform.node(),
        "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "command": " ".join(sys.argv), "rows": rows}, indent=2)
        + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
