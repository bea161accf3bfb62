"""A broadcast update whose Operation ends before the trainer's sending thread is seen to
return from its last bucket (issue 41): the update succeeded, and the trainer says so.

Under load the server can receive the last bucket, load it and answer before the trainer's
event loop sees its broadcast thread return. The trainer client's send (trainer_broadcast.py)
then finds the Operation done first; that must read as the success it is, and the group
stays usable. Each test makes the race certain with one fake (`held_sender`): the trainer's
BroadcastGroup.broadcast returns only once the update's Operations are done. The paths:
the trainer client's broadcast, its staged broadcast, and the fleet's one broadcast.

Why a fake at all: the race is real (a CPU burner beside the server made it happen once in
two runs), but a test that waits for it to happen would pass without the fix most of the time.
Holding the sender's return is the only way to make the order certain; the servers, the gloo
group and its collectives, the trainer client and the Operations are the real ones. Two
servers (the fleet's; the trainer client's tests use the first), and a CPU burner beside them
for the whole module (`cpu_burner_beside_servers`), as under load.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support.cpu_burner import cpu_burner
from support.serving import ServeProcess
from support.weights import Checkpoints, stop_server

from enginectl.client import Fleet, TrainerClient
from enginectl.client.trainer_tensors import BroadcastGroup
from enginectl.client.trainer_types import UpdateOperation

HOLD_TIMEOUT_S = 120.0  # the longest a held sender waits for the update's Operations to end


@pytest.fixture(scope="module")
def servers(serve_env: dict[str, str]) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    x = ServeProcess(["--enable-scale-out"], serve_env).start()
    y = ServeProcess(["--enable-scale-out"], serve_env).start()
    try:
        x.wait_ready()
        y.wait_ready()
        yield x, y
    finally:
        for srv in (x, y):
            stop_server(srv)


@pytest.fixture(scope="module", autouse=True)
def cpu_burner_beside_servers(servers: tuple[ServeProcess, ServeProcess]) -> Iterator[None]:
    """One busy process for the module's tests, started once the servers are ready."""
    with cpu_burner():
        yield


@pytest.fixture(scope="module")
def watchers(servers: tuple[ServeProcess, ServeProcess]) -> Iterator[dict[str, TrainerClient]]:
    """A client per server, apart from the clients under test: the held sender's eyes."""
    clients = {s.grpc_target: TrainerClient(s.grpc_target, timeout=120.0) for s in servers}
    yield clients
    for c in clients.values():
        c.close()


@pytest.fixture(autouse=True)
def nothing_left_staged(watchers: dict[str, TrainerClient]) -> Iterator[None]:
    """After each test, no server holds a staged set (a failed test may leave one)."""
    yield
    for client in watchers.values():
        staged = client.generation_state().staged
        if staged is not None:
            client.discard_staged_weights(staged.name, allow_missing=True)


class HeldSender:
    """The broadcasts' sender, held after its last bucket until the update is done.

    `BroadcastGroup.broadcast` is replaced by a wrapper: it notes the update Operations running
    on every server as it begins (the ones waiting for its tensors), sends every bucket (the
    original), then returns only once a thread of its own has seen each of those Operations
    done through `watchers`, clients apart from the one under test. `ended` is every such
    Operation as that thread saw it end, in order.
    """

    def __init__(self, watchers: dict[str, TrainerClient]) -> None:
        self.watchers = watchers
        self.ended: list[UpdateOperation] = []
        self._original = BroadcastGroup.broadcast

    def broadcast(self, group: BroadcastGroup, tensors: list[Any], *args: Any) -> int:
        running = [(c, op.name) for c in self.watchers.values() for op in c.list_operations(done=False)]
        done = threading.Event()
        threading.Thread(target=self._watch, args=(running, done), daemon=True).start()
        sent = self._original(group, tensors, *args)
        if not done.wait(HOLD_TIMEOUT_S):
            raise TimeoutError(f"{running} not done within {HOLD_TIMEOUT_S}s")
        return sent

    def _watch(self, running: list[tuple[TrainerClient, str]], done: threading.Event) -> None:
        try:
            for client, name in running:
                self.ended.append(client.wait_operation(name, HOLD_TIMEOUT_S))
        finally:
            done.set()  # the sender returns either way; the test checks what ended

    def ended_well(self, names: list[str]) -> bool:
        """Whether the sender was held until exactly `names` were done, without error."""
        return [op.name for op in self.ended] == names and all(op.done and op.error is None for op in self.ended)


