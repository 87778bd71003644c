"""Every wait of the trainer ranks bounded and named (fastdistill.sync.peers, train/distributed.py): the heartbeat
names a silent rank (SIGSTOP: alive, sockets open, nothing answers) on every surviving rank long before the
collective timeout, at a store load that grows with the ranks, not their square; a rank whose own heartbeat thread
was starved (its main thread held Python's lock) says so; rank 0's long solo waits park the others in a blocking
store wait, so a wait longer than ``ddp_timeout`` ends with fastdistill's own error; a weight push whose trainer peer
stalls in the FSDP all-gather names that peer, not the student.

The ranks are subprocesses started like torchrun's workers (env:// rendezvous on a TCPStore this test hosts, as
torchrun's agent does). Bounds are hang guards far above the configured heartbeat, never timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from fastdistill.errors import LostRankError, ServerDownError, WeightSyncError
from fastdistill.supervise import death_signal_setter
from fastdistill.sync import peers
from fastdistill.sync.naming import GatherClock

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 240.0  # a run that ends only at the collective timeout (600 s below) fails here instead

# ------------------------------------------------------------------------------------------------ the watch itself


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingStore:
    """A store that counts its calls and the keys they touch, per method, and lists them in order (``ops``);
    ``first_op`` is set on the first call."""

    def __init__(self, store):
        self.store, self.calls, self.keys, self.ops = store, Counter(), Counter(), []
        self.first_op = threading.Event()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            keys = args[0] if args and isinstance(args[0], list) else [args[0]] if args else []
            self.calls[name] += 1
            self.keys[name] += len(keys)
            self.ops.append((name, list(keys)))
            self.first_op.set()
            return method(*args, **kwargs)

        return counted


def watches(world_size: int, timeout_s: float = 10.0, store=None) -> tuple[list[peers.PeerWatch], FakeClock, list]:
    store, clock, lost = store or peers.prefixed(dist.HashStore()), FakeClock(), []
    made = [peers.PeerWatch(store, rank, world_size, timeout_s=timeout_s, clock=clock,
                            addresses=[f"10.0.0.{rank + 1}" for rank in range(world_size)], on_lost=lost.append)
            for rank in range(world_size)]
    for watch in made:
        watch.announce()
    for watch in made:
        watch.check()
    return made, clock, lost


@pytest.mark.parametrize("world_size", [4, 256, 1024])
def test_the_heartbeat_s_store_load_grows_with_the_ranks_not_their_square(world_size):
    """One interval of every rank's heartbeat, counted at the store: each rank writes its beat (1 call, 1 key) and
    reads in one call the loss key and what it watches: rank 0 every other rank's beat (N keys), the others rank 0's
    (2 keys). So 2N calls and N + N + 2(N − 1) = 4N − 2 keys per interval. At the 2 s interval (timeouts of 10 s and
    more): 256 ranks make 256 calls/s (511 keys/s), 1,024 ranks 1,024 calls/s (2,047 keys/s). Before, every rank read
    every other rank's key with a call of its own: N(N + 1) calls per interval, 32,896/s at 256 ranks."""
    store = CountingStore(peers.prefixed(dist.HashStore()))
    made, clock, _ = watches(world_size, store=store)
    store.calls.clear(), store.keys.clear()
    clock.now = 2.0
    for watch in made:
        assert watch.round() is None
    n = world_size
    assert dict(store.calls) == {"set": n, "multi_get": n}
    assert dict(store.keys) == {"set": n, "multi_get": n + 2 * (n - 1)}
    interval = made[0].interval_s
    assert interval == 2.0 and sum(store.calls.values()) / interval == n
    if n == 256:
        assert sum(store.keys.values()) / interval == 511
    if n == 1024:
        assert sum(store.keys.values()) / interval == 2_047


