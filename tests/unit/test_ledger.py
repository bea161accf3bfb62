"""WeightVersionLedger rules, driven directly: no gRPC, no vLLM."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from enginectl.client.errors import Reason
from enginectl.contract.engine import UNDECLARED_LABEL
from enginectl.server.errors import ControlPlaneError
from enginectl.server.weights.version.ledger import Failure, LedgerClosed, WeightSource, WeightVersionLedger


async def test_never_declared_then_placeholder_names_are_ordinary_versions() -> None:
    ledger = WeightVersionLedger()
    state = ledger.state
    assert (state.declared, state.version, state.revision) == (False, None, 0)
    assert state.source is WeightSource.UNSPECIFIED and state.declare_time is None
    for revision, version in enumerate(["initial", "default", "0"], start=1):
        state = await ledger.declare(version)
        assert (state.declared, state.version, state.revision) == (True, version, revision)
        assert state.source is WeightSource.DECLARED


async def test_publish_failure_leaves_state_unchanged() -> None:
    async def publish(version: str) -> None:
        raise ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD, "gone")

    ledger = WeightVersionLedger(publish=publish)
    before = ledger.state
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare("v1")
    assert err.value.reason == Reason.ENGINE_DEAD
    assert ledger.state == before


@pytest.mark.parametrize(
    ("version", "reason"),
    [("", Reason.VERSION_REQUIRED), ("x" * 257, Reason.VERSION_TOO_LONG), ("é" * 129, Reason.VERSION_TOO_LONG)],
)
async def test_bad_version_refused_state_unchanged(version: str, reason: str) -> None:
    ledger = WeightVersionLedger()
    await ledger.declare("v1")
    before = ledger.state
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare(version)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == reason
    assert [v.field for v in err.value.field_violations] == ["version"]
    assert ledger.state == before


async def test_version_limit_is_256_bytes_of_utf8() -> None:
    ledger = WeightVersionLedger()
    assert (await ledger.declare("x" * 256)).version == "x" * 256
    assert (await ledger.declare("é" * 128)).version == "é" * 128  # 256 bytes


async def test_etag_compare_and_set() -> None:
    ledger = WeightVersionLedger()
    undeclared_etag = ledger.state.etag
    first = await ledger.declare("a", etag=undeclared_etag)  # "declare only if nobody has"
    assert first.etag != undeclared_etag
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare("b", etag=undeclared_etag)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.ABORTED, Reason.ETAG_MISMATCH)
    assert ledger.state == first
    assert (await ledger.declare("b", etag=first.etag)).version == "b"


async def test_etag_from_another_incarnation_is_stale() -> None:
    old, new = WeightVersionLedger(), WeightVersionLedger()
    assert old.incarnation != new.incarnation
    assert old.state.etag != new.state.etag  # same revision 0, different incarnation
    with pytest.raises(ControlPlaneError) as err:
        await new.declare("v", etag=old.state.etag)
    assert err.value.reason == Reason.ETAG_MISMATCH
    assert new.state.declared is False


async def test_request_id_idempotent_and_validated() -> None:
    ledger = WeightVersionLedger()
    rid = str(uuid.uuid4())
    first = await ledger.declare("v1", request_id=rid)
    await ledger.declare("v2")
    again = await ledger.declare("v1", request_id=rid)
    assert again == first  # the first answer, revision not bumped
    assert ledger.state.revision == 2 and ledger.state.version == "v2"
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare("other", request_id=rid)
    assert err.value.reason == Reason.REQUEST_ID_REUSED
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare("v3", request_id="not-a-uuid")
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.REQUEST_ID_INVALID)
    assert ledger.state.revision == 2


async def test_concurrent_duplicates_declare_once() -> None:
    ledger = WeightVersionLedger()
    rid = str(uuid.uuid4())
    results = await asyncio.gather(*[ledger.declare("v", request_id=rid) for _ in range(5)])
    assert {r.revision for r in results} == {1}
    assert ledger.state.revision == 1


async def test_writes_apply_in_arrival_order() -> None:
    gate, slow_writing = asyncio.Event(), asyncio.Event()
    published: list[str] = []

    async def publish(version: str) -> None:
        if version == "slow":
            slow_writing.set()
            await gate.wait()
        published.append(version)

    ledger = WeightVersionLedger(publish=publish)
    slow = asyncio.create_task(ledger.declare("slow"))
    await asyncio.wait_for(slow_writing.wait(), 5)  # "slow" holds the writer lock
    fast = asyncio.create_task(ledger.declare("fast"))
    gate.set()
    await asyncio.gather(slow, fast)
    assert published == ["slow", "fast"]
    assert (ledger.state.version, ledger.state.revision) == ("fast", 2)


async def _collect(ledger: WeightVersionLedger, n: int, since: int | None = None) -> list[tuple[str | None, int]]:
    seen = []
    async for state in ledger.watch(since):
        seen.append((state.version, state.revision))
        if len(seen) == n:
            break
    return seen


async def test_watch_current_then_every_change_once() -> None:
    ledger = WeightVersionLedger()
    await ledger.declare("a")
    watch = ledger.watch()
    first = await anext(watch)
    for v in ("b", "c", "d"):
        await ledger.declare(v)
    seen = [(first.version, first.revision)]
    async for state in watch:
        seen.append((state.version, state.revision))
        if len(seen) == 4:
            break
    assert seen == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]


async def test_watch_since_revision_replays_and_bounds() -> None:
    ledger = WeightVersionLedger(history_limit=3)
    for v in ("a", "b", "c", "d"):
        await ledger.declare(v)
    assert await _collect(ledger, 2, since=2) == [("c", 3), ("d", 4)]
    with pytest.raises(ControlPlaneError) as err:
        await _collect(ledger, 1, since=0)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.OUT_OF_RANGE, Reason.REVISION_COMPACTED)
    assert err.value.metadata["oldest_revision"] == "2"
    with pytest.raises(ControlPlaneError) as err:
        await _collect(ledger, 1, since=9)
    assert err.value.reason == Reason.REVISION_IN_FUTURE


async def test_close_ends_watchers() -> None:
    ledger = WeightVersionLedger()
    watch = ledger.watch()
    assert (await anext(watch)).revision == 0
    pending = asyncio.ensure_future(anext(watch))
    ledger.close()
    with pytest.raises(LedgerClosed):
        await asyncio.wait_for(pending, 5)


async def test_update_records_through_the_write_lock_and_a_failure_leaves_no_label() -> None:
    from enginectl.server.weights.version.ledger import Failure, Fingerprint

    published: list[str] = []

    async def publish(version: str) -> None:
        published.append(version)

    ledger = WeightVersionLedger(publish=publish)
    fingerprint = Fingerprint(method="m", digest="d", ranks=((0, "d"),))
    async with ledger.writing():
        state = await ledger.record_update("step-1", WeightSource.DISK, fingerprint)
    assert (state.declared, state.version, state.revision, state.source) == (True, "step-1", 1, WeightSource.DISK)
    assert state.fingerprint == fingerprint and published == ["step-1"]

    failure = Failure(
        reason=Reason.PARTIAL_UPDATE,
        cause="STREAM_BROKEN",
        message="trainer died",
        time=1.0,
        attempted_version="step-2",
        operation="operations/x",
    )
    async with ledger.writing():
        failed = ledger.record_failure(failure)
    assert (failed.declared, failed.version, failed.fingerprint) == (False, None, None)
    assert failed.last_failure == failure and failed.revision == 1 and failed.etag != state.etag

    async with ledger.writing():  # new weights without a version: no label, the failure is repaired
        repaired = await ledger.record_update(None, WeightSource.DISK, None)
    assert (repaired.declared, repaired.version, repaired.last_failure, repaired.revision) == (False, None, None, 1)
    assert published == ["step-1", UNDECLARED_LABEL]  # tokens of the new weights name no version
    with pytest.raises(AssertionError):
        ledger.record_failure(failure)  # only under the write lock


async def test_revision_of_names_the_latest_declaration_of_a_version() -> None:
    ledger = WeightVersionLedger(revisions_limit=2)
    for version in ("a", "b", "a"):
        await ledger.declare(version)
    assert (ledger.revision_of("a"), ledger.revision_of("b")) == (3, 2)
    await ledger.declare("c")  # only the newest two versions are kept
    assert (ledger.revision_of("a"), ledger.revision_of("b"), ledger.revision_of("c")) == (3, None, 4)
    assert ledger.revision_of("never") is None


async def test_no_declaration_over_mixed_weights_until_an_update_succeeds() -> None:
    ledger = WeightVersionLedger()
    failure = Failure(
        reason=Reason.PARTIAL_UPDATE,
        cause="STREAM_BROKEN",
        message="trainer died",
        time=1.0,
        attempted_version="step-2",
        operation="operations/x",
    )
    async with ledger.writing():
        failed = ledger.record_failure(failure)
    with pytest.raises(ControlPlaneError) as err:
        await ledger.declare("over-mixed-weights")
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == Reason.PARTIAL_UPDATE
    assert err.value.metadata["operation"] == "operations/x"
    assert ledger.state == failed
    async with ledger.writing():
        await ledger.record_update(None, WeightSource.DISK, None)
    assert (await ledger.declare("after-repair")).declared


async def test_declaration_waits_for_an_update_holding_the_lock() -> None:
    ledger = WeightVersionLedger()
    lock = ledger.writing()
    await lock.acquire()
    declaring = asyncio.ensure_future(ledger.declare("later"))
    await asyncio.sleep(0)  # ok-sleep: one yield (no time passes) so the declaration reaches the lock
    assert not declaring.done()
    await ledger.record_update("from-update", WeightSource.TENSORS, None)
    lock.release()
    state = await declaring
    assert (state.version, state.revision) == ("later", 2)
