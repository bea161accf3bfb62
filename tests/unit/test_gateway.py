"""The SMG registration without an engine: the payload and SMG's version syntax
(common/gateway.py), SmgWorkers against a real `smg launch`, and GatewayRegistration's
retries against a gateway that is down, then up (server/gateway.py).

A registration SMG completes needs a real engine behind its grpc:// URL (SMG queries it):
tests/e2e/test_gateway_registration.py has those.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog
from support.smg import SmgGateway, free_port

from enginectl.common.gateway import (
    CONTROL_URL_LABEL,
    UNREPRESENTABLE_LABEL,
    VERSION_LABEL,
    GatewayError,
    SmgWorkers,
    registration,
    representable,
    version_labels,
)
from enginectl.server.gateway import Backoff, GatewayRegistration
from enginectl.server.weights.version.ledger import WeightVersionLedger

UNKNOWN_ID = "00000000-0000-7000-8000-000000000000"


def _registration(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "host": "10.0.0.7",
        "grpc_port": 50051,
        "http_port": 8000,
        "token": None,
        "declared": True,
        "version": "step-42",
        "enginectl_version": "0.1.0",
        "incarnation": "inc1",
    }
    return registration(**(kwargs | overrides))


# --- the payload -------------------------------------------------------------------------


def test_payload_names_the_grpc_url_the_control_url_and_the_version() -> None:
    reg = _registration()
    assert reg.body() == {
        "url": "grpc://10.0.0.7:50051",
        "labels": {
            "rl.control_url": "http://10.0.0.7:8000",
            "enginectl": "0.1.0",
            "enginectl.incarnation": "inc1",
            "enginectl.rl_routes": "vllm,sglang,dynamo",
            "weight_version": "step-42",
            "enginectl.weight_version_unrepresentable": "false",
        },
    }
    assert reg.unrepresentable_version is None


def test_payload_carries_the_token_as_api_key_only_when_there_is_one() -> None:
    assert "api_key" not in _registration(token=None).body()
    reg = _registration(token="s3cret")
    assert reg.body()["api_key"] == "s3cret"
    assert reg.redacted()["api_key"] == "<redacted>"


def test_payload_brackets_an_ipv6_host() -> None:
    reg = _registration(host="fd00::7")
    assert reg.url == "grpc://[fd00::7]:50051"
    assert reg.labels[CONTROL_URL_LABEL] == "http://[fd00::7]:8000"


def test_undeclared_clears_the_label_and_is_not_unrepresentable() -> None:
    reg = _registration(declared=False, version=None)
    assert reg.labels[VERSION_LABEL] == ""
    assert reg.labels[UNREPRESENTABLE_LABEL] == "false"


@pytest.mark.parametrize(
    "version", ["step-42", "v1", "a" * 128, "run/7@sha:abc", "initial", "!~", "Default", "default2"]
)
def test_representable_versions(version: str) -> None:
    assert representable(version)
    assert version_labels(True, version).version == version


@pytest.mark.parametrize(
    "version",
    [
        "step 42",  # a space
        "a" * 129,  # over 128 bytes
        "étape-42",  # not ASCII
        "v\u00a01",  # a non-ASCII space
        "tab\there",
        "default",  # SMG's word for unversioned
        "",
    ],
)
def test_unrepresentable_versions_clear_the_label_and_say_so(version: str) -> None:
    assert not representable(version)
    reg = _registration(version=version)
    if version:
        assert reg.labels[VERSION_LABEL] == ""
        assert reg.labels[UNREPRESENTABLE_LABEL] == "true"
        assert reg.unrepresentable_version == version


# --- SmgWorkers against a real smg --------------------------------------------------------


@pytest.fixture(scope="module")
def smg() -> Iterator[SmgGateway]:
    with SmgGateway().start() as gateway:
        yield gateway


def test_unknown_worker_is_not_found(smg: SmgGateway) -> None:
    workers = SmgWorkers(smg.url)
    for call in (
        lambda: workers.patch_labels(UNKNOWN_ID, {VERSION_LABEL: "v2"}),
        lambda: workers.get(UNKNOWN_ID),
        lambda: workers.deregister(UNKNOWN_ID),
    ):
        with pytest.raises(GatewayError) as caught:
            call()
        assert caught.value.status == 404 and caught.value.not_found
        assert caught.value.code == "WORKER_NOT_FOUND"
    assert workers.find_by_url("grpc://127.0.0.1:1") is None


def test_a_label_value_must_be_a_string(smg: SmgGateway) -> None:
    """SMG refuses a null label (400): a cleared version is "" (common/gateway.py CLEARED)."""
    workers = SmgWorkers(smg.url)
    with pytest.raises(GatewayError) as caught:
        workers.patch_labels(UNKNOWN_ID, {VERSION_LABEL: None})  # type: ignore[dict-item]
    assert caught.value.status == 400 and caught.value.code == "BAD_REQUEST"


def test_a_closed_port_is_unreachable() -> None:
    with pytest.raises(GatewayError) as caught:
        SmgWorkers(f"http://127.0.0.1:{free_port()}", timeout=2).workers()
    assert caught.value.unreachable and caught.value.status is None


def test_the_control_plane_token_is_sent() -> None:
    with SmgGateway(control_plane_token="tok-1").start() as gateway:
        with pytest.raises(GatewayError) as caught:
            SmgWorkers(gateway.url).workers()
        assert caught.value.status == 401
        with pytest.raises(GatewayError):
            SmgWorkers(gateway.url, token="wrong").workers()
        assert SmgWorkers(gateway.url, token="tok-1").workers() == []


# --- GatewayRegistration ------------------------------------------------------------------


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for `predicate` on this loop, with a deadline (the registration's tasks run here)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        # Yields the loop so the registration's tasks run; the predicate is re-checked each turn.
        await asyncio.sleep(0.01)  # ok-sleep


async def test_a_down_gateway_is_retried_with_backoff_until_it_answers() -> None:
    """Nothing listens on the port at first: each attempt is logged `gateway_unreachable`
    with a doubling delay; once smg starts there, the registration reaches it. (No engine
    is behind the grpc URL, so SMG holds it pending: the row is there, without labels.)"""
    port = free_port()
    ledger = WeightVersionLedger()
    registration_ = GatewayRegistration(
        SmgWorkers(f"http://127.0.0.1:{port}", timeout=2),
        ledger,
        host="127.0.0.1",
        grpc_port=free_port(),
        http_port=free_port(),
        token=None,
        enginectl_version="0.1.0",
        backoff=lambda: Backoff(0.05, 0.4),
    )
    with structlog.testing.capture_logs() as logs:
        registration_.start()
        await _until(
            lambda: sum(e["event"] == "gateway_unreachable" for e in logs) >= 3, 10, "three failed attempts logged"
        )
        failures = [e for e in logs if e["event"] == "gateway_unreachable"]
        assert [e["attempt"] for e in failures[:3]] == [1, 2, 3]
        assert [e["retry_in_s"] for e in failures[:3]] == [0.05, 0.1, 0.2]
        assert registration_.status()["registered"] is False
        assert "unreachable" in registration_.status()["last_error"]
        with SmgGateway(port=port).start() as gateway:
            await _until(lambda: registration_.status()["worker_id"] is not None, 10, "a worker id from SMG")
            row = SmgWorkers(gateway.url).get(registration_.status()["worker_id"])
            assert row["url"] == registration_.url
            began = time.monotonic()
            await registration_.stop(2.0)
            assert time.monotonic() - began < 2.5


async def test_stop_is_bounded_when_the_gateway_is_gone() -> None:
    """The gateway went away after the registration was sent: stop() logs and returns in time."""
    ledger = WeightVersionLedger()
    with SmgGateway().start() as gateway:
        registration_ = GatewayRegistration(
            SmgWorkers(gateway.url, timeout=2),
            ledger,
            host="127.0.0.1",
            grpc_port=free_port(),
            http_port=free_port(),
            token=None,
            enginectl_version="0.1.0",
        )
        registration_.start()
        await _until(lambda: registration_.status()["worker_id"] is not None, 10, "a worker id from SMG")
    with structlog.testing.capture_logs() as logs:
        began = time.monotonic()
        await registration_.stop(1.0)
        assert time.monotonic() - began < 1.5
    assert [e["event"] for e in logs] == ["gateway_deregister_failed"]
    assert registration_.status()["worker_id"] is not None