def test_a_rank_whose_heartbeat_stops_is_named_once_silent_longer_than_the_timeout():
    """Rank 0 finds rank 2 silent and publishes the loss once; rank 1 (which watches rank 0 only) reads it in its
    next round and ends naming rank 2 too."""
    (w0, w1, w2), clock, _ = watches(3)
    for _ in range(3):  # rank 2 goes silent at 0; ranks 0 and 1 go on beating every 3 s
        clock.now += 3.0
        assert w0.round() is None and w1.round() is None
    clock.now = 10.5
    assert w1.round() is None  # rank 1 does not watch rank 2; rank 0 has not looked yet
    error = w0.round()
    assert isinstance(error, LostRankError)
    assert str(error).startswith("rank 0 lost trainer rank(s) 2 of 3 (at 10.0.0.3): no heartbeat for 10 s "
                                 "(rank_heartbeat_timeout_s=10, seen by rank 0)")
    assert str(w1.round()).startswith("rank 1 lost trainer rank(s) 2 of 3 (at 10.0.0.3): no heartbeat for 10 s")
    assert w0.silent(5.0) == [(2, 10.5)]


def test_the_other_ranks_watch_rank_0_and_the_first_loss_found_is_the_one_every_rank_reports():
    (w0, w1, w2), clock, _ = watches(3)
    clock.now = 10.5  # rank 0 silent since 0; ranks 1 and 2 beat
    assert str(w1.round()).startswith("rank 1 lost trainer rank(s) 0 of 3 (at 10.0.0.1): no heartbeat for 10 s "
                                      "(rank_heartbeat_timeout_s=10, seen by rank 1)")
    assert str(w2.round()).startswith("rank 2 lost trainer rank(s) 0 of 3 (at 10.0.0.1): no heartbeat for 10 s "
                                      "(rank_heartbeat_timeout_s=10, seen by rank 1)")  # rank 1's, stored first


def test_the_ranks_of_a_node_that_go_silent_together_are_named_together():
    store, clock = peers.prefixed(dist.HashStore()), FakeClock()
    addresses = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]  # two nodes of two ranks
    made = [peers.PeerWatch(store, rank, 4, timeout_s=10.0, interval_s=2.0, clock=clock,
                            addresses=addresses, on_lost=lambda error: None) for rank in range(4)]
    for watch in made:
        watch.announce()
    made[0].check()
    clock.now = 1.0
    made[3].beat()  # rank 3's last beat lands a second after rank 2's
    made[0].check()
    clock.now = 10.5
    made[1].beat()
    assert str(made[0].check()).startswith("rank 0 lost trainer rank(s) 2, 3 of 4 (at 10.0.0.2): no heartbeat for "
                                           "10 s")


def test_a_rank_done_is_no_longer_watched_and_a_failed_one_is_named_after_the_grace():
    (w0, w1, w2), clock, _ = watches(3)
    w1.stop()  # ended normally: marked done
    w2.stop(RuntimeError("boom"))
    clock.now = 5.0
    assert w0.round() is None  # the failure's grace: its own error path usually ends the others first
    clock.now = 15.5  # the timeout after the failure was first read
    assert str(w0.round()) == "rank 0: trainer rank 2 of 3 (at 10.0.0.3) failed: RuntimeError: boom"
    assert w0.peer_failure(2) == "RuntimeError: boom" and w0.peer_failure(1) is None


def test_a_rank_whose_own_heartbeat_was_starved_says_so_not_that_it_lost_the_store_or_rank_0():
    """Rank 1's main thread holds Python's lock from 4 s to 19 s: its heartbeat thread does not run. Rank 0 finds it
    silent at 18 s and publishes the loss; when rank 1's thread runs again it reads a loss naming itself and knows
    its own beats were 15 s apart: it says its heartbeat was starved (before: rank 0 silent for 15 s, as it read)."""
    (w0, w1), clock, _ = watches(2)
    for now in (2.0, 4.0):
        clock.now = now
        assert w0.round() is None and w1.round() is None
    for now in (6.0, 8.0, 10.0, 12.0, 14.0, 16.0):  # rank 0 read rank 1's last beat (of 4 s) at 6 s
        clock.now = now
        assert w0.round() is None
    clock.now = 18.0
    assert str(w0.round()).startswith("rank 0 lost trainer rank(s) 1 of 2 (at 10.0.0.2): no heartbeat for 12 s")
    clock.now = 19.0
    error = str(w1.round())
    assert error.startswith("rank 1 of 2: its own heartbeat was starved: its heartbeat thread did not run for 15 s "
                            "(rank_heartbeat_timeout_s=10), so rank 0 counted it lost (no heartbeat for 12 s): this "
                            "process's main thread held Python's lock"), error
    assert "store" not in error.split("not a lost store")[0] and "lost trainer rank" not in error


