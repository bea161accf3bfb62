"""The two-node harness (bench/lib/two_node.py) is honest, and what crosses nodes crosses it.

Tier 0: no vLLM engine, a few seconds each. Node B is apart where a second host would be (host
name, /tmp, /dev/shm, loopback), and the harness leaves nothing behind; a ZMQ socket on the
head's veth address reaches node B and an `ipc://` path does not; a gloo group of the head and
node B forms through enginectl's own join (worker/weights/groups.py's `start_join` on node B,
the trainer's `BroadcastGroup` on the head) and broadcasts, unless its rendezvous is on the
head's loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from support.two_node import NODE_HOSTNAME, TwoNodes, two_nodes

from enginectl.client.trainer_tensors import BroadcastGroup

pytestmark = pytest.mark.timeout(120)

WAIT_S = 20.0  # any one wait on node B: far above what it takes (well under a second)
GROUP_TIMEOUT_S = 30.0  # the gloo group's own bound on its rendezvous and collectives
SHORT_TIMEOUT_S = 2.0  # a rendezvous that can not succeed

# Node B: its host name, whether it sees the head's files (argv), files of its own written
# to /tmp and /dev/shm, and its node-private folder.
LOOK_AROUND = """
import json, os, socket, sys
private, head_files = sys.argv[1], sys.argv[2:]
mine = [f"/tmp/{socket.gethostname()}-{os.getpid()}", f"/dev/shm/{socket.gethostname()}-{os.getpid()}"]
for path in mine:
    open(path, "w").close()
print(json.dumps({
    "pid": os.getpid(),
    "hostname": socket.gethostname(),
    "address": socket.gethostbyname(socket.gethostname()),
    "sees": [os.path.exists(path) for path in head_files],
    "private": os.path.isdir(private),
    "wrote": mine,
}))
"""

# Node B: connects to each HOST:PORT of argv and sends its host name; how each went.
CONNECT = """
import json, socket, sys
results = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(socket.gethostname().encode())
        results[target] = "connected"
    except OSError as exc:
        results[target] = type(exc).__name__
print(json.dumps(results))
"""

# Node B: PUSH its host name to the endpoint argv[1].
PUSH = """
import socket, sys, zmq
context = zmq.Context()
push = context.socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 10_000)
push.connect(sys.argv[1])
push.send_string(socket.gethostname())
push.close()
context.term()
"""

# Node B: whether the ipc:// path argv[1] exists here, and whether it can bind it itself.
IPC_LOOK = """
import json, os, sys, zmq
path = sys.argv[1]
exists = os.path.exists(path)
context = zmq.Context()
pull = context.socket(zmq.PULL)
pull.bind(f"ipc://{path}")
print(json.dumps({"exists": exists, "bound": os.path.exists(path)}))
pull.close(0)
context.term()
"""

# Node B as an engine worker: joins the group (argv: master address, port, timeout) as rank 1
# with enginectl's own join, then receives one float32 tensor of 4 broadcast by rank 0.
JOIN_AND_RECEIVE = """
import json, sys, time
from enginectl.contract.engine import TensorSpec
from enginectl.contract.groups import Backend, GroupSpec
from enginectl.worker.weights.groups import Group, received_broadcast, start_join

address, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
spec = GroupSpec(
    name="two-node", master_address=address, master_port=port, rank_offset=1, world_size=2,
    timeout=timeout, backend=Backend.GLOO,
)
started = time.monotonic()
outcome = start_join(spec, 0, 1).wait(timeout + 30)
if not isinstance(outcome, Group):
    print(json.dumps({"joined": False, "failure": getattr(outcome, "failure", None),
                      "message": getattr(outcome, "message", None), "waited": time.monotonic() - started}))
    sys.exit(0)