@pytest.fixture
def held_sender(monkeypatch: pytest.MonkeyPatch, watchers: dict[str, TrainerClient]) -> HeldSender:
    """The one fake of this module, at one point: the trainer's BroadcastGroup.broadcast
    (client/trainer_tensors.py) returns only after the update's Operations are done. A busy
    CPU delays that thread's return only sometimes; held, the Operation ends first every time,
    and everything else (the group, the gloo collectives, the server's load) is real."""
    held = HeldSender(watchers)

    def broadcast(group: BroadcastGroup, tensors: list[Any], *args: Any) -> int:
        return held.broadcast(group, tensors, *args)

    monkeypatch.setattr(BroadcastGroup, "broadcast", broadcast)
    return held


def test_a_broadcast_that_ends_before_its_sender_returns_succeeded(
    servers: tuple[ServeProcess, ServeProcess], held_sender: HeldSender, checkpoints: Checkpoints
) -> None:
    """The update is reported as the success it was (its version declared), and the group
    still carries the next broadcast."""
    x, _ = servers
    state = checkpoints.state_dict("B")
    with TrainerClient(x.grpc_target, timeout=120.0) as client:
        client.init_weights_update_group("race", timeout=60.0)
        try:
            broadcast = client.start_broadcast(state, "race-B", group_name="race")
            assert broadcast.send() == len(state) and broadcast.remaining == 0
            assert held_sender.ended_well([broadcast.name])
            assert broadcast.wait(60.0).weight_version.version == "race-B"
            assert client.get_weight_version().version == "race-B"

            again = client.broadcast_weights(checkpoints.state_dict("A"), "race-A", group_name="race")
            assert held_sender.ended_well([broadcast.name, again.operation])
            assert again.weight_version.version == "race-A"
            assert client.get_weight_version().version == "race-A"
        finally:
            client.destroy_weights_update_group("race", allow_missing=True)


def test_a_staged_broadcast_that_ends_before_its_sender_returns_succeeded(
    servers: tuple[ServeProcess, ServeProcess], held_sender: HeldSender, checkpoints: Checkpoints
) -> None:
    x, _ = servers
    with TrainerClient(x.grpc_target, timeout=120.0) as client:
        client.init_weights_update_group("race-staged", timeout=60.0)
        try:
            staged = client.stage_broadcast_weights(checkpoints.state_dict("B"), "staged-B", group_name="race-staged")
            assert held_sender.ended_well([staged.operation])
            committed = client.commit_staged_weights(staged.name)
            assert committed.weight_version.version == "staged-B"  # type: ignore[union-attr]
            assert client.get_weight_version().version == "staged-B"
        finally:
            client.destroy_weights_update_group("race-staged", allow_missing=True)


def test_the_fleets_broadcast_that_ends_before_its_sender_returns_succeeded(
    servers: tuple[ServeProcess, ServeProcess],
    held_sender: HeldSender,
    watchers: dict[str, TrainerClient],
    checkpoints: Checkpoints,
) -> None:
    """The fleet waits for its sender and every stage together (fleet.py `stage_broadcast`),
    so the order they end in never mattered; this keeps it so."""
    with Fleet([s.grpc_target for s in servers], timeout=120.0) as fleet:
        fleet.init_weights_update_group("fleet-race", timeout=60.0)
        try:
            stage = fleet.stage_broadcast(checkpoints.state_dict("B"), "fleet-race")
            assert held_sender.ended_well([s.operation for s in stage.staged.values()])
            assert stage.fingerprint is not None
            assert fleet.commit(stage).ok
            for client in watchers.values():
                assert client.get_weight_version().version == "fleet-race"
        finally:
            for client in watchers.values():
                client.destroy_weights_update_group("fleet-race", allow_missing=True)
