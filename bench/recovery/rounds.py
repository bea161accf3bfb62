"""One round of the recovery soak (bench/recovery/run.py): a partial update through a source
in turn, maybe a forced resume over the mixed weights, a full recovery update through a
random source, and its check; and what the rounds count (`Tally`).

`Serving` holds what every round works with, built once by run.py: the server, its clients,
the trainer subprocess, the checkpoints and the references.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.lib.harness import ServeProcess
from bench.lib.procs import Worker
from bench.lib.progress import log
from bench.recovery.breaks import BrokenStream, Outcome, cancel_once_written, finish, wait_until
from bench.recovery.checks import Reference, check_recovery, health
from bench.recovery.generation import Completions, RolloutGate, TrustWindow
from enginectl.client import EnginectlError, NotFoundError, TrainerClient, UpdateOperation, WeightVersion

PARTIAL_SOURCES = ("stream", "disk", "broadcast", "ipc", "transfer")
RECOVERY_SOURCES = ("disk", "tensors", "gloo", "ipc", "transfer")
UPDATE_TIMEOUT_S = 120.0  # each update's `timeout`, and the bound of our wait for it
WRITTEN_WITHIN_S = 30.0  # a broken update wrote its first k tensors within this, or is broken anyway
DYING_BROADCAST_TIMEOUT_S = 30.0  # the update of a trainer killed mid-broadcast ends by this at the latest
TRANSFER_STEP_TIMEOUT_S = 3.0  # a transfer round that went away fails after this
TRAINER_READY_S = 300.0  # a trainer's torch import (and the checkpoints), on a busy machine
FORCED_RESUME_P = 0.5
QUEUED_WITHIN_S = 15.0  # the released completions show as queued on the paused engine
POLL_S = 0.05  # pacing of polls for which no event exists (a request queued, an Operation created)


class Unexpected(RuntimeError):
    """Something the soak did failed in a way no outcome explains."""


@dataclass
class Serving:
    """What every round works with."""

    server: ServeProcess
    trainer: Worker
    client: TrainerClient
    channel: grpc.Channel
    checkpoints: dict[str, str]  # "A"/"B" -> the checkpoint's directory, under an allowed root
    tensors: int  # tensors of a checkpoint
    vocab: int
    prompts: list[list[int]]  # the checked prompts
    refs: dict[str, Reference] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.server.grpc_target

    @property
    def http_port(self) -> int:
        return self.server.http_port

    @property
    def model(self) -> str:
        return self.server.served_model

    def file(self, which: str) -> Path:
        return Path(self.checkpoints[which]) / "model.safetensors"


@dataclass
class Tally:
    """What the rounds count, by source."""

    partial: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    causes: Counter[str] = field(default_factory=Counter)  # "source partial CAUSE", "source refused REASON"
    poisoned: Counter[str] = field(default_factory=Counter)  # outcomes of partial updates of NaN weights
    forced_resumes: int = 0
    nan_generations: int = 0  # forced resumes that generated all token 0 (NaN logits)
    recoveries: Counter[str] = field(default_factory=Counter)  # checked, by source
    recoveries_failed: Counter[str] = field(default_factory=Counter)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)  # a server state contradicting an outcome
    errors: list[dict[str, Any]] = field(default_factory=list)  # unexpected errors

    def outcome(self, source: str, outcome: Outcome, poisoned: bool) -> None:
        {"partial": self.partial, "refused": self.refused, "completed": self.completed}[outcome.kind][source] += 1
        self.poisoned[outcome.kind] += poisoned
        if outcome.kind != "completed":
            self.causes[f"{source} {outcome.kind} {outcome.cause or outcome.reason}"] += 1

    def summary(self) -> dict[str, Any]:
        sources = [s for s in PARTIAL_SOURCES if s in self.partial or s in self.refused or s in self.completed]
        return {
            "partials": {
                s: {"partial": self.partial[s], "refused": self.refused[s], "completed": self.completed[s]}
                for s in sources
            },
            "causes": dict(sorted(self.causes.items())),
            "poisoned_partials": dict(self.poisoned),
            "forced_resumes": self.forced_resumes,
            "nan_generations": self.nan_generations,
            "recoveries_checked": dict(self.recoveries),
            "recoveries_failed": dict(self.recoveries_failed),
            "mismatch_count": len(self.mismatches),
            "mismatches": self.mismatches,
            "anomalies": self.anomalies,
            "errors": self.errors,
        }


def forced_note(forced: dict[str, Any] | None) -> str:
    if forced is None:
        return ""
    return ", forced resume" + (f" ({forced['all_zero']} generated all token 0)" if forced["all_zero"] else "")


class Rounds:
    """The soak's rounds over one `Serving`; `current` is the checkpoint served now. `window`
    is open from a recovery's success to the next round's start (the rollouts' trust)."""

    def __init__(
        self,
        serving: Serving,
        rng: random.Random,
        gate: RolloutGate,
        window: TrustWindow,
        stop: threading.Event,
        partial_sources: tuple[str, ...],
        recovery_sources: tuple[str, ...],
        nan_p: float,
        current: str,
    ) -> None:
        self.s, self.rng, self.gate, self.window, self.stop = serving, rng, gate, window, stop
        self.client = serving.client
        self.partial_sources, self.recovery_sources, self.nan_p = partial_sources, recovery_sources, nan_p
        self.current = current
        self.tally = Tally()
        self.records: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    # -- 1. a partial update ----------------------------------------------------------------------
    def _written(self, name: str, count: int, deadline: float) -> UpdateOperation | None:
        """The Operation once it wrote `count` tensors (or ended, or `deadline`); one that
        does not exist yet is asked for again."""
        while True:
            try:
                return wait_until(self.client, name, deadline, written=count)
            except NotFoundError:
                if time.monotonic() >= deadline:
                    return None
                self.stop.wait(POLL_S)

    def _break_stream(self, which: str, version: str, detail: dict[str, Any]) -> Outcome:
        count = self.rng.randrange(self.s.tensors)  # 0: broken before any tensor arrived
        how = self.rng.choice(("cancel", "half-close"))
        detail.update(count=count, how=how)
        stream = BrokenStream(self.s.channel, self.s.file(which), version, count, UPDATE_TIMEOUT_S)
        started = self.s.server.watch(stream.request_id.encode())  # its "weight update started" line
        stream.start()
        try:
            if not started.wait(60):
                raise Unexpected(f"the broken stream's update never started ({stream.operation})")
            if count:
                self._written(stream.operation, count, time.monotonic() + WRITTEN_WITHIN_S)
            if how == "cancel":
                stream.cancel()
            else:
                stream.half_close()
            return finish(self.client, stream.operation, UPDATE_TIMEOUT_S + 30)
        finally:
            stream.close()

    def _break_disk(self, which: str, version: str, detail: dict[str, Any]) -> Outcome:
        at_once = self.rng.random() < 0.5
        detail.update(at_once=at_once)
        op = self.client.update_weights_from_disk(
            self.s.checkpoints[which], version, timeout=UPDATE_TIMEOUT_S, wait=False
        )
        cancel_once_written(self.client, op.name, at_once, time.monotonic() + WRITTEN_WITHIN_S)
        return finish(self.client, op.name, UPDATE_TIMEOUT_S + 30)

    def _break_broadcast(self, which: str, version: str, n: int, detail: dict[str, Any]) -> Outcome:
        count = self.rng.randrange(self.s.tensors)
        detail.update(count=count)
        args = ["die-mid-broadcast", "--target", self.s.target, "--file", str(self.s.file(which))]
        args += ["--group", f"dying-{n}", "--version", version, "--count", str(count)]
        args += ["--timeout", str(DYING_BROADCAST_TIMEOUT_S)]
        child = Worker(args, module="bench.recovery.trainer")
        try:
            name = str(child.expect("sent", TRAINER_READY_S)["operation"])
            if count:
                self._written(name, count, time.monotonic() + WRITTEN_WITHIN_S)
            child.kill()  # the trainer dies mid-broadcast
            return finish(self.client, name, DYING_BROADCAST_TIMEOUT_S + 60)
        finally:
            child.kill()
            child.finish(10)

    def _break_in_trainer(self, command: dict[str, Any]) -> Outcome:
        self.s.trainer.send(json.dumps(command))
        broken = self.s.trainer.expect("broken", UPDATE_TIMEOUT_S + 30)
        if not broken["operation"]:
            raise Unexpected(f"the trainer could not start the update to break: {broken}")
        return finish(self.client, str(broken["operation"]), UPDATE_TIMEOUT_S + 30)

    def partial(self, n: int, source: str, which: str) -> tuple[Outcome, dict[str, Any]]:
        """An update of `which` through `source`, broken part way: its outcome and record."""
        version = f"partial-{n}-{which}-{source}"
        detail: dict[str, Any] = {"source": source, "which": which, "version": version}
        command: dict[str, Any] = {"op": "break", "source": source, "which": which, "version": version}
        if source == "stream":
            outcome = self._break_stream(which, version, detail)
        elif source == "disk":
            outcome = self._break_disk(which, version, detail)
        elif source == "broadcast":
            outcome = self._break_broadcast(which, version, n, detail)
        elif source == "ipc":
            command["at_once"] = self.rng.random() < 0.5
            detail.update(at_once=command["at_once"])
            outcome = self._break_in_trainer(command)
        elif source == "transfer":
            command |= {"count": self.rng.randint(1, self.s.tensors - 1), "step_timeout": TRANSFER_STEP_TIMEOUT_S}
            detail.update(count=command["count"])
            outcome = self._break_in_trainer(command)
        else:
            raise ValueError(f"unknown partial source {source!r}")
        detail.update(
            outcome=outcome.kind,
            reason=outcome.reason,
            cause=outcome.cause,
            written=f"{outcome.tensors_done}/{outcome.tensors_total}",
        )
        return outcome, detail

    def contradictions(self, outcome: Outcome, before: WeightVersion, version: str) -> list[str]:
        """How the server's state contradicts `outcome` (nothing: it says what happened)."""
        v = self.client.get_weight_version()
        state = self.client.generation_state()
        served = health(self.s.channel)["server"]
        wrong = []
        if outcome.kind == "partial":
            if not outcome.weights_modified:
                wrong.append("PARTIAL_UPDATE without weights_modified")
            if v.declared or v.last_failure is None or v.last_failure.reason != "PARTIAL_UPDATE":
                wrong.append(f"not quarantined: declared={v.declared} last_failure={v.last_failure}")
            if not state.paused or state.reason != "PARTIAL_UPDATE":
                wrong.append(f"generation paused={state.paused} reason={state.reason}")
            if served != "NOT_SERVING":
                wrong.append(f"health {served}")
        elif outcome.kind == "refused":
            if outcome.weights_modified:
                wrong.append(f"refused ({outcome.reason}) after weights_modified")
            if v.etag != before.etag:
                wrong.append(f"the version changed: {before.version!r}@{before.revision} -> {v.version!r}@{v.revision}")
            if state.paused and before.last_failure is None:
                wrong.append(f"left paused ({state.reason})")
        elif not v.declared or v.version != version or state.paused or served != "SERVING":
            wrong.append(f"completed, yet declared={v.declared} version={v.version!r} paused={state.paused} {served}")
        return wrong

    # -- 2. a forced resume over the mixed weights ----------------------------------------------------
    def _poll(self, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() >= deadline or self.stop.wait(POLL_S):
                return False
        return True

    def forced_resume(self) -> tuple[dict[str, Any], list[str]]:
        """Completions queued on the quarantined engine, released over its mixed weights: the
        record, and how the server contradicts a forced resume (resumed, yet NOT_SERVING)."""
        released = Completions(self.s.http_port, self.s.model, self.s.vocab, self.rng, self.rng.randint(2, 4))
        released.start()

        def queued() -> bool:
            st = self.client.generation_state()
            return st.num_waiting_requests + st.num_running_requests >= len(released.specs)

        seen = self._poll(queued, QUEUED_WITHIN_S)
        resumed = self.client.resume_generation(force=True)
        served = health(self.s.channel)["server"]
        ended = released.join(2 * UPDATE_TIMEOUT_S)
        self.tally.forced_resumes += 1
        out: dict[str, Any] = {"queued_seen": seen, "resumed": not resumed.paused, "health": served, "ended": ended}
        out |= released.summary()
        self.tally.nan_generations += bool(out["all_zero"])
        wrong = [
            *(["still paused after ResumeGeneration(force)"] if resumed.paused else []),
            *([f"health {served} while quarantined"] if served != "NOT_SERVING" else []),
            *(["released completions did not end"] if not ended else []),
        ]
        return out, wrong

    # -- 3. a full recovery update, checked -----------------------------------------------------------
    def recover(self, n: int) -> tuple[dict[str, Any], str | None]:
        """A full update of a random checkpoint through a random source: its record, and the
        checkpoint if it succeeded."""
        source, which = self.rng.choice(self.recovery_sources), self.rng.choice(("A", "B"))
        version = f"recovered-{n}-{which}-{source}"
        rec: dict[str, Any] = {"source": source, "which": which, "version": version}
        started = time.monotonic()
        if source == "disk":
            try:
                self.client.update_weights_from_disk(self.s.checkpoints[which], version, timeout=UPDATE_TIMEOUT_S)
                out: dict[str, Any] = {"ok": True}
            except EnginectlError as err:
                out = {"ok": False, "code": err.code.name, "reason": err.reason, "message": err.message[:300]}
                out["cause"] = err.metadata.get("cause", "")
        else:
            self.s.trainer.send(json.dumps({"op": "update", "source": source, "which": which, "version": version}))
            out = self.s.trainer.expect("done", UPDATE_TIMEOUT_S + 120)
        rec["s"] = round(time.monotonic() - started, 2)
        if not out["ok"]:
            rec["failed"] = {k: out.get(k) for k in ("code", "reason", "cause", "message")}
            self.tally.recoveries_failed[source] += 1
            return rec, None
        return rec, which

    def run(self, n: int) -> None:
        source = self.partial_sources[n % len(self.partial_sources)]
        poisoned = self.rng.random() < self.nan_p
        which = ("B" if self.current == "A" else "A") + ("-nan" if poisoned else "")
        record: dict[str, Any] = {"round": n, "t_s": round(time.monotonic() - self.t0, 1)}
        self.records.append(record)
        self.window.close()

        before = self.client.get_weight_version()
        outcome, record["partial"] = self.partial(n, source, which)
        record["partial"]["poisoned"] = poisoned
        self.tally.outcome(source, outcome, poisoned)
        if outcome.kind == "completed":
            self.current = which[0]
        wrong = self.contradictions(outcome, before, record["partial"]["version"])
        if outcome.kind == "partial" and self.rng.random() < FORCED_RESUME_P:
            record["forced_resume"], also = self.forced_resume()
            wrong += also
        if wrong:
            record["contradictions"] = wrong
            self.tally.anomalies.append({"round": n, "partial": record["partial"], "contradictions": wrong})

        record["recovery"], recovered = self.recover(n)
        rec = record["recovery"]
        if recovered is None:
            self.tally.mismatches.append({"round": n, "partial": record["partial"], "recovery": rec})
            log(f"round {n}: {source} -> {outcome.kind}; recovery via {rec['source']} FAILED: {rec['failed']}")
            return
        self.current = recovered
        self.window.open()
        self.tally.recoveries[rec["source"]] += 1
        check = check_recovery(
            self.client,
            self.s.channel,
            self.s.http_port,
            self.s.model,
            self.s.prompts,
            self.s.refs[recovered],
            rec["version"],
            self.gate,
        )
        record["check"] = check.summary()
        if check.differences:
            self.tally.mismatches.append(
                {
                    "round": n,
                    "partial": record["partial"],
                    "forced_resume": "forced_resume" in record,
                    "recovery": rec,
                    "differences": check.differences,
                }
            )
        log(
            f"round {n}: {source}{' of NaN weights' if poisoned else ''} -> {outcome.kind} "
            f"{outcome.cause or outcome.reason} "
            f"({record['partial']['written']}){forced_note(record.get('forced_resume'))}; "
            f"recovered {recovered} via {rec['source']}: "
            + ("ok" if not check.differences else f"MISMATCH: {'; '.join(check.differences)[:400]}")
        )
