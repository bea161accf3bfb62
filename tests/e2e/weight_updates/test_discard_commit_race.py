"""A discard that races a commit of the same staged set: one of the two loses, visibly.

The rule (docs/weights.md, "Discard and commit"): once CommitStagedWeights accepted a set, the
commit owns it; DiscardStagedWeights is refused FAILED_PRECONDITION STAGED_COMMITTING (naming
the commit's operation) and frees nothing. A discard that lands before the commit was accepted
frees the set, and the commit is then refused NOT_FOUND STAGED_WEIGHTS_NOT_FOUND before anything
is touched. Never "freed" with the set applied; never a commit reported ok over a freed set.

Each round stages the other checkpoint, sends the commit and, after a gap that varies from none
to past the load (or exactly while the commit's Operation says LOADING), the discard; then
checks that the two answers and the server's state (version, staged set, tokens) agree.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
from google.longrunning import operations_pb2
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens

from enginectl.client.errors import EnginectlError, from_rpc_error
from enginectl.weights.v1 import weight_update_service_pb2 as upb

# Seconds between sending the commit and the discard; "loading": once the commit's Operation
# reports LOADING (the discard lands mid-load).
GAPS: list[float | str] = [0.0, 0.0, 0.001, 0.002, 0.005, 0.01, 0.02, "loading", 0.05, "loading", 0.1, 0.3]


def stage(stubs: Stubs, checkpoints: Checkpoints, which: str) -> str:
    """Stage checkpoint `which` with version `which`; the staged set's name."""
    request = upb.UpdateWeightsFromDiskRequest(
        path=str(checkpoints.a if which == "A" else checkpoints.b), weight_version=which, stage_only=True
    )
    done = stubs.wait(stubs.updates.UpdateWeightsFromDisk(request))
    assert done.WhichOneof("result") == "response", done.error
    response = upb.UpdateWeightsResponse()
    done.response.Unpack(response)
    return response.staged.name


def outcome(call: Future[object]) -> tuple[object | None, EnginectlError | None]:
    try:
        return call.result(120), None
    except grpc.RpcError as exc:
        return None, from_rpc_error(exc)


def loading(stubs: Stubs, name: str) -> None:
    """Until the Operation `name` reports LOADING or ended (bounded: 60 s)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        op = stubs.ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30)
        metadata = upb.UpdateWeightsMetadata()
        op.metadata.Unpack(metadata)
        if op.done or metadata.phase in (upb.UPDATE_PHASE_LOADING, upb.UPDATE_PHASE_FINGERPRINTING):
            return
    raise AssertionError(f"{name} never reported LOADING")


def test_discard_racing_commit_never_frees_what_the_commit_applies(
    weights_server: ServeProcess,
    stubs: Stubs,
    checkpoints: Checkpoints,
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    tokens = {"A": tokens_a, "B": tokens_b}
    serving = stubs.version().version  # "A": the module's fixtures leave A loaded
    seen: set[str] = set()
    with ThreadPoolExecutor(2) as pool:
        for i, gap in enumerate(GAPS):
            which = "B" if serving == "A" else "A"
            name = stage(stubs, checkpoints, which)
            commit = pool.submit(
                stubs.updates.CommitStagedWeights, upb.CommitStagedWeightsRequest(name=name), timeout=120
            )
            if gap == "loading":
                accepted, refused = outcome(commit)
                assert refused is None, refused
                assert isinstance(accepted, operations_pb2.Operation)
                loading(stubs, accepted.name)
            else:
                time.sleep(float(gap))  # ok-sleep: the gap between the two calls is what varies
            discard = pool.submit(
                stubs.updates.DiscardStagedWeights, upb.DiscardStagedWeightsRequest(name=name), timeout=120
            )
            committed_op, commit_err = outcome(commit)
            discarded, discard_err = outcome(discard)
            applied = False
            if committed_op is not None:
                assert isinstance(committed_op, operations_pb2.Operation)
                done = stubs.wait(committed_op)
                applied = done.WhichOneof("result") == "response"
                if not applied:  # a commit may only fail before touching the weights
                    metadata = upb.UpdateWeightsMetadata()
                    done.metadata.Unpack(metadata)
                    assert not metadata.weights_modified, (i, gap, done.error)
            context = (i, gap, commit_err, discard_err, discarded)
            if discard_err is None:
                assert isinstance(discarded, upb.DiscardStagedWeightsResponse)
                assert discarded.found and discarded.bytes_freed > 0, context
                assert not applied, context  # freed: the commit must not have applied it
                assert commit_err is not None or committed_op is not None
                if commit_err is not None:
                    assert (commit_err.code, commit_err.reason) == (
                        grpc.StatusCode.NOT_FOUND,
                        "STAGED_WEIGHTS_NOT_FOUND",
                    ), context
                seen.add("discard won")
            else:
                assert applied, context  # the discard lost: the commit applied the set
                if discard_err.reason == "STAGED_COMMITTING":
                    assert discard_err.code == grpc.StatusCode.FAILED_PRECONDITION, context
                    assert committed_op is not None
                    assert discard_err.metadata.get("operation") == committed_op.name, context
                    seen.add("commit won, discard refused")
                else:  # the commit had consumed the set already
                    assert (discard_err.code, discard_err.reason) == (
                        grpc.StatusCode.NOT_FOUND,
                        "STAGED_WEIGHTS_NOT_FOUND",
                    ), context
                    seen.add("commit done before the discard")
            # The state agrees with the answers: the version, no set left, the tokens.
            version = stubs.version()
            assert version.declared and version.version == (which if applied else serving), (context, version)
            assert not stubs.state().HasField("staged"), context
            assert greedy_tokens(weights_server) == tokens[version.version], context
            serving = version.version
    # The gaps reached more than one interleaving (a mid-load discard always meets the commit).
    assert "commit won, discard refused" in seen, seen
