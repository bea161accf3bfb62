"""What the recovery soak (bench/recovery/run.py) compares after each recovery update: the
references taken on the fresh server, and the check of one recovery against them.

A recovery of checkpoint X is trusted when the server says it serves X (declared with the
update's version, no `last_failure`, not paused, gRPC health SERVING) and behaves as a fresh
engine on X: the greedy tokens of every checked prompt are X's references, and a full
VerifyWeights answers MATCH with, on every rank and every worker, the current digest that a
fresh engine computed after a clean disk load of X. Anything else is a mismatch, named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.recovery.generation import RolloutGate, greedy
from enginectl.client import TrainerClient, Verification

HEALTH_SERVICES = ("", "enginectl.weights.v1.WeightUpdateService", "enginectl.weights.v1.WeightVersionService")
HOLD_TIMEOUT_S = 150.0  # rollouts running when a check starts end within this (their own bound)


@dataclass(frozen=True)
class Reference:
    """What a fresh engine shows for one checkpoint: its greedy tokens and full digests."""

    tokens: list[list[int]]
    ranks: dict[str, str]  # "dp0" -> the rank's current full digest
    workers: dict[str, str]  # "dp0/w0" -> the worker's
    method: str


def digests(v: Verification) -> tuple[dict[str, str], dict[str, str]]:
    """Current digests of a VerifyWeights answer, by rank and by worker."""
    ranks = {f"dp{r.dp_rank}": r.current_digest for r in v.ranks}
    workers = {f"dp{r.dp_rank}/w{w.worker_rank}": w.current_digest for r in v.ranks for w in r.workers}
    return ranks, workers


def reference(tokens: list[list[int]], v: Verification) -> Reference:
    ranks, workers = digests(v)
    return Reference(tokens, ranks, workers, v.method)


def health(channel: grpc.Channel) -> dict[str, str]:
    """gRPC health of the whole server ("") and of the weight services, by name."""
    check = health_pb2_grpc.HealthStub(channel).Check
    out = {}
    for service in HEALTH_SERVICES:
        status = check(health_pb2.HealthCheckRequest(service=service), timeout=30).status
        out[service or "server"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return out


@dataclass
class Check:
    """One recovery checked: every difference from the reference, in words (none: it matched)."""

    differences: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    tokens_again: list[list[int]] = field(default_factory=list)  # read again after a token mismatch
    verdict: str = ""
    rollouts_drained: bool = True

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"differences": self.differences, "verdict": self.verdict}
        if self.differences:
            out["tokens"] = self.tokens
            out["tokens_again"] = self.tokens_again
        if not self.rollouts_drained:
            out["rollouts_drained"] = False
        return out


def check_recovery(
    client: TrainerClient,
    channel: grpc.Channel,
    port: int,
    model: str,
    checked: list[list[int]],
    ref: Reference,
    version: str,
    gate: RolloutGate,
) -> Check:
    """The server after a recovery update declaring `version`, against `ref`."""
    out = Check()
    v = client.get_weight_version()
    if not v.declared or v.version != version:
        out.differences.append(f"version: declared={v.declared} version={v.version!r}, expected {version!r}")
    if v.last_failure is not None:
        out.differences.append(f"last_failure kept: {v.last_failure.reason} ({v.last_failure.operation})")
    state = client.generation_state()
    if state.paused:
        out.differences.append(f"still paused ({state.reason})")
    for service, status in health(channel).items():
        if status != "SERVING":
            out.differences.append(f"health {service}: {status}")
    with gate.held(HOLD_TIMEOUT_S) as drained:
        out.rollouts_drained = drained
        out.tokens = greedy(port, model, checked)
        if out.tokens != ref.tokens:
            out.tokens_again = greedy(port, model, checked)
    for i, (got, want) in enumerate(zip(out.tokens, ref.tokens, strict=True)):
        if got != want:
            again = out.tokens_again[i] if out.tokens_again else None
            out.differences.append(
                f"tokens of prompt {i} ({len(checked[i])} ids): {got}, expected {want}"
                + ("" if again is None else f" (read again: {again})")
            )
    verification = client.verify_weights(full=True)
    out.verdict = verification.verdict
    if verification.verdict != "MATCH":
        out.differences.append(f"VerifyWeights(full) verdict {verification.verdict}")
    ranks, workers = digests(verification)
    for where, digest in (ref.ranks | ref.workers).items():
        now = (ranks | workers).get(where)
        if now != digest:
            out.differences.append(f"full digest of {where}: {now}, expected {digest} (a fresh engine's)")
    return out
