"""The parts the multi-host tests stand on, without vLLM: the namespaced test cluster (partition, listeners,
teardown, stale cleanup), the multi-node launcher's commands, and the library's bind and interface choices (the
weight-sync store listens on its address only; the trainer's gloo group binds to the interface towards
MASTER_ADDR)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastdistill import launch as launcher
from fastdistill.cli import main
from fastdistill.errors import ConfigError
from fastdistill.sync.network import interface_towards, interface_with_address
from fastdistill.sync.transport import create_store
from fastdistill.train import distributed
from fastdistill_testing import cluster as cluster_module
from fastdistill_testing.cluster import (
    PREFIX,
    Listener,
    NetnsCluster,
    _parse_proc_net_tcp,
    cluster_namespaces,
    remove_stale_namespaces,
    require_netns,
    wait_for,
)
from fastdistill_testing.stubs import interface_ipv4_addresses

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ /proc/net/tcp


def test_proc_net_tcp_lines_parse_to_listening_addresses():
    """Lines as the kernel prints them (little-endian words): LISTEN rows only, IPv4 and IPv6."""
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
           "   1: 02004D0A:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
           "   2: 00000000:7334 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1\n"
           "   3: 02004D0A:1F41 01004D0A:C000 01 00000000:00000000 00:00000000 00000000     0        0 4 1\n")
    assert _parse_proc_net_tcp(tcp, socket.AF_INET) == [
        Listener("127.0.0.1", 8000), Listener("10.77.0.2", 8001), Listener("0.0.0.0", 29492)]
    tcp6 = ("  sl  local_address                         remote_address                        st\n"
            "   0: 00000000000000000000000000000000:7334 00000000000000000000000000000000:0000 0A 0 0 0 0 0\n"
            "   1: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 0 0 0 0 0\n")
    assert _parse_proc_net_tcp(tcp6, socket.AF_INET6) == [Listener("::", 29492), Listener("::1", 8000)]
    assert Listener("::", 1).on_every_interface and Listener("0.0.0.0", 1).on_every_interface
    assert not Listener("10.77.0.2", 1).on_every_interface


def own_listeners() -> list[Listener]:
    found = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if os.path.exists(path):
            found += _parse_proc_net_tcp(Path(path).read_text(), family)
    return found


# ------------------------------------------------------------------------------------------------ library binds


def test_the_weight_sync_store_listens_on_its_master_address_only():
    """Left to itself a TCPStore listens on every interface (``*:port``); the trainer's binds its address."""
    store = create_store("127.0.0.1", 0, rank=0, world_size=1, timeout_s=10)
    try:
        on_port = [listener for listener in own_listeners() if listener.port == store.port]
        assert on_port == [Listener("127.0.0.1", store.port)]
        store.set("key", "value")
        client = create_store("127.0.0.1", store.port, rank=1, world_size=1, timeout_s=10)
        assert client.get("key") == b"value"
    finally:
        del store


def test_the_weight_sync_store_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            create_store("127.0.0.1", taken.getsockname()[1], rank=0, world_size=1, timeout_s=5)


def test_the_interface_towards_an_address_is_the_one_holding_the_route_s_source():
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_towards("127.0.0.1") is None and interface_towards("localhost") is None
    assert interface_towards("no-such-host.invalid") is None
    others = [a for a in interface_ipv4_addresses() if not a.startswith("127.")]
    if not others:
        pytest.skip("no non-loopback IPv4 interface")
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    names = {line.split()[3].split("/")[0]: line.split()[1] for line in listed.splitlines()}  # address -> name
    assert interface_with_address(others[0]) == names[others[0]]
    assert interface_towards(others[0]) == names[others[0]]  # the kernel's source for its own address is itself


def test_gloo_binds_the_interface_towards_the_master_while_the_group_forms(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed, "interface_towards", lambda host: {"10.1.2.3": "eth7"}.get(host))
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    with distributed._gloo_interface_towards_master(enabled=True):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # restored
    with distributed._gloo_interface_towards_master(enabled=False):  # NCCL, or an explicit init_method
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the user's choice wins
    with distributed._gloo_interface_towards_master(enabled=True):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # loopback: interface_towards says None, nothing is set
    with distributed._gloo_interface_towards_master(enabled=True):
        assert "GLOO_SOCKET_IFNAME" not in os.environ


