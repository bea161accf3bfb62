"""The soak's load (bench/soak/run.py): rollout threads on vLLM's HTTP API, CAS writers, and the
weight updates, rotating sources and checkpoints (tensor-stream and gloo updates are sent by the
trainer subprocess, bench/soak/trainer.py).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.lib.procs import Worker
from bench.soak.records import (
    REQUEST_TIMEOUT_S,
    SOURCES,
    UPDATE_TIMEOUT_S,
    VLLM_PLACEHOLDER,
    Errors,
    Writes,
)
from enginectl.client import AbortedError, Client, EnginectlError, Reason, TrainerClient

CHECKPOINTS = ("B", "A")  # the server starts on A's weights: the first update changes them
CAS_PAUSE_S = 0.02  # upper bound of a CAS writer's random pause between rounds (its pace)


# -- rollouts ----------------------------------------------------------------------------------
@dataclass
class RolloutStats:
    requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    unstamped: int = 0  # outputs without weight_versions
    placeholder: int = 0  # outputs naming VLLM_PLACEHOLDER (generated before any declaration)
    multi_version: int = 0  # outputs generated across an update (several versions)
    versions: set[str] = field(default_factory=set)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (t since start, seconds)


def rollout_loop(
    port: int,
    vocab: int,
    seed: int,
    stop: threading.Event,
    deadline: float,
    max_requests: int,
    t0: float,
    stats: RolloutStats,
    lock: threading.Lock,
    errors: Errors,
) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        for _ in range(max_requests):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 150))]
            body = json.dumps(
                {"token_ids": prompt, "sampling_params": {"max_tokens": rng.randint(1, 11), "temperature": 0.0}}
            )
            started = time.monotonic()
            with lock:
                stats.requests += 1
            try:
                conn.request("POST", "/inference/v1/generate", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                errors.add("rollout", type(exc).__name__, message=str(exc))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
                continue
            if resp.status != 200:
                errors.add("rollout", f"HTTP_{resp.status}", message=data[:300].decode(errors="replace"))
                continue
            choice = json.loads(data)["choices"][0]
            spans = choice.get("weight_versions") or []
            with lock:
                stats.completed += 1
                stats.prompt_tokens += len(prompt)
                stats.output_tokens += len(choice.get("token_ids") or [])
                stats.latencies.append((round(started - t0, 3), time.monotonic() - started))
                stats.unstamped += not spans
                stats.multi_version += len(spans) > 1
                stats.versions.update(s["version"] for s in spans if s.get("version"))
                stats.placeholder += any(s.get("version") == VLLM_PLACEHOLDER for s in spans)
    finally:
        conn.close()


# -- CAS writers -------------------------------------------------------------------------------
@dataclass
class CasStats:
    rounds: int = 0
    succeeded: int = 0
    etag_mismatch: int = 0


def cas_loop(
    target: str,
    index: int,
    stop: threading.Event,
    deadline: float,
    max_rounds: int,
    stats: CasStats,
    lock: threading.Lock,
    writes: Writes,
    errors: Errors,
) -> None:
    rng = random.Random(1000 + index)
    with Client(target, timeout=REQUEST_TIMEOUT_S) as client:
        for i in range(max_rounds):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            with lock:
                stats.rounds += 1
            try:
                current = client.get_weight_version()
                state = client.set_weight_version(f"cas-{index}-{i}", etag=current.etag)
            except AbortedError as err:
                if err.reason != Reason.ETAG_MISMATCH:
                    errors.rpc("cas", err)
                    continue
                with lock:
                    stats.etag_mismatch += 1
            except EnginectlError as err:
                errors.rpc("cas", err)
            else:
                writes.add_state("cas", state)
                with lock:
                    stats.succeeded += 1
            stop.wait(rng.uniform(0.0, CAS_PAUSE_S))


# -- weight updates ----------------------------------------------------------------------------
@dataclass
class UpdateStats:
    ok: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    declarations: int = 0
    declarations_failed: int = 0
    verify: Counter[str] = field(default_factory=Counter)
    wall_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})
    server_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})


class Updater:
    """Back-to-back updates, rotating the sources and checkpoints; holds `lock` during each
    step so that resource snapshots fall between two updates."""

    def __init__(
        self,
        target: str,
        trainer: Worker,
        checkpoints: dict[str, str],
        sources: tuple[str, ...],
        writes: Writes,
        errors: Errors,
    ) -> None:
        self.target, self.trainer, self.checkpoints, self.sources = target, trainer, checkpoints, sources
        self.writes, self.errors = writes, errors
        self.lock = threading.Lock()
        self.stats = UpdateStats()

    def _disk(self, client: TrainerClient, which: str, version: str) -> dict[str, Any]:
        try:
            result = client.update_weights_from_disk(self.checkpoints[which], version, timeout=UPDATE_TIMEOUT_S)
        except EnginectlError as err:
            return {"ok": False, "stage": "disk", "code": err.code.name, "reason": err.reason, "message": err.message}
        v = result.weight_version
        return {"ok": True, "revision": v.revision, "version": v.version, "server_s": result.duration}

    def _child(self, op: str, which: str, version: str) -> dict[str, Any]:
        """An update sent by the trainer subprocess (raises if it died or hung)."""
        self.trainer.send(json.dumps({"op": op, "which": which, "version": version}))
        return self.trainer.expect("done", UPDATE_TIMEOUT_S + 90)

    def _step(self, client: TrainerClient, n: int) -> None:
        source, which = self.sources[n % len(self.sources)], CHECKPOINTS[n % len(CHECKPOINTS)]
        version = f"soak-{source}-{n}"
        started = time.monotonic()
        out = self._disk(client, which, version) if source == "disk" else self._child(source, which, version)
        if out["ok"]:
            self.stats.ok[source] += 1
            self.stats.wall_s[source].append(time.monotonic() - started)
            self.stats.server_s[source].append(float(out["server_s"]))
            self.writes.add(source, out["version"], int(out["revision"]))
        else:
            self.stats.failed[source] += 1
            self.errors.add(f"update-{source}", out["code"], out["reason"], out["message"])
            if out["reason"] in (Reason.PARTIAL_UPDATE, Reason.UPDATE_TIMEOUT, Reason.STREAM_BROKEN):
                # Left paused over mixed weights (docs/weights.md): the next update
                # resumes; resume now so that rollouts keep running meanwhile.
                with contextlib.suppress(EnginectlError):
                    client.resume_generation(force=True)
        try:
            self.writes.add_state("decl", client.set_weight_version(f"soak-decl-{n}"))
            self.stats.declarations += 1
        except EnginectlError as err:
            self.stats.declarations_failed += 1
            self.errors.rpc("declare", err)
        if n % len(self.sources) == len(self.sources) - 1:
            try:
                self.stats.verify[client.verify_weights().verdict] += 1
            except EnginectlError as err:
                self.errors.rpc("verify", err)

    def run(self, stop: threading.Event, deadline: float, max_updates: int) -> None:
        with TrainerClient(self.target, timeout=REQUEST_TIMEOUT_S) as client:
            for n in range(max_updates):
                if stop.is_set() or time.monotonic() >= deadline:
                    break
                with self.lock:
                    try:
                        self._step(client, n)
                    except (RuntimeError, OSError) as exc:  # the trainer subprocess died or hung
                        self.errors.add("updater", type(exc).__name__, message=str(exc))
                        break


def guarded(name: str, errors: Errors, fn: Callable[..., None], *args: Any) -> threading.Thread:
    """A daemon thread running `fn(*args)`; a crash is recorded as an error, never lost."""

    def body() -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.add(name, "CRASHED", type(exc).__name__, repr(exc))

    return threading.Thread(target=body, name=name, daemon=True)
