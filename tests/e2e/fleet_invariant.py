"""The fleet invariant (docs/weights.md, "The fleet"), checked from outside while test_fleet's
chaos test drives a fleet: what every round of observation asserts of the servers, and what
every output must name and generate."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
from support.fault_helpers import SERVING, health
from support.serving import ServeProcess
from support.weights import WeightStubs

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [5, 5, 5, 5, 5, 5]]


def checkpoint_of(version: str) -> str:
    """Fleet versions name their checkpoint: "A", "A:3", "B:4"."""
    return version.split(":")[0]


class Invariant:
    """The fleet invariant (docs/weights.md, "The fleet"), checked from outside: no server is
    SERVING over mixed weights; every SERVING server that is not joining serves the fleet's
    version, running; in a strict commit, servers seen running in one round never run two
    versions; every output names versions the fleet declared, and its tokens are the ones
    the named checkpoint generates."""

    def __init__(self, references: dict[tuple[str, int], list[int]]) -> None:
        self.version = "A"
        self.declared = {"A"}
        self.joining: set[str] = set()
        self.references = references
        self.strict = True
        self.violations: list[str] = []
        self.outputs = 0

    def observe(self, servers: dict[str, ServeProcess]) -> None:
        """One round over every server: health and generation state, between two reads of
        the version (a server whose etag moved meanwhile is read again next round)."""
        running: dict[str, str | None] = {}
        consistent = True
        for target, srv in servers.items():
            if target in self.joining:
                continue
            stubs_ = WeightStubs(srv)
            try:
                before = stubs_.version()
                serving = health(stubs_)[""] == SERVING
                state, version = stubs_.state(), stubs_.version()
            except grpc.RpcError:
                continue  # terminated or restarting: not SERVING
            finally:
                stubs_.channel.close()
            if version.etag != before.etag:
                consistent = False
                continue
            if serving and not version.declared and version.HasField("last_failure"):
                self.violations.append(f"{target} SERVING over mixed weights: {version}")
            if serving and not state.paused:
                running[target] = version.version if version.declared else None
        if self.strict and consistent and len(set(running.values())) > 1:
            self.violations.append(f"two versions running at once in a strict fleet: {running}")

    def settled(self, servers: dict[str, ServeProcess]) -> None:
        """Between steps: every member SERVING, running, on the fleet's version, generating it."""
        for target, srv in servers.items():
            if target in self.joining:
                continue
            stubs_ = WeightStubs(srv)
            try:
                assert health(stubs_)[""] == SERVING, target
                version, state = stubs_.version(), stubs_.state()
            finally:
                stubs_.channel.close()
            assert (version.declared, version.version, state.paused) == (True, self.version, False), (target, version)
            for i, prompt in enumerate(PROMPTS):
                self.check_output(generate_ids(srv, prompt), i)

    def check_output(self, choice: dict[str, Any], prompt: int) -> None:
        spans = choice["weight_versions"]
        for span in spans:
            if span["version"] not in self.declared:
                self.violations.append(f"an output names {span['version']!r}, never declared: {spans}")
        if spans and spans[0]["start"] == 0:
            end = spans[0]["end"]
            want = self.references[(checkpoint_of(spans[0]["version"]), prompt)]
            if choice["token_ids"][:end] != want[:end]:
                self.violations.append(f"tokens under {spans[0]['version']} are not its checkpoint's: {choice}")
        self.outputs += 1


def generate_ids(server: ServeProcess, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0}})
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate", data=body.encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response)["choices"][0])
