"""Which weights generated a rollout: read the trailers that end every Generate of vLLM's gRPC
engine service on an enginectl server's control port (docs/rollouts.md).

    call = stub.Generate(request)            # vllm_engine_pb2_grpc.VllmEngineStub
    tokens = [t for r in call for t in r.chunk.token_ids]
    versions = generation_versions(call.trailing_metadata())
    if versions.declared and versions.versions == ["step-42"]: ...
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from enginectl.common.rollout_trailers import DECLARED_TRAILER, REVISION_TRAILER, VERSIONS_TRAILER, decode_versions


@dataclass(frozen=True)
class GenerationVersions:
    """The weight versions a generation ran under.

    `declared`: every token came from declared weights. `partial`: some did, some came from
    undeclared ones (an update without a version, or one that failed part way). `versions`:
    the declared versions in the order they generated tokens (two when the request straddled
    an update). `revision`: the ledger revision of the version it finished under (None when
    it finished on undeclared weights).
    """

    declared: bool
    partial: bool
    versions: list[str] = field(default_factory=list)
    revision: int | None = None

    @property
    def version(self) -> str | None:
        """The one version that generated every token, else None."""
        return self.versions[0] if self.declared and len(self.versions) == 1 else None


def generation_versions(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> GenerationVersions:
    """Read a Generate call's trailing metadata. Raises ValueError when the trailers are
    missing (not an enginectl server, or a call that failed)."""
    values = {key: value.decode() if isinstance(value, bytes) else value for key, value in trailing_metadata or ()}
    if DECLARED_TRAILER not in values:
        raise ValueError(f"no {DECLARED_TRAILER} trailer: not a finished Generate of an enginectl server")
    whole = values[DECLARED_TRAILER]
    revision = values.get(REVISION_TRAILER)
    return GenerationVersions(
        declared=whole == "true",
        partial=whole == "partial",
        versions=decode_versions(values.get(VERSIONS_TRAILER, "")),
        revision=int(revision) if revision else None,
    )