# ------------------------------------------------------------------------------------------------ the launcher


def test_the_example_config_gives_ssh_commands_that_hold_no_key(tmp_path):
    cluster = launcher.Cluster.from_yaml(ROOT / "examples" / "multinode" / "cluster.yaml")
    cluster.key_files = {"student": tmp_path / "s.key", "teacher": tmp_path / "t.key"}
    servers = cluster.server_commands()
    assert sorted(servers) == ["student", "teacher-default-0", "teacher-default-1"]
    host, command = servers["student"]
    # ssh's own keep-alive probes (keepalive_s 30 s: probes 8 s apart, given up after 3 unanswered) before the host,
    # then one shell string
    assert host == "gpu-node-3" and command[:6] == ["ssh", "-o", "ServerAliveInterval=8", "-o",
                                                     "ServerAliveCountMax=3", "gpu-node-3"] and len(command) == 7
    argv = shlex.split(command[6])  # what the remote shell runs: the server under the host's supervisor
    supervisor = argv.index("supervise")
    assert argv[supervisor - 1] == "fastdistill" and argv[supervisor + 1:argv.index("--")] == [
        "--grace-s", "15", "--keepalive-s", "30"]
    assert argv[argv.index("serve-student") - 1] == "fastdistill" and "--api-key" not in argv
    assert argv[argv.index("--host") + 1] == "10.0.0.13" and argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--api-key-file") + 1] == str(tmp_path / "s.key")
    teacher = shlex.split(servers["teacher-default-1"][1][-1])
    assert teacher[teacher.index("--host") + 1] == "10.0.0.15"
    trainers = cluster.trainer_commands(["max_steps=3"])
    for rank, name in enumerate(["trainer-0", "trainer-1"]):
        argv = shlex.split(trainers[name][1][-1])
        assert argv[argv.index("supervise") + 1:argv.index("--")] == [
            "--grace-s", "15", "--keepalive-s", "30", "--torchrun-status"]  # the node's status: its first failure's
        assert argv[argv.index("--node-rank") + 1] == str(rank) and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--master-addr") + 1] == "10.0.0.11"
        assert f"FASTDISTILL_STUDENT_API_KEY_FILE={tmp_path / 's.key'}" in argv
        assert 'vllm_server_base_url="http://10.0.0.13:8000"' in argv and argv[-1] == "max_steps=3"
        assert ('teacher_server_urls={"default": ["http://10.0.0.14:8001", "http://10.0.0.15:8001"]}'
                in argv)
    cluster.ensure_keys()
    assert (tmp_path / "s.key").stat().st_mode & 0o777 == 0o600


def test_an_argv_prefix_passes_the_command_as_it_is(tmp_path):
    path = tmp_path / "cluster.yaml"
    text = (ROOT / "examples" / "multinode" / "cluster.yaml").read_text() + "exec_shell: false\n"
    text = text.replace('exec: ["ssh", "{host}"]', 'exec: ["srun", "-w", "{host}"]')
    path.write_text(text)
    cluster = launcher.Cluster.from_yaml(path)
    _, command = cluster.server_commands()["student"]
    assert command[:4] == ["srun", "-w", "gpu-node-3", "env"] and "serve-student" in command
    # under the host's supervisor, without the ssh keep-alive (srun relays stop signals itself)
    assert command[command.index("supervise") + 1:command.index("--")] == ["--grace-s", "15"]
    with pytest.raises(ConfigError, match="student needs"):
        path.write_text(text.replace("  port: 8000\n", "", 1))
        launcher.Cluster.from_yaml(path)


# ------------------------------------------------------------------------------------------------ the cluster


