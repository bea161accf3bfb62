"""One RL step through the SMG gateway: pause every engine, load new weights declaring their
version, resume, then roll out through SMG's OpenAI API and see the version on every answer.

Runs in a trainer process on the servers' host (the weights are loaded from a directory the
servers read), with enginectl's client, SMG's `smg.rl` client (`pip install smg`) and openai.
By default it starts everything itself and stops and reaps it at the end: `smg launch` (the
RL plane on) and two `enginectl serve` on the embedded tiny model, each registering itself
with SMG (`--gateway`), which keeps SMG's `weight_version` label current
(docs/rollouts.md, "Behind the SMG gateway"):

    .venv/bin/python examples/smg_rl_step.py

Or against a gateway that runs already, whose vLLM workers are enginectl servers started
with `--gateway` (it then starts and stops nothing):

    .venv/bin/python examples/smg_rl_step.py --smg http://127.0.0.1:30000 [--model-path DIR]

The step is what an RL framework does with `smg.rl`: `paused(rl, "engine=vllm")` fans
`pause_generation` out to every matching worker's `rl.control_url` (enginectl's HTTP RL
routes, on vLLM's HTTP port), `rl.fanout("update_weights_from_disk", {"model_path",
"weight_version"})` loads and declares on each, and leaving the block fans out
`continue_generation`. Then `/v1/completions` on SMG: SMG stamps each answer's
`system_fingerprint` with the worker's `weight_version` label, which the server updated on
its own within about a second of the declaration; the example waits (bounded) until SMG's
rows name the new version before rolling out. A gateway stamps what it last knew: the exact
versions of a rollout are the `Generate` trailers (docs/rollouts.md).

Exits 0 when every answer names the declared version, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from smg.rl import RL, Worker, paused

BIN = Path(sys.executable).parent
PROMPTS = ["The capital of France is", "Once upon a time", "A reward model scores", "The weights were pushed"]
START_TIMEOUT_S = 300.0  # an engine start takes about a minute on a small machine
STOP_TIMEOUT_S = 60.0
LABEL_TIMEOUT_S = 10.0  # SMG's label follows a declaration within about a second


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy (or fail after `timeout`): a
    subprocess or a remote gateway offers nothing to wait on but asking again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if found := check():
                return found
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        threading.Event().wait(interval)


class Started:
    """The processes this example started, stopped and reaped in reverse order (SIGTERM,
    then SIGKILL after a bound): the servers first, so that they deregister from SMG."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def smg(self) -> str:
        """`smg launch` on a free loopback port; its URL once GET /health answers."""
        port = free_port()
        cmd = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--enable-rl", "--enable-igw", "--health-check-interval-secs", "1"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        wait_until("smg /health", lambda: urllib.request.urlopen(url + "/health", timeout=1).status == 200, 30)
        return url

    def server(self, gateway: str, core: int) -> Callable[[], bool]:
        """`enginectl serve` on free ports registering with `gateway`; the returned check is
        true once its JSON `serving` line came (its log is drained meanwhile, so it never
        blocks) and raises if it exited first."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        if (os.cpu_count() or 1) >= 2:  # two engines on one host: a core each (docs/operations.md)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
        cmd = [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0", "--log-json"]
        proc = subprocess.Popen(
            [*cmd, "--gateway", gateway],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        serving = threading.Event()
        tail: deque[str] = deque(maxlen=30)

        def drain() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.decode(errors="replace").rstrip())
                if not serving.is_set() and line.startswith(b'{"') and b'"event": "serving"' in line:
                    serving.set()

        threading.Thread(target=drain, daemon=True).start()

        def check() -> bool:
            if proc.poll() is not None and not serving.is_set():
                raise SystemExit(f"enginectl serve exited with {proc.returncode} before serving:\n" + "\n".join(tail))
            return serving.is_set()

        return check

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT_S)


def ready_workers(rl: RL, count: int) -> list[Worker]:
    """SMG's vLLM workers once `count` of them are healthy (empty until then)."""
    workers = [w for w in rl.workers() if w.engine == "vllm" and w.health == "ready"]
    return workers if len(workers) >= count else []


def step(rl: RL, selector: str, model_path: str, version: str) -> None:
    """Pause every matching worker, load `model_path` declaring `version`, resume."""
    with paused(rl, selector) as pause:
        print(f"paused {pause.succeeded} of {pause.total} worker(s) ({selector})")
        loaded = rl.fanout(
            "update_weights_from_disk", {"model_path": model_path, "weight_version": version}, selector=selector
        )
        for wid, r in sorted(loaded.results.items()):
            message = r.body.get("message") if isinstance(r.body, dict) else r.body
            print(f"update_weights_from_disk on {wid} ({r.url}): HTTP {r.status}, {message}, {r.latency_ms} ms")
    print(f"resumed {selector}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smg", help="a running SMG's URL (default: start smg and --servers servers)")
    parser.add_argument("--servers", type=int, default=2, help="servers to start behind it (default 2)")
    parser.add_argument("--model-path", help="the weights to load (default: what the first worker serves)")
    parser.add_argument("--version", default="step-1", help="the version to declare (default step-1)")
    parser.add_argument("--selector", default="engine=vllm", help="SMG's worker selector (default engine=vllm)")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    started = Started()
    try:
        smg, count = args.smg, 1
        if smg is None:
            smg, count = started.smg(), args.servers
            servings = [started.server(smg, core) for core in range(count)]
            for i, serving in enumerate(servings):
                wait_until(f"server {i} to serve", serving, START_TIMEOUT_S)
        rl = RL(smg, timeout=120)
        workers = wait_until(f"{count} healthy vLLM worker(s) in SMG", lambda: ready_workers(rl, count), 60)
        print(f"smg {smg}: {len(workers)} vLLM worker(s): {', '.join(w.url for w in workers)}")

        model_path = args.model_path or rl.call(workers[0].id, "get_server_info", method="GET").body["model"]
        step(rl, args.selector, model_path, args.version)

        def labelled() -> list[Worker]:
            rows = [w for w in rl.workers() if w.engine == "vllm"]
            return rows if all(w.weight_version == args.version for w in rows) else []

        began = time.monotonic()
        rows = wait_until(f"SMG's labels to name {args.version}", labelled, LABEL_TIMEOUT_S, interval=0.02)
        print(f"SMG's rows name {args.version} {time.monotonic() - began:.3f}s after the step")

        client = openai.OpenAI(base_url=smg + "/v1", api_key="unused", timeout=60)
        fingerprints = []
        for prompt in PROMPTS:
            answer = client.completions.create(
                model=workers[0].model_id, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0
            )
            fingerprints.append(answer.system_fingerprint)
            print(f"rollout {prompt!r}: system_fingerprint={answer.system_fingerprint} text={answer.choices[0].text!r}")

        print("/v1/rl/workers:")
        for w in rows:
            print(f"  {w.id} {w.url} health={w.health} weight_version={w.weight_version} control_url={w.control_url}")
        ok = all(f == args.version for f in fingerprints)
        print(f"done: {len(fingerprints)} rollouts, {'every one' if ok else 'NOT every one'} stamped {args.version}")
        return 0 if ok else 1
    finally:
        started.stop()


if __name__ == "__main__":
    sys.exit(main())