specs = (TensorSpec("w", "float32", (4,)),)
received = dict(received_broadcast(outcome, specs, 0, lambda: None, lambda: None, time.time() + timeout))
print(json.dumps({"joined": True, "w": received["w"].tolist()}))
"""


@pytest.fixture
def nodes() -> Iterator[TwoNodes]:
    with two_nodes() as made:
        yield made


def node_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON line a node-B snippet printed last (fails the test with its stderr if none)."""
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_node_b_has_its_own_host_name_tmp_and_shm(nodes: TwoNodes) -> None:
    """Neither side sees the other's /tmp or /dev/shm files; node B's processes share theirs
    (one host); the pid `popen` returns is the program's."""
    tag = uuid.uuid4().hex
    head_files = [f"/tmp/head-{tag}", f"/dev/shm/head-{tag}"]
    for path in head_files:
        open(path, "w").close()
    try:
        proc = nodes.python(LOOK_AROUND, str(nodes.node_private), *head_files)
        out, err = proc.communicate(timeout=WAIT_S)
        first = node_json(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        assert first["pid"] == proc.pid
        assert (first["hostname"], first["address"]) == (NODE_HOSTNAME, nodes.node_address)
        assert first["sees"] == [False, False] and first["private"]
        assert not any(os.path.exists(path) for path in first["wrote"]) and not nodes.node_private.exists()
        second = node_json(nodes.run_python(LOOK_AROUND, str(nodes.node_private), *first["wrote"], timeout=WAIT_S))
        assert second["sees"] == [True, True]
    finally:
        for path in head_files:
            os.unlink(path)
    assert socket.gethostname() != NODE_HOSTNAME


def test_the_heads_loopback_is_out_of_node_bs_reach_and_its_veth_address_is_not(nodes: TwoNodes) -> None:
    with socket.create_server(("127.0.0.1", 0)) as loopback, socket.create_server((nodes.head_address, 0)) as veth:
        on_loopback = f"127.0.0.1:{loopback.getsockname()[1]}"
        on_veth = f"{nodes.head_address}:{veth.getsockname()[1]}"
        results = node_json(nodes.run_python(CONNECT, on_loopback, on_veth, timeout=WAIT_S))
        assert results == {on_loopback: "ConnectionRefusedError", on_veth: "connected"}
        veth.settimeout(WAIT_S)
        conn, (peer, _) = veth.accept()
        with conn:
            conn.settimeout(WAIT_S)
            assert (peer, conn.recv(64)) == (nodes.node_address, NODE_HOSTNAME.encode())
        loopback.setblocking(False)
        with pytest.raises(BlockingIOError):
            loopback.accept()  # nobody knocked


def test_closing_kills_node_bs_processes_and_deletes_the_namespace_and_links() -> None:
    with two_nodes() as nodes:
        sleeper = nodes.python("import sys; sys.stdin.read()")
        anchor = nodes.anchor
        assert sleeper.poll() is None and anchor is not None
        assert nodes.namespace in _namespaces() and nodes.head_interface in _links()
    assert sleeper.returncode == -9 and anchor.returncode is not None
    assert nodes.namespace not in _namespaces()
    assert not {nodes.head_interface, nodes.node_interface} & _links()


def test_zmq_crosses_on_the_heads_veth_address_and_an_ipc_path_does_not(nodes: TwoNodes) -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    local = context.socket(zmq.PULL)
    path = f"/tmp/two-node-{uuid.uuid4().hex}.sock"
    try:
        port = pull.bind_to_random_port(f"tcp://{nodes.head_address}")
        pusher = nodes.python(PUSH, f"tcp://{nodes.head_address}:{port}")
        assert pull.poll(int(WAIT_S * 1000)), pusher.communicate(timeout=WAIT_S)
        assert pull.recv_string() == NODE_HOSTNAME
        assert pusher.wait(WAIT_S) == 0

        local.bind(f"ipc://{path}")
        assert os.path.exists(path)
        seen = node_json(nodes.run_python(IPC_LOOK, path, timeout=WAIT_S))
        assert seen == {"exists": False, "bound": True}  # node B's /tmp: the head's socket is not there
        assert os.path.exists(path)
    finally:
        pull.close(0)
        local.close(0)
        context.term()


def test_a_gloo_group_of_the_head_and_node_b_broadcasts_through_enginectls_join(
    nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head is the trainer (rank 0, hosting the TCPStore on its veth address), node B a
    worker joining as the engine does."""
    for name, value in nodes.head_env({}).items():
        monkeypatch.setenv(name, value)
    group = BroadcastGroup.host("two-node", "gloo", nodes.head_address, 0, 2, GROUP_TIMEOUT_S)
    worker = nodes.python(JOIN_AND_RECEIVE, nodes.head_address, str(group.port), str(GROUP_TIMEOUT_S))
    try:
        group.join()
        assert group.broadcast([torch.arange(4, dtype=torch.float32)]) == 1
        out, err = worker.communicate(timeout=WAIT_S + GROUP_TIMEOUT_S)
    finally:
        group.close()
    assert node_json(subprocess.CompletedProcess(worker.args, worker.returncode, out, err)) == {
        "joined": True,
        "w": [0.0, 1.0, 2.0, 3.0],
    }


def test_a_rendezvous_on_the_heads_loopback_can_not_be_joined_from_node_b(nodes: TwoNodes) -> None:
    """The store listens on the head's 127.0.0.1; node B's 127.0.0.1 is its own, so the join
    ends GROUP_TIMEOUT within its short timeout, its message naming the address."""
    group = BroadcastGroup.host("two-node", "gloo", "127.0.0.1", 0, 2, SHORT_TIMEOUT_S)
    port = group.port
    try:
        done = nodes.run_python(JOIN_AND_RECEIVE, "127.0.0.1", str(port), str(SHORT_TIMEOUT_S), timeout=WAIT_S + 30)
    finally:
        group.close()
    outcome = node_json(done)
    assert (outcome["joined"], outcome["failure"]) == (False, "GROUP_TIMEOUT")
    assert f"(127.0.0.1, {port})" in outcome["message"], outcome
    assert outcome["waited"] < WAIT_S


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _links() -> set[str]:
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in listed.splitlines()}