def test_require_netns_fails_instead_of_skipping_when_required(monkeypatch):
    monkeypatch.setattr(cluster_module, "netns_problem", lambda: "no netns here")
    monkeypatch.setenv("FASTDISTILL_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="no netns here"):
        require_netns()
    monkeypatch.delenv("FASTDISTILL_REQUIRE_NETNS")
    with pytest.raises(pytest.skip.Exception, match="no netns here"):
        require_netns()


def connects(client, address: str, port: int, timeout_s: float) -> bool:
    code = (f"import socket; socket.create_connection(({address!r}, {port}), timeout={timeout_s}).close()")
    return client.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.netns
def test_hosts_reach_each_other_by_address_until_partitioned_and_teardown_removes_everything():
    require_netns()
    with NetnsCluster(["a", "b"]) as cluster:
        a, b = cluster["a"], cluster["b"]
        assert (a.address, b.address) == ("10.77.0.1", "10.77.0.2")
        server = b.popen([sys.executable, "-c", "import socket, time\n"
                          f"s = socket.create_server(({b.address!r}, 7000)); time.sleep(600)"])
        wait_for(lambda: Listener(b.address, 7000) in b.listeners(), timeout_s=60, what="b's listener")
        assert Listener(b.address, 7000) not in a.listeners()  # each host has its own sockets
        assert connects(a, b.address, 7000, 10)
        b.partition()
        assert not connects(a, b.address, 7000, 1)  # no answer: the connection times out
        b.heal()
        assert wait_for(lambda: connects(a, b.address, 7000, 5), timeout_s=60, what="b after the heal")
        namespaces = [host.namespace for host in cluster.hosts.values()] + [cluster.switch]
        assert set(namespaces) <= set(cluster_namespaces())
    assert server.wait(timeout=60) != 0  # killed by the teardown
    assert not set(namespaces) & set(cluster_namespaces())


@pytest.mark.netns
def test_stale_namespaces_of_dead_runs_are_removed_and_live_ones_kept():
    require_netns()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale, live = f"{PREFIX}{dead.pid}-dead00-sw", f"{PREFIX}{os.getpid()}-live00-sw"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in remove_stale_namespaces()
        assert stale not in cluster_namespaces() and live in cluster_namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_collective_error_naming_a_peer_address_becomes_a_lost_rank_error():
    import torch

    group = distributed.Distributed(0, 3, torch.device("cpu"), addresses=("10.0.0.1", "10.0.0.2", "10.0.0.2"))
    gloo = RuntimeError("[/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:27368: Connection reset by peer. "
                        "This is typically caused by a remote worker hanging")
    lost = group.lost_rank_error(gloo)
    assert str(lost).startswith("rank 0 lost trainer rank(s) 1, 2 of 3 (at 10.0.0.2): a collective with it failed "
                                "([/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:27368")
    assert group.lost_rank_error(RuntimeError("CUDA out of memory")) is None  # names no peer: left as it is
    assert group.lost_rank_error(RuntimeError("Read error [10.0.0.1]:1: reset")) is None  # its own address
    assert group.lost_rank_error(RuntimeError("Read error [10.9.9.9]:1: reset")) is None  # not a rank's


def _gather_addresses(rank: int, init_method: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    os.environ.pop("MASTER_ADDR", None)
    group = distributed.init_distributed(init_method)
    results.put({"rank": rank, "addresses": group.addresses})
    group.close()


def test_init_distributed_gathers_every_rank_s_address():
    from fastdistill_testing.spawned import file_rendezvous, run_ranks

    outcomes = run_ranks(_gather_addresses, (file_rendezvous(),))
    assert [o["addresses"] for o in outcomes] == [("127.0.0.1", "127.0.0.1")] * 2  # no MASTER_ADDR: loopback


GLOO_PROBE = """
import sys
import torch
from fastdistill.train.distributed import init_distributed
group = init_distributed()
total = group.all_reduce_sum(torch.tensor([group.rank + 1.0])).item()
print("rank", group.rank, "total", total, "addresses", ",".join(group.addresses), flush=True)
group.close()
"""


@pytest.mark.netns
@pytest.mark.slow
def test_two_hosts_whose_host_name_is_loopback_form_the_trainer_s_gloo_group(tmp_path):
    """torchrun --nnodes 2 on two namespaced hosts: this machine's host name resolves to 127.0.0.1 in both (gloo's
    default device would tell the other node to connect to its own loopback); init_distributed binds the interface
    towards MASTER_ADDR, so the group forms and each rank's address is its host's. The trainer runs of
    tests/test_cluster.py depend on the same; this isolates it (``make test-cluster`` only, for the suite's budget)."""
    require_netns()
    if os.environ.get("FASTDISTILL_CLUSTER_FULL") != "1":
        pytest.skip("`make test-cluster` runs it (FASTDISTILL_CLUSTER_FULL=1); tests/test_cluster.py covers the path")
    script = tmp_path / "probe.py"
    script.write_text(GLOO_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME")}
    with NetnsCluster(["n0", "n1"]) as cluster:
        master = cluster["n0"].address
        nodes = [cluster[f"n{rank}"].popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", master, "--master-port", "29500", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]
        outputs = [node.communicate(timeout=300)[0] for node in nodes]  # a hang guard only
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)[-3000:]
    addresses = f"addresses {cluster['n0'].address},{cluster['n1'].address}"
    for rank, output in enumerate(outputs):
        assert f"rank {rank} total 3.0 {addresses}" in output, output[-2000:]


LAUNCHER_PARENT = """
import sys, time
from pathlib import Path
from fastdistill.launch import launch
child = launch("sleeper", "local", [sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
print(child.process.pid, flush=True)
time.sleep(600)
"""


def test_a_launched_command_ends_with_a_killed_launcher(tmp_path):
    """The launcher's children get SIGTERM when the launcher dies, SIGKILL included (nothing is left running)."""
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{child}/stat") as stat:  # a zombie waiting for init counts as gone
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"

    wait_for(gone, timeout_s=60, what="the launched child's end")


# ------------------------------------------------------------------------------------------------ a stalled server

KEEP_ALIVE_SERVER = """
import sys
import uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})

# vLLM's server stack: uvicorn on uvloop with httptools; a 1 s keep-alive (vLLM's: 5 s) keeps the test short
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=1, loop="uvloop",
            http="httptools")
"""
KEEP_ALIVE_S = 1.0


def stalled_server_outcome(servers: list[subprocess.Popen], urls: list[str]) -> tuple[list, object, object]:
    """Requests through a two-replica pool while replica 0's server is stopped for twice its keep-alive: the
    answers, the request stats and the pool."""
    import asyncio
    import signal

    from fastdistill.http_client import new_session
    from fastdistill.rollout.http import RequestStats, RetryPolicy, request_json_pooled
    from fastdistill.rollout.replicas import ReplicaPool

    async def scenario():
        pool, stats = ReplicaPool(urls), RequestStats()
        retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, request_timeout_s=60)
        async with new_session() as session:
            def call():
                return request_json_pooled(session, "POST", pool, "/v1/completions", payload={}, retry=retry,
                                           stats=stats)

            # pooled connections to both replicas, more than the requests that will wait on replica 0: its spare
            # idle ones are dropped too, so a resend must not take one of them
            await asyncio.gather(*[call() for _ in range(8)])
            os.kill(servers[0].pid, signal.SIGSTOP)
            try:
                waiting = [asyncio.create_task(call()) for _ in range(4)]  # half of them on replica 0
                await asyncio.sleep(2 * KEEP_ALIVE_S)  # the fault itself: a stall longer than the keep-alive
            finally:
                os.kill(servers[0].pid, signal.SIGCONT)
            return await asyncio.gather(*waiting), stats, pool

    return asyncio.run(scenario())


@pytest.fixture
def keep_alive_servers():
    from fastdistill.http_client import poll_until_healthy, run_blocking
    from fastdistill.serve import free_port, vllm_python

    python = vllm_python()
    if subprocess.run([python, "-c", "import uvicorn, uvloop, httptools"], capture_output=True).returncode != 0:
        message = f"{python} lacks uvicorn/uvloop/httptools (vLLM's server stack; set FASTDISTILL_VLLM_PYTHON)"
        if os.environ.get("FASTDISTILL_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    ports = [free_port(), free_port()]
    servers = [subprocess.Popen([python, "-c", KEEP_ALIVE_SERVER, str(port)]) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for server, url in zip(servers, urls, strict=True):
            assert run_blocking(lambda url=url, server=server: poll_until_healthy(
                url, alive=lambda: server.poll() is None, timeout_s=120)) == "healthy"
        yield servers, urls
    finally:
        for server in servers:
            server.kill()
            server.wait()


@pytest.mark.vllm  # vLLM's interpreter runs the server stack
def test_requests_waiting_on_a_stalled_keep_alive_server_are_resent_not_failed_over(keep_alive_servers):
    """After a stall longer than its keep-alive, vLLM's server stack resets the pooled connections that requests
    wait on: the requests are resent to the same (healthy) replica, no failover, no replica error. (Whether the
    stack resets them, and so how many are resent, depends on the order in which the resumed server runs its
    keep-alive timers and reads the waiting requests: only the outcome is asserted.)"""
    answers, stats, pool = stalled_server_outcome(*keep_alive_servers)
    assert answers == [{}] * 4
    assert stats.failovers == 0 and [replica.errors for replica in pool.replicas] == [0, 0]


# ------------------------------------------------------------------------------------------------ supervision

FAILING_NODE = """
import pathlib, sys
print("fastdistill.errors.LostRankError: rank 0 lost trainer rank(s) 1 of 3 (at 10.0.0.2): no heartbeat for 31 s")
print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")  # torchrun's summary comes after
pathlib.Path(sys.argv[1]).touch()
sys.exit(75)
"""
FOLLOWING_NODE = """
import pathlib, sys, time
while not pathlib.Path(sys.argv[1]).exists():  # ends by itself once the first node failed
    time.sleep(0.05)
print("fastdistill.errors.LostRankError: rank 1 of 3 lost the rendezvous store at 10.0.0.1:29500", flush=True)
sys.exit(75)
"""
HANGING = "import time; time.sleep(600)"


def test_a_failed_node_lets_the_others_end_by_themselves_then_stops_the_rest_and_names_it(tmp_path, capsys):
    """trainer-0 fails (exit 75, its error line); trainer-1 ends by itself after it; trainer-2 never does and is
    stopped after the grace; the launcher's outcome names trainer-0 and its error, exit status 75."""
    marker, logs = tmp_path / "failed", tmp_path / "logs"
    trainers = {name: launcher.launch(name, "local", [sys.executable, "-c", code, str(marker)], logs)
                for name, code in (("trainer-0", FAILING_NODE), ("trainer-1", FOLLOWING_NODE),
                                   ("trainer-2", HANGING))}
    servers = {"student": launcher.launch("student", "local", [sys.executable, "-c", HANGING], logs)}
    try:
        outcome = launcher.supervise(trainers, servers, grace_s=2.0, poll_s=0.05, timeout_s=120)
    finally:
        launcher.stop_all(trainers, servers)
    assert outcome.failed == "trainer-0" and outcome.failed_status == 75 and outcome.exit_code == 75
    assert outcome.failed_error == ("fastdistill.errors.LostRankError: rank 0 lost trainer rank(s) 1 of 3 (at "
                                    "10.0.0.2): no heartbeat for 31 s")
    assert outcome.statuses["trainer-1"] == 75 and outcome.statuses["trainer-2"] < 0  # stopped by a signal
    assert "launch: trainer node trainer-0 on local exited early (75): fastdistill.errors.LostRankError" in \
        capsys.readouterr().err
    assert all(launched.process.poll() is not None for launched in [*trainers.values(), *servers.values()])


def test_a_server_that_exits_stops_the_trainer_nodes_at_once_and_is_named(tmp_path):
    logs = tmp_path / "logs"
    trainers = {"trainer-0": launcher.launch("trainer-0", "local", [sys.executable, "-c", HANGING], logs)}
    servers = {"student": launcher.launch("student", "local", [
        sys.executable, "-c", "import sys; print('RuntimeError: the engine core died'); sys.exit(0)"], logs)}
    try:
        outcome = launcher.supervise(trainers, servers, grace_s=600.0, poll_s=0.05, timeout_s=120)
    finally:
        launcher.stop_all(trainers, servers)
    assert outcome.failed == "student" and outcome.failed_error == "RuntimeError: the engine core died"
    assert outcome.exit_code == 69 and outcome.statuses["trainer-0"] < 0  # a server gone (EX_UNAVAILABLE), even exit 0


def test_a_run_whose_nodes_all_succeed_exits_0(tmp_path):
    logs = tmp_path / "logs"
    trainers = {f"trainer-{i}": launcher.launch(f"trainer-{i}", "local", [sys.executable, "-c", "pass"], logs)
                for i in range(2)}
    outcome = launcher.supervise(trainers, {}, poll_s=0.05, timeout_s=120)
    assert outcome.failed is None and outcome.exit_code == 0 and outcome.statuses == {"trainer-0": 0, "trainer-1": 0}


# ------------------------------------------------------------------------------------------------ fastdistill launch

RECORDING_NODE = """
import json, os, sys
print(json.dumps({"host": os.environ["LAUNCH_HOST"], "argv": sys.argv[1:]}))
sys.exit(3 if os.environ.get("FAILING_HOST") == os.environ["LAUNCH_HOST"] else 0)
"""


# `fastdistill` on the local "hosts": the real `fastdistill supervise` (every command runs under it), servers that sleep
FASTDISTILL_SUPERVISING = """
import sys, time
if sys.argv[1:2] == ["supervise"]:
    from fastdistill.cli import main
    sys.exit(main(sys.argv[1:]))
time.sleep(600)
"""


def local_cluster_config(tmp_path: Path, **fields) -> Path:
    """A launcher config whose hosts are this machine (``env LAUNCH_HOST=<host>`` as the exec prefix): servers that
    sleep, trainer nodes that print their host and argv and exit."""
    config = {"exec": ["env", "LAUNCH_HOST={host}"], "exec_shell": False,
              "student": {"host": "s", "address": "10.9.0.3", "port": 8000, "model": "student-model"},
              "teacher_model": "teacher-model", "teachers": {"default": {"host": "t", "address": "10.9.0.4",
                                                                         "port": 8001}},
              "trainers": [{"host": "n0", "address": "10.9.0.1"}, {"host": "n1", "address": "10.9.0.2"}],
              "key_files": {"student": "keys/student.key", "teacher": "keys/teacher.key"},
              "train_config": "train.yaml", "logs": "logs", "failure_grace_s": 60,
              "fastdistill": [sys.executable, "-c", FASTDISTILL_SUPERVISING],
              "torchrun": [sys.executable, "-c", RECORDING_NODE],
              **fields}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fastdistill_launch_runs_a_cluster_config_and_exits_with_the_nodes_status(tmp_path, capsys):
    """``fastdistill launch cluster.yaml max_steps=3``: each trainer node runs on its host with its rank, node 0's
    rendezvous, the servers' URLs and the extra override; the keys are generated (0600); exit 0. A node that fails
    makes the launch exit with its status and name it."""
    assert main(["launch", str(local_cluster_config(tmp_path)), "max_steps=3"]) == 0
    assert "launch: trainer-1 exited with 0" in capsys.readouterr().err
    for rank, host in enumerate(["n0", "n1"]):
        record = json.loads((tmp_path / "logs" / f"trainer-{rank}.log").read_text().splitlines()[-1])
        argv = record["argv"]
        assert record["host"] == host and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "10.9.0.1" and argv[-1] == "max_steps=3"
        assert 'vllm_server_base_url="http://10.9.0.3:8000"' in argv
        assert argv[argv.index("--config") + 1] == str((tmp_path / "train.yaml").resolve())
    assert (tmp_path / "keys" / "teacher.key").stat().st_mode & 0o777 == 0o600

    failing = local_cluster_config(tmp_path, env={"FAILING_HOST": "n1"}, logs="failed-logs")
    assert main(["launch", str(failing)]) == 3
    assert "launch: failed: trainer-1 (exit 3)" in capsys.readouterr().err


@pytest.mark.parametrize(("fields", "message"), [
    ({"failure_grace": 5}, "unknown ['failure_grace']"),
    ({"key_files": {"student": "s.key"}}, "key_files names a 'student' and a 'teacher' file"),
    ({"trainers": [{"host": "n0"}]}, "trainer 0 needs ['address']"),
    ({"trainers": []}, "trainers: at least one trainer node"),
    ({"keepalive_s": 0}, "keepalive_s must be a number of seconds > 0 (or null: off), not 0"),
])
def test_fastdistill_launch_refuses_a_bad_config_by_name(tmp_path, capsys, fields, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", str(local_cluster_config(tmp_path, **fields))])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_fastdistill_launch_names_a_missing_config_and_missing_fields(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["launch", str(tmp_path / "nowhere.yaml")])
    assert "nowhere.yaml: no such launcher config" in capsys.readouterr().err
    path = tmp_path / "cluster.yaml"
    path.write_text("student: {host: s, address: a, port: 1, model: m}\n")
    with pytest.raises(ConfigError, match=r"missing \['teacher_model', 'teachers', 'trainers', 'key_files'"):
        launcher.Cluster.from_yaml(path)
