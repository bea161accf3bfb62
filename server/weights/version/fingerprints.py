"""WeightFingerprints: the digests behind a declaration's fingerprint and VerifyWeights.

Runs in the `enginectl serve` process, on the control loop. The workers compute the digests
(worker/weights/fingerprints.py) inside worker RPCs, which vLLM serialises with the forward pass; this
module only decides what to ask for and when:
- a declaration records the sampled digest at once (milliseconds, one round trip) and starts
  the full baseline: slices of at most worker SLICE_BYTES, one EngineCore round trip each, so
  the EngineCore runs generation steps between them;
- VerifyWeights(full) first lets the baseline finish, then takes the full digest of the
  weights now, also in slices;
- an update does not wait for the baseline: the workers answer its remaining slices
  "superseded" once the update wrote a weight, and go on if it failed before writing (the
  declaration it falls back to keeps its baseline).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence

from enginectl.contract.engine import DigestJob, DigestSlice, WorkerDigest
from enginectl.server.weights.engine_protocols import FingerprintEngine
from enginectl.server.weights.version.ledger import Fingerprint, VersionState
from enginectl.weights.v1 import weight_version_service_pb2 as wvs_pb2


class WeightFingerprints:
    """Sampled and full digests of the weights on every rank (see the module docstring)."""

    def __init__(self, engine: FingerprintEngine) -> None:
        self._engine = engine
        self.sampled_method = ""
        self.full_method = ""
        self._baseline: asyncio.Task[Fingerprint | None] | None = None

    async def sampled(self) -> Fingerprint:
        """The sampled digest of the weights now (milliseconds)."""
        return self._fold(await self._engine.fingerprint())

    async def declaration(self) -> Fingerprint:
        """For a declaration: the sampled digest now; the full baseline follows in slices."""
        token = uuid.uuid4().hex
        return self.declared(token, await self._engine.declare_fingerprint(token))

    def declared(self, token: str, workers: list[list[WorkerDigest]]) -> Fingerprint:
        """Record that the workers took the sampled digest `workers` of a declaration under
        `token` (directly or inside another utility), and start its full baseline."""
        self._baseline = asyncio.ensure_future(self._drive(DigestJob.BASELINE, token))
        self._baseline.add_done_callback(_retrieve)
        return self._fold(workers)

    async def verify_full(self) -> tuple[Fingerprint | None, Fingerprint]:
        """(recorded full digest of the last declaration, or None; full digest now)."""
        recorded = await self._recorded_full()
        current = await self._drive(DigestJob.VERIFY, uuid.uuid4().hex)
        assert current is not None  # a verify job is never superseded
        return recorded, current

    async def verify(
        self, state: VersionState, full: bool
    ) -> tuple[wvs_pb2.VerifyVerdict.ValueType, Fingerprint | None, Fingerprint]:
        """VerifyWeights against the declaration `state`: (verdict, recorded, current)."""
        recorded = state.fingerprint
        if full:
            recorded_full, current = await self.verify_full()
            if recorded is not None:
                recorded = recorded_full  # None: no full baseline (e.g. the weights changed since)
        else:
            current = await self.sampled()
        if not state.declared or recorded is None:
            return wvs_pb2.VERIFY_VERDICT_UNDECLARED, recorded, current
        verdict = wvs_pb2.VERIFY_VERDICT_MATCH if recorded.digest == current.digest else wvs_pb2.VERIFY_VERDICT_DRIFTED
        return verdict, recorded, current

    async def _recorded_full(self) -> Fingerprint | None:
        baseline = self._baseline
        if baseline is None:
            return None
        return await asyncio.shield(baseline)

    async def _drive(self, job: DigestJob, token: str) -> Fingerprint | None:
        """Slices until every worker is done; None when the workers say another declaration
        or a write superseded this baseline."""
        while True:
            workers = await self._engine.full_digest(job, token)
            flat = [w for rank in workers for w in rank]
            if any(w.superseded for w in flat):
                return None
            if all(w.done for w in flat):
                return self._fold(workers)

    def _fold(self, per_rank: Sequence[Sequence[WorkerDigest | DigestSlice]]) -> Fingerprint:
        """Per-worker digests folded per DP rank (TP workers of a rank combined) and overall."""
        ranks = []
        each: list[tuple[int, int, str]] = []
        method = ""
        for rank_index, workers in enumerate(per_rank):
            ordered = sorted(workers, key=lambda w: w.worker_rank)
            each.extend((w.dp_rank, w.worker_rank, w.digest) for w in ordered)
            digests = [w.digest for w in ordered]
            digest = (
                digests[0]
                if len(digests) == 1
                else hashlib.blake2b("".join(digests).encode(), digest_size=16).hexdigest()
            )
            ranks.append((ordered[0].dp_rank if ordered else rank_index, digest))
            if ordered:
                first = ordered[0]
                method = first.method
                if isinstance(first, WorkerDigest):
                    self.sampled_method = first.sampled_method
                    self.full_method = first.full_method
        overall = hashlib.blake2b("|".join(d for _, d in ranks).encode(), digest_size=16).hexdigest()
        return Fingerprint(method=method, digest=overall, ranks=tuple(ranks), workers=tuple(each))


def _retrieve(task: asyncio.Task[Fingerprint | None]) -> None:
    """A baseline nobody awaited failed (the engine died): its error is reported to whoever
    asks next (VerifyWeights, an update), not as an unretrieved-exception warning."""
    if not task.cancelled():
        task.exception()