def test_a_loss_key_this_version_did_not_write_still_ends_the_rank_with_its_text():
    (w0, w1), _, _ = watches(2)
    w0.store.set("lost", "stopped by hand")
    assert str(w1.check()) == "rank 1: another trainer rank reported a loss: b'stopped by hand'"


def test_a_rank_named_lost_though_its_heartbeat_thread_ran_blames_the_way_to_the_store():
    (w0, w1), clock, _ = watches(2)
    clock.now = 10.5  # rank 1's beats did not reach the store (its thread ran: no gap of its own)
    assert str(w0.round()).startswith("rank 0 lost trainer rank(s) 1 of 2")
    assert "though its heartbeat thread ran: its heartbeats did not reach the store" in str(w1.check())


def test_the_store_bound_counts_only_a_stall_its_thread_saw():
    """The bounding thread declares the store lost when a round has been in flight for the timeout plus an interval
    while it ticked; a tick that comes late (this process did not run) restarts the count."""
    clock = FakeClock()
    watch = peers.PeerWatch(peers.prefixed(dist.HashStore()), 1, 2, timeout_s=10.0, clock=clock,
                            store_host="10.0.0.1:29500")
    watch._round_started = 0.0  # a round in flight since 0
    for now in range(2, 13, 2):
        clock.now = float(now)
        assert watch.bound_tick() is None
    clock.now = 12.5
    assert str(watch.bound_tick()).startswith("rank 1 of 2 lost the rendezvous store at 10.0.0.1:29500 (trainer "
                                              "rank 0's host): no answer for 12 s")
    clock.now = 0.0
    starved = peers.PeerWatch(peers.prefixed(dist.HashStore()), 1, 2, timeout_s=10.0, clock=clock)
    starved._round_started = 0.0
    clock.now = 20.0  # the next tick 20 s later: the whole process was held, the store never had a chance
    assert starved.bound_tick() is None
    for now in (22.0, 24.0, 26.0, 28.0, 30.0):
        clock.now = now
        assert starved.bound_tick() is None  # 10 s seen since the late tick: not yet
    clock.now = 32.5
    assert "no answer for 12 s" in str(starved.bound_tick())


def test_stop_marks_the_rank_done_after_its_last_beat():
    """The watching thread is joined before the mark is written: a beat in flight cannot overwrite "done" (the
    others would then see a silent rank at the end of a normal run)."""
    store = peers.prefixed(dist.HashStore())
    watch = peers.PeerWatch(store, 0, 2, timeout_s=60.0, interval_s=0.001, on_lost=lambda error: None)
    store.set("beat/1", "1")
    watch.start()
    watch.stop()
    assert not watch._thread.is_alive() and store.get("beat/0") == b"done"


def test_a_store_that_stops_answering_names_the_store_s_host():
    class DeadStore:
        def set(self, *args):
            raise RuntimeError("Socket Timeout\nmore")

    lost = []
    watch = peers.PeerWatch(DeadStore(), 1, 2, timeout_s=5.0, interval_s=0.01, store_host="10.0.0.1:29500",
                            on_lost=lost.append)
    watch._thread = None
    watch._run()  # one round: the store times out
    assert str(lost[0]).startswith("rank 1 of 2 lost the rendezvous store at 10.0.0.1:29500 (trainer rank 0's "
                                   "host): no answer within rank_heartbeat_timeout_s=5 s (Socket Timeout)")


