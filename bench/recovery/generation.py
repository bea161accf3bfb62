"""Generation in the recovery soak (bench/recovery/run.py): greedy completions on vLLM's HTTP
API (`/v1/completions`, token-id prompts, `return_token_ids`), the fixed prompts whose tokens
are compared with the references, the completions released by a forced resume, and the
rollout threads that run throughout the soak.

Rollouts pass a `RolloutGate`: the soak holds it while it reads the greedy tokens of a check,
so that those run alone. A batch changes the shapes of the engine's matrix products, and with
them the float rounding, so tokens read beside other requests could differ from the
references for that reason alone; the KV-cache blocks that rollouts wrote stay as they are.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

REQUEST_TIMEOUT_S = 120.0  # one completion (one queued behind a pause waits for the resume)
# The prompts checked after each recovery: lengths across several KV-cache blocks, one longer
# than 128 tokens; 8 greedy tokens each, EOS ignored (every one writes the same KV slots).
PROMPT_LENGTHS = (5, 33, 97, 150)
CHECK_TOKENS = 8
PROMPT_SEED = 36


class HttpError(RuntimeError):
    """A completion answered with a status other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def prompts(vocab: int) -> list[list[int]]:
    """The checked prompts: seeded token ids (the special ids 0-3 left out)."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def complete(
    port: int,
    model: str,
    prompt: list[int],
    max_tokens: int,
    conn: http.client.HTTPConnection | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> list[int]:
    """The token ids of a greedy completion of `prompt` (EOS ignored); on `conn` if given."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
    )
    own = conn is None
    c = conn if conn is not None else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        data = resp.read()
    finally:
        if own:
            c.close()
    if resp.status != 200:
        raise HttpError(resp.status, data.decode(errors="replace"))
    return [int(t) for t in json.loads(data)["choices"][0]["token_ids"]]


def greedy(port: int, model: str, checked: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of every checked prompt, one request after the other."""
    return [complete(port, model, p, CHECK_TOKENS) for p in checked]


class RolloutGate:
    """Rollouts enter it for each request; `held()` keeps new ones out and waits for those
    running to end, so that a check's requests run alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._closed = False
        self._active = 0

    def enter(self, timeout: float) -> bool:
        """Whether a rollout may send its request now (False: held past `timeout`, or closed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held or self._closed, timeout)
            if self._held or self._closed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @contextmanager
    def held(self, timeout: float) -> Iterator[bool]:
        """Rollouts held inside the block; yields whether those running ended within `timeout`."""
        with self._cond:
            self._held = True
            drained = self._cond.wait_for(lambda: self._active == 0, timeout)
        try:
            yield drained
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def close(self) -> None:
        """Let every waiting rollout go (the soak ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class TrustWindow:
    """Whether the server is trusted now: from a recovery update's success to the start of
    the next round's partial update. Each window has a number of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._number = 0
        self._trusted = False

    def open(self) -> None:
        with self._lock:
            self._number += 1
            self._trusted = True

    def close(self) -> None:
        with self._lock:
            self._number += 1
            self._trusted = False

    def now(self) -> int | None:
        """The open window's number (None: the server is not trusted now)."""
        with self._lock:
            return self._number if self._trusted else None


@dataclass
class RolloutStats:
    requests: int = 0
    completed: int = 0
    output_tokens: int = 0
    all_zero: int = 0  # outputs of 4+ tokens that are all token 0 (what NaN logits give)
    all_zero_trusted: int = 0  # of those, sent and answered while the server was trusted
    # Outputs all token 0 while trusted that the same request, sent again in the same window,
    # did not repeat: generation read NaN under a declared version (a mismatch).
    poisoned: list[dict[str, object]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def rollout_loop(
    port: int,
    model: str,
    vocab: int,
    seed: int,
    gate: RolloutGate,
    window: TrustWindow,
    stop: threading.Event,
    deadline: float,
    max_requests: int,
    stats: RolloutStats,
) -> None:
    """Short greedy completions back to back (prompts of 3-150 random ids, 1-11 tokens), on
    one keep-alive connection, until `stop`, `deadline` or `max_requests`. An output of 4+
    tokens all 0 within one trust window is sent again in it: a different answer is poisoned."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        for _ in range(max_requests):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            if not gate.enter(timeout=max(0.0, deadline - time.monotonic())):
                continue
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 150))]
            max_tokens = rng.randint(1, 11)
            with stats.lock:
                stats.requests += 1
            try:
                opened = window.now()
                tokens = complete(port, model, prompt, max_tokens, conn)
                zeros = len(tokens) >= 4 and not any(tokens)
                trusted = zeros and opened is not None and window.now() == opened
                again = complete(port, model, prompt, max_tokens, conn) if trusted else tokens
                if trusted and window.now() == opened and again != tokens:
                    with stats.lock:
                        stats.poisoned.append({"prompt_ids": len(prompt), "tokens": tokens, "again": again})
            except HttpError as exc:
                with stats.lock:
                    stats.errors[f"HTTP_{exc.status}"] += 1
                continue
            except (OSError, http.client.HTTPException) as exc:
                with stats.lock:
                    stats.errors[type(exc).__name__] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
                continue
            finally:
                gate.leave()
            with stats.lock:
                stats.completed += 1
                stats.output_tokens += len(tokens)
                stats.all_zero += zeros
                stats.all_zero_trusted += trusted
    finally:
        conn.close()


class Completions:
    """Completions sent at once, each on a thread of its own: those a forced resume releases
    over mixed weights (prompts of 20-200 random ids, 16-48 tokens, so that they write KV
    blocks well past the checked prompts' ends)."""

    def __init__(self, port: int, model: str, vocab: int, rng: random.Random, n: int) -> None:
        self.specs: list[tuple[list[int], int]] = []
        for _ in range(n):
            length = rng.randint(20, 200)
            self.specs.append(
                ([rng.randrange(4, vocab) for _ in range(length)], rng.randint(16, min(48, 250 - length)))
            )
        self.results: list[list[int] | str] = ["not finished"] * n
        self._threads = [
            threading.Thread(target=self._one, args=(i, port, model), name=f"released-{i}", daemon=True)
            for i in range(n)
        ]

    def _one(self, i: int, port: int, model: str) -> None:
        prompt, max_tokens = self.specs[i]
        try:
            self.results[i] = complete(port, model, prompt, max_tokens)
        except (HttpError, OSError, http.client.HTTPException) as exc:
            self.results[i] = f"{type(exc).__name__}: {exc}"[:300]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> bool:
        """Whether every completion ended within `timeout`."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def summary(self) -> dict[str, object]:
        tokens = [r for r in self.results if isinstance(r, list)]
        return {
            "sent": len(self.specs),
            "completed": len(tokens),
            "prompt_lengths": [len(p) for p, _ in self.specs],
            "output_tokens": sum(len(t) for t in tokens),
            "all_zero": sum(1 for t in tokens if t and not any(t)),
            "errors": [r for r in self.results if isinstance(r, str)],
        }