def test_a_store_operation_that_never_returns_is_bounded_by_the_heartbeat_timeout():
    """A TCPStore read towards a host whose link is cut blocks until TCP gives up (minutes): a second thread
    declares the store lost once the watching thread's round has not come back for the timeout."""
    release, lost_event, lost = threading.Event(), threading.Event(), []

    class BlockingStore:
        def __init__(self):
            self.calls = 0

        def set(self, *args):
            self.calls += 1
            if self.calls > 1:  # the first beat (start) answers; the next one never does
                release.wait()

        def compare_set(self, key, expected, desired):
            return desired if isinstance(desired, bytes) else desired.encode()

        def multi_get(self, keys):
            return [b""] * len(keys)

    def on_lost(error):
        lost.append(error)
        lost_event.set()

    watch = peers.PeerWatch(BlockingStore(), 1, 2, timeout_s=0.3, interval_s=0.05, store_host="10.0.0.1:29500",
                            on_lost=on_lost).start()
    try:
        assert lost_event.wait(timeout=60), "the blocked store was never declared lost"
    finally:
        release.set()
        watch.stop()
    assert str(lost[0]).startswith("rank 1 of 2 lost the rendezvous store at 10.0.0.1:29500 (trainer rank 0's "
                                   "host): no answer for")
    assert len(lost) == 1


def test_a_gather_stall_in_a_weight_push_names_the_silent_trainer_rank_not_the_student():
    from fastdistill.sync.threads import TaskFailed
    from fastdistill.sync.weights import VLLMWeightSync

    (w0, _), clock, _ = watches(2)
    clock.now = 9.0  # rank 1 silent for 9 s (more than two beats)
    w0.beat()
    w0.check()
    gathers = GatherClock(clock=clock)
    sync = VLLMWeightSync("http://10.0.0.9:8000")
    failure = TaskFailed(None, [], "still running after 30 s: /collective_rpc, broadcast")
    assert sync._trainer_stall(gathers, failure) is None  # no gather involved: the student's failure
    peers.activate(peers.MainRelease(w0.store, 0, w0))
    try:
        with pytest.raises(RuntimeError), gathers.gathering("model.layers.0.mlp.up_proj.weight"):
            clock.now = 12.0
            error = sync._trainer_stall(gathers, failure)
            raise RuntimeError("leave the gather")
    finally:
        peers.activate(None)
    assert isinstance(error, LostRankError)
    assert str(error).startswith("rank 0 lost trainer rank(s) 1 of 2 (at 10.0.0.2) during a weight push: the "
                                 "trainer ranks' own all-gather of model.layers.0.mlp.up_proj.weight")
    assert "the student (http://10.0.0.9:8000) was waiting for the weights, not failing" in str(error)
    gathers.current, gathers.started = "lm_head.weight", clock.now  # a gather that just began: the student's failure
    assert sync._trainer_stall(gathers, failure) is None
    clock.now += 11.0  # without a heartbeat, a gather that has not returned for long: the trainer's, not the student's
    error = sync._trainer_stall(gathers, failure)
    assert isinstance(error, WeightSyncError) and "weight push stalled in the trainer ranks' own all-gather" in str(
        error)


# ------------------------------------------------------------------------------------------------ parking


def parked(release: peers.MainRelease) -> tuple[threading.Thread, list]:
    """``release.wait()`` on a thread: the thread and the list that receives its error (or None)."""
    outcome: list = []

    def run():
        try:
            release.wait()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_parked_rank_blocks_in_one_store_wait_per_release_not_a_poll():
    """Rank 1's first store call is a blocking wait on release 1's own key (before: reads of a counter, each after
    a sleep that grew to 5 % of the wait); rank 0's release wakes it, and the key's value is its only other read."""
    hash_store = peers.prefixed(dist.HashStore())
    store1 = CountingStore(hash_store)
    rank0, rank1 = peers.MainRelease(hash_store, 0, None), peers.MainRelease(store1, 1, None, check_every_s=600)
    thread, outcome = parked(rank1)
    assert store1.first_op.wait(timeout=60)
    assert store1.ops[0] == ("wait", ["release/1"])
    rank0.wait()
    thread.join(timeout=60)
    assert outcome == [None] and store1.ops == [("wait", ["release/1"]), ("get", ["release/1"])]


def test_rank_0_s_failure_wakes_a_parked_rank_at_once():
    """Rank 0 fails while rank 1 waits for its release (check_every_s 600 s, above the hang guard): the failure
    written as the release wakes rank 1, which ends naming it."""
    hash_store = peers.prefixed(dist.HashStore())
    store1 = CountingStore(hash_store)
    rank0, rank1 = peers.MainRelease(hash_store, 0, None), peers.MainRelease(store1, 1, None, check_every_s=600)
    thread, outcome = parked(rank1)
    assert store1.first_op.wait(timeout=60)
    rank0.fail(ServerDownError("the student answered nothing for 600 s"))
    thread.join(timeout=60)
    assert isinstance(outcome[0], LostRankError) and str(outcome[0]) == (
        "rank 1: trainer rank 0 failed while this rank waited for it: ServerDownError: the student answered nothing "
        "for 600 s")


def test_a_parked_rank_reads_rank_0_s_failure_mark_when_its_wait_times_out():
    (w0, w1), _, _ = watches(2)
    rank1 = peers.MainRelease(w1.store, 1, w1, check_every_s=0.01)
    w0.stop(ServerDownError("down"))  # marked in its heartbeat key only
    with pytest.raises(LostRankError, match=r"^rank 1: trainer rank 0 \(at 10.0.0.1\) failed while this rank waited "
                                            r"for it: ServerDownError: down$"):
        rank1.wait()


def test_rank_0_keeps_the_last_releases_and_a_rank_behind_them_still_passes():
    hash_store = peers.prefixed(dist.HashStore())
    rank0, rank1 = peers.MainRelease(hash_store, 0, None), peers.MainRelease(hash_store, 1, None, check_every_s=0.01)
    for _ in range(100):
        rank0.wait()
    assert not hash_store.check(["release/36"]) and hash_store.check(["release/37"])  # the last 64 kept
    for _ in range(100):
        rank1.wait()  # the first 36 read the counter once their wait times out
    assert rank1.count == 100


def test_a_restarted_attempt_does_not_see_the_previous_attempt_s_releases(monkeypatch):
    """torchrun's agent store outlives a restart: the releases (and heartbeats) of attempt 0 are under another prefix
    than attempt 1's, also on a store that is not a TCPStore (before, only a TCPStore's keys were per attempt)."""
    from fastdistill.train import distributed

    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for made in distributed._heartbeat_stores(store, 10.0)[:2]:
        made.set("release/1", "go")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for made in distributed._heartbeat_stores(store, 10.0)[:2]:
        assert not made.check(["release/1"])
    assert distributed._attempt() == "run/1/"


def test_lost_rank_error_reads_gloo_s_timeout_but_not_a_fastdistill_error_that_mentions_a_timeout():
    import torch

    from fastdistill.errors import CollectiveTimeoutError
    from fastdistill.train.distributed import Distributed

    group = Distributed(0, 2, torch.device("cpu"), addresses=("10.0.0.1", "10.0.0.2"), timeout_s=60)
    gloo = RuntimeError("[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation")
    error = group.lost_rank_error(gloo)
    assert isinstance(error, CollectiveTimeoutError) and "timed out after ddp_timeout=60 s" in str(error)
    assert group.lost_rank_error(WeightSyncError("... within weight_sync_timeout=30 s")) is None
    (w0, _), clock, _ = watches(2)
    clock.now = 30.0
    w0.beat()
    w0.check()
    group.watch = w0
    assert str(group.lost_rank_error(gloo)).startswith("rank 0 lost trainer rank(s) 1 of 2 (at 10.0.0.2): a "
                                                       "collective timed out")


# ------------------------------------------------------------------------------------------------ real ranks

RANK = """
import os, signal, sys, time
import torch
from fastdistill.errors import ServerDownError
from fastdistill.train.distributed import init_distributed

scenario, ddp_timeout, heartbeat = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)
group = init_distributed(timeout_s=ddp_timeout, heartbeat_timeout_s=heartbeat)
if scenario == "stall":
    if group.rank == group.world_size - 1:
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    group.all_reduce_sum(torch.ones(1))
    print("all_reduce returned", flush=True)
elif scenario == "starve":
    if group.rank == 1:
        import ctypes
        print("holding the GIL", flush=True)
        ctypes.PyDLL(None).sleep(int(4 * heartbeat))  # a native call that keeps Python's lock: no thread runs
    time.sleep(600)  # the main thread waits without the lock, as in a collective: the watch ends the process
elif scenario == "long-wait":
    error = None
    try:
        if group.is_main:
            time.sleep(2.5 * ddp_timeout)  # rank 0 alone: waiting for rollouts
        got = group.scatter([f"for rank {rank}" for rank in range(group.world_size)] if group.is_main else None)
        print("scattered", got, flush=True)
        if group.is_main:
            time.sleep(1.5 * ddp_timeout)
            raise ServerDownError("the student answered nothing for 600 s")
        group.broadcast(None)
    except BaseException as failure:
        error = failure
        raise
    finally:
        group.close(error)
"""


def start_ranks(tmp_path: Path, scenario: str, world_size: int, ddp_timeout: float, heartbeat: float,
                script: str = RANK) -> list[subprocess.Popen]:
    """``world_size`` rank processes as torchrun starts them: env:// on a TCPStore hosted here (torchrun's agent
    store), the test's process group on gloo."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks.store = store  # alive as long as the test (the agent's store outlives its workers)
    path = tmp_path / "rank.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME",)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world_size),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    return [subprocess.Popen([sys.executable, str(path), scenario, str(ddp_timeout), str(heartbeat)],
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=death_signal_setter(signal.SIGKILL))
            for rank in range(world_size)]  # a stopped rank too dies with a killed test


def finish(ranks: list[subprocess.Popen], stopped: list[subprocess.Popen] = ()) -> list[str]:
    """Each rank's output once the others have ended (hang guard); a stopped rank is killed after them."""
    try:
        outputs = [rank.communicate(timeout=HANG_GUARD_S)[0] if rank not in stopped else "" for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    return outputs


@pytest.mark.slow
def test_a_stopped_rank_is_named_on_every_surviving_rank_long_before_the_collective_timeout(tmp_path):
    """Rank 2 of 3 stops (SIGSTOP: sockets open, nothing answers) while the others enter an all-reduce with it:
    ranks 0 and 1 end with LOST_PEER_EXIT_CODE and a LostRankError naming rank 2 and its address, within the hang
    guard (the collective timeout, 600 s, would come much later)."""
    ranks = start_ranks(tmp_path, "stall", 3, ddp_timeout=600, heartbeat=3)
    outputs = finish(ranks, stopped=[ranks[2]])
    for rank in (0, 1):
        assert ranks[rank].returncode == peers.LOST_PEER_EXIT_CODE, outputs[rank][-3000:]
        assert (f"fastdistill.errors.LostRankError: rank {rank} lost trainer rank(s) 2 of 3 (at 127.0.0.1): no "
                "heartbeat for") in outputs[rank], outputs[rank][-3000:]
        assert "all_reduce returned" not in outputs[rank]


@pytest.mark.slow
def test_a_rank_whose_main_thread_held_the_gil_past_the_timeout_says_its_heartbeat_was_starved(tmp_path):
    """Rank 1's main thread holds Python's lock for 4 heartbeat timeouts (a native call through ``ctypes.PyDLL``):
    rank 0 names rank 1 silent and ends; rank 1, once it runs again, ends saying its own heartbeat was starved, not
    that it lost the store or rank 0."""
    ranks = start_ranks(tmp_path, "starve", 2, ddp_timeout=600, heartbeat=2)
    outputs = finish(ranks)
    assert ranks[0].returncode == peers.LOST_PEER_EXIT_CODE, outputs[0][-3000:]
    assert ("fastdistill.errors.LostRankError: rank 0 lost trainer rank(s) 1 of 2 (at 127.0.0.1): no heartbeat "
            "for") in outputs[0], outputs[0][-3000:]
    assert ranks[1].returncode == peers.LOST_PEER_EXIT_CODE, outputs[1][-3000:]
    assert ("fastdistill.errors.LostRankError: rank 1 of 2: its own heartbeat was starved: its heartbeat thread "
            "did not run for") in outputs[1], outputs[1][-3000:]
    assert "rendezvous store" not in outputs[1] and "lost trainer rank(s) 0" not in outputs[1], outputs[1][-3000:]


@pytest.mark.slow
def test_rank_0_alone_longer_than_ddp_timeout_ends_with_its_own_error_not_the_collective_timeout(tmp_path):
    """ddp_timeout 3 s: rank 0 waits alone 7.5 s (rollouts) before a scatter, which still arrives; then it waits
    4.5 s more and fails with ServerDownError: rank 1, parked in the store for its broadcast, ends naming rank 0's
    ServerDownError. Neither rank meets gloo's timeout."""
    ranks = start_ranks(tmp_path, "long-wait", 2, ddp_timeout=3, heartbeat=2.5)
    outputs = finish(ranks)
    assert "scattered for rank 0" in outputs[0] and "scattered for rank 1" in outputs[1], outputs
    assert ranks[0].returncode == 1 and "fastdistill.errors.ServerDownError: the student answered nothing" in \
        outputs[0], outputs[0][-3000:]
    assert ranks[1].returncode not in (0, None)
    assert ("LostRankError: rank 1: trainer rank 0 (at 127.0.0.1) failed while this rank waited for it: "
            "ServerDownError: the student answered nothing for 600 s") in outputs[1], outputs[1][-3000:]
    assert not any("Timed out waiting" in output for output in outputs), outputs


PUSH_RANK = """
import os, signal, sys
import torch
from torch.distributed.fsdp import fully_shard
from fastdistill.sync import VLLMWeightSync, weights as weights_module
from fastdistill.train.distributed import init_distributed
from test_sync import FakeVLLM, tiny_model

scenario, ddp_timeout, heartbeat = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)
group = init_distributed(timeout_s=ddp_timeout, heartbeat_timeout_s=heartbeat)
model = tiny_model(tied=False, seed=3)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
fake = FakeVLLM() if group.is_main else None
sync = VLLMWeightSync(fake.url if fake else "http://127.0.0.1:1", is_sender=group.is_main, timeout_s=2,
                      one_call=True)
sync.init()
if not group.is_main:
    plain = weights_module.iter_named_weights

    def stalling(*args, **kwargs):  # rank 1 stops after its second gather: rank 0 is left inside the third
        for index, item in enumerate(plain(*args, **kwargs)):
            if index == 2:
                print("stopping", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            yield item

    weights_module.iter_named_weights = stalling
sync.push(model, version=1)
print("pushed", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ddp_timeout, heartbeat", [(600, 4), (12, 30)], ids=["heartbeat", "gather-timeout"])
def test_a_weight_push_whose_trainer_peer_stalls_names_the_peer_not_the_student(tmp_path, ddp_timeout, heartbeat):
    """Rank 1 stops in the middle of the push's FSDP all-gathers; weight_sync_timeout is 2 s, shorter than either
    bound, and yet the student is not blamed: the gathers do not count against it. With the heartbeat (4 s) rank
    0's watch names rank 1; with the all-gather's own timeout first (ddp_timeout 12 s, heartbeat 30 s) the push
    names rank 1 from its heartbeat's age."""
    ranks = start_ranks(tmp_path, "push", 2, ddp_timeout=ddp_timeout, heartbeat=heartbeat, script=PUSH_RANK)
    output = finish(ranks, stopped=[ranks[1]])[0]
    assert ranks[0].returncode not in (0, None) and "pushed" not in output, output[-3000:]
    assert "LostRankError: rank 0 lost trainer rank(s) 1 of 2 (at 127.0.0.1)" in output, output[-3000:]
    assert "weight transfer to http" not in output and "the student's part" not in output, output[-3000:]
    if heartbeat < ddp_timeout:
        assert ranks[0].returncode == peers.LOST_PEER_EXIT_CODE
    else:
        assert "during a weight push: the trainer ranks' own all-gather of" in output, output[-3000:]


def test_the_heartbeat_must_be_below_ddp_timeout_or_off():
    from fastdistill.errors import ConfigError
    from fastdistill.train.config import AsyncDistillationConfig

    with pytest.raises(ConfigError, match=r"rank_heartbeat_timeout_s must be below ddp_timeout \(20\) or 0"):
        AsyncDistillationConfig(model_name_or_path="m", ddp_timeout=20, rank_heartbeat_timeout_s=20)
    with pytest.raises(ConfigError, match="ddp_timeout must be a finite number > 0"):
        AsyncDistillationConfig(model_name_or_path="m", ddp_timeout=0)
    assert AsyncDistillationConfig(model_name_or_path="m", ddp_timeout=20, rank_heartbeat_timeout_s=0).ddp_timeout == 20


# ------------------------------------------------------------------------------------------------ the trainer

SLOW_RANK0_TRAINER = """
import json, sys, time
import fastdistill.train.source as source
from fastdistill.errors import ServerDownError
from run_trainer import main

spec = json.loads(open(sys.argv[1]).read())
plain_next = source.ListSource.next
calls = []


def slow_next(self, model_version):  # rank 0's source: its first sample comes after a long wait for rollouts
    calls.append(model_version)
    if len(calls) == 1:
        time.sleep(spec["wait_s"])  # the fault itself: rank 0 alone, longer than ddp_timeout
        if spec["fail"]:
            raise ServerDownError("the student answered nothing for 600 s (server_down_deadline_s)")
    return plain_next(self, model_version)


source.ListSource.next = slow_next
main(sys.argv[1])
"""


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    from trainer_cases import tiny_student_dir

    return tiny_student_dir(tmp_path_factory)


def run_trainer_ranks(tmp_path: Path, student_dir: Path, *, fail: bool, ddp_timeout: float,
                      heartbeat: float) -> subprocess.CompletedProcess:
    import json

    from trainer_cases import TEACHERS

    values = {"teacher_server_urls": TEACHERS, "weight_sync_backend": "none", "learning_rate": 1e-3,
              "num_train_epochs": 1, "gradient_checkpointing": False, "disable_tqdm": True, "save_strategy": "no",
              "token_budget": 0, "per_device_train_batch_size": 2, "export_final_model": False,
              "ddp_timeout": ddp_timeout, "rank_heartbeat_timeout_s": heartbeat}
    spec = {"student_dir": str(student_dir), "output_dir": str(tmp_path / "run"), "num_samples": 8, "seed": 3,
            "config": values, "wait_s": 2 * ddp_timeout, "fail": fail}
    spec_path, script = tmp_path / "spec.json", tmp_path / "slow_rank0.py"
    spec_path.write_text(json.dumps(spec))
    script.write_text(SLOW_RANK0_TRAINER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'tests'}"
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(spec_path)], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env=env, preexec_fn=death_signal_setter(signal.SIGTERM))  # torchrun ends its ranks


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True], ids=["the-wait-ends", "the-wait-fails"])
def test_a_trainer_whose_rank_0_waits_longer_than_ddp_timeout(tmp_path, student_dir, fail):
    """Two trainer ranks (torchrun, gloo), ddp_timeout 4 s: rank 0's source keeps it waiting 8 s for its first
    sample while rank 1 waits for the window's scatter. When the samples then come the run trains every prompt
    once; when rank 0's wait ends with ServerDownError the run ends with it. Neither meets gloo's timeout."""
    done = run_trainer_ranks(tmp_path, student_dir, fail=fail, ddp_timeout=4, heartbeat=3)
    output = done.stdout + done.stderr
    assert "Timed out waiting" not in output and "CollectiveTimeoutError" not in output, output[-4000:]
    if not fail:
        assert done.returncode == 0, output[-4000:]
        from fastdistill_testing.runs import read_jsonl

        trained = [p for line in read_jsonl(tmp_path / "run" / "trained_prompts.jsonl") for p in line["prompt_ids"]]
        assert sorted(trained) == list(range(8))
    else:
        assert done.returncode != 0
        assert "fastdistill.errors.ServerDownError: the student answered nothing for 600 s" in output, output[-4000:]
