"""An RL loop against one `enginectl serve`: update the weights, push them, roll out, and keep
only the rollouts the pushed weights produced.

Runs in a trainer process on the server's host (it reads the served checkpoint from disk),
with enginectl's client, torch, safetensors, tokenizers and openai (all installed with vLLM).
The server must run vLLM's token-in/token-out API: `make serve ARGS="--enable-scale-out"`.

    .venv/bin/python examples/rl_loop.py --grpc 127.0.0.1:50051 --http 127.0.0.1:8000 --steps 3

Every step N:

1. the "trainer" (a copy of the served weights in a state dict) nudges one projection with a
   little seeded noise, standing in for an optimizer step;
2. it pushes the whole state dict and declares version `step-N`: odd steps over the gRPC
   tensor stream (UpdateWeightsFromTensors), even steps by gloo broadcast, this process
   being rank 0 of a private group that the engine's workers joined (InitWeightsUpdateGroup);
3. it rolls out a batch through vLLM's HTTP API with the openai client, plus a few long
   "straggler" rollouts that it does not wait for: they are still generating while the next
   step pushes new weights, as the long tail of an asynchronous RL loop does;
4. it keeps the rollouts generated entirely by `step-N` and drops the stale ones, those with
   any token from other weights (the stragglers of step N-1 among them).

How the loop knows which weights produced a rollout. Two ways were possible:

- Bracket a batch of OpenAI completions (which carry no version) with GetWeightVersion
  reads and drop the batch if the etag changed in between. Not exact: a successful update
  resumes the engine (in the same EngineCore round trip that stamps the new version) just
  before the server records the new version in its ledger (docs/architecture.md, "The
  update state machine", step 5), so a rollout can finish with tokens of the new weights
  while both reads still show the old etag. It also throws away a whole batch for one
  straggler.
- Read the engine's own label of every token. Each EngineCore stamps its current version on
  every step's output, and enginectl changes that label in the same round trip, between two
  forward passes, as it resumes generation after new weights are loaded (same step 5).
  vLLM's `/inference/v1/generate` returns the result per rollout as `weight_versions`:
  spans of output tokens with the version that produced them (docs/rollouts.md).

This loop uses the second: it posts to `/inference/v1/generate` with the openai client's
own HTTP machinery (the model name comes from `/v1/models`), and a rollout counts as
`step-N` only if one span labelled `step-N` covers all of its tokens. Every push declares
its version, so every token names the step whose weights produced it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from enginectl.client import EnginectlError, TrainerClient, UpdateResult

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "A reward model scores",
    "The weights were pushed",
]
NUDGE_SCALE = 0.02


@dataclass(frozen=True)
class Rollout:
    """One sampled completion and the versions that produced its tokens, in order."""

    token_ids: tuple[int, ...]
    spans: tuple[tuple[str, int, int], ...]  # (version, first token, end) from weight_versions

    def produced_by(self, version: str) -> bool:
        """Whether `version` produced every token (one span over the whole completion)."""
        return self.spans == ((version, 0, len(self.token_ids)),)

    @property
    def versions(self) -> str:
        return "->".join(v for v, _, _ in self.spans) or "unlabelled"


class Trainer:
    """Holds a copy of the served weights (checkpoint names -> CPU tensors) and "trains" them."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise SystemExit(f"no *.safetensors in {model_dir}: the trainer needs the served checkpoint")
        self.weights: dict[str, torch.Tensor] = {}
        for file in files:
            self.weights.update(load_file(str(file)))
        matrices = [n for n, t in self.weights.items() if t.dim() == 2]
        self.nudged = next((n for n in matrices if n.endswith("o_proj.weight")), matrices[0])
        self._generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        """Stand-in for an optimizer step: small seeded noise on one projection."""
        w = self.weights[self.nudged]
        noise = torch.randn(w.shape, generator=self._generator, dtype=torch.float32)
        w += (NUDGE_SCALE * noise).to(w.dtype)


class Rollouts:
    """Rollouts through vLLM's HTTP API with the openai client, on a thread pool."""

    def __init__(self, http: str, tokenizer: Tokenizer, workers: int) -> None:
        self.client = openai.OpenAI(
            base_url=f"http://{http}/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"), timeout=300.0
        )
        self.model = self.client.models.list().data[0].id
        # vLLM's token-in/token-out route lives next to /v1, not under it: an absolute URL.
        self.generate_url = f"http://{http}/inference/v1/generate"
        self.tokenizer = tokenizer
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")

    def start(self, prompt: str, max_tokens: int) -> Future[Rollout]:
        return self.pool.submit(self._generate, prompt, max_tokens)

    def _generate(self, prompt: str, max_tokens: int) -> Rollout:
        body = {
            "model": self.model,
            "token_ids": self.tokenizer.encode(prompt).ids,
            # Fixed lengths (ignore_eos) keep the stragglers long: the tiny model's text is noise.
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True},
        }
        answer: dict[str, Any] = self.client.post(self.generate_url, body=body, cast_to=dict)
        choice = answer["choices"][0]
        spans = tuple((s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or ())
        return Rollout(tuple(choice["token_ids"]), spans)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def push(t: TrainerClient, trainer: Trainer, step: int, group: str | None) -> tuple[str, float, UpdateResult]:
    """Push the trainer's weights as `step-N`: by gloo broadcast when a group is given, else
    over the gRPC tensor stream. Returns (how, seconds, result)."""
    version = f"step-{step}"
    started = time.monotonic()
    if group is not None:
        result = t.broadcast_weights(trainer.weights, version, group_name=group, timeout=120.0)
        how = "gloo"
    else:
        result = t.update_weights_from_tensors(trainer.weights, version, timeout=120.0)
        how = "tensor stream"
    return how, time.monotonic() - started, result


def tally(rollouts: list[Rollout], version: str) -> tuple[int, str]:
    """(rollouts `version` produced, a summary of the stale ones by the versions they span)."""
    kept = sum(r.produced_by(version) for r in rollouts)
    stale = Counter(r.versions for r in rollouts if not r.produced_by(version))
    detail = ", ".join(f"{n} under {v}" for v, n in sorted(stale.items()))
    return kept, f"{sum(stale.values())} stale dropped" + (f" ({detail})" if detail else "")


def run(args: argparse.Namespace, t: TrainerClient) -> None:
    info = t.get_server_info()
    model_dir = Path(info.model)
    if not model_dir.is_dir():
        raise SystemExit(f"the server serves {info.model!r}, not a local directory: run this on the server's host")
    trainer = Trainer(model_dir, args.seed)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    before = t.get_weight_version()
    print(
        f"server {args.grpc}: {info.model} ({info.num_workers} worker(s)); "
        f"serving {before.version if before.declared else 'an undeclared version'} (revision {before.revision}); "
        f"trainer nudges {trainer.nudged}",
        flush=True,
    )
    group = None
    if args.steps >= 2:  # even steps broadcast
        g = t.init_weights_update_group(f"rl-loop-{os.getpid()}", master_address=args.master_address)
        group = g.group_name
        print(f"gloo group {group}: trainer is rank 0 of {g.world_size}, engine workers joined", flush=True)
    rollouts = Rollouts(args.http, tokenizer, args.batch + args.stragglers)
    stragglers: list[Future[Rollout]] = []
    kept_total = dropped_total = 0
    try:
        for step in range(1, args.steps + 1):
            trainer.step()
            how, took, result = push(t, trainer, step, group if step % 2 == 0 else None)
            version = result.weight_version.version or ""
            batch = [rollouts.start(p, args.max_tokens) for p in prompts(args.batch)]
            late = stragglers  # started last step; they generated while this step pushed
            last = step == args.steps
            stragglers = [] if last else [rollouts.start(p, args.straggler_tokens) for p in prompts(args.stragglers)]
            done = [f.result() for f in batch + late]
            kept, stale = tally(done, version)
            kept_total, dropped_total = kept_total + kept, dropped_total + len(done) - kept
            print(
                f"step {step}: pushed {version} via {how} in {took:.2f}s "
                f"(revision {result.weight_version.revision}, {result.num_paused_requests} requests paused); "
                f"{kept} rollouts under {version}, {stale}",
                flush=True,
            )
    finally:
        rollouts.close()
        if group is not None:
            t.destroy_weights_update_group(group, allow_missing=True)
    now = t.get_weight_version()
    verdict = t.verify_weights().verdict
    print(
        f"done: {args.steps} steps, {kept_total} rollouts kept, {dropped_total} stale dropped; "
        f"server serves {now.version} (revision {now.revision}), VerifyWeights {verdict}",
        flush=True,
    )


def prompts(n: int) -> Iterator[str]:
    return (PROMPTS[i % len(PROMPTS)] for i in range(n))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", default="127.0.0.1:50051", help="enginectl's gRPC address (default %(default)s)")
    parser.add_argument("--http", default="127.0.0.1:8000", help="vLLM's HTTP address (default %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per step (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per rollout (default %(default)s)")
    parser.add_argument(
        "--stragglers", type=int, default=2, help="long rollouts per step left running (default %(default)s)"
    )
    parser.add_argument("--straggler-tokens", type=int, default=256, help="their length (default %(default)s)")
    parser.add_argument(
        "--master-address",
        default="127.0.0.1",
        help="address of this host that the engine's workers reach for the gloo group (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.stragglers < 0:
        parser.error("--steps and --batch must be at least 1, --stragglers at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with TrainerClient(args.grpc, token=os.environ.get("ENGINECTL_TOKEN"), timeout=120.0) as t:
            run(args, t)
    except EnginectlError as err:
        print(f"rl_loop: {err}", file=sys.stderr)
        return 1
    except openai.NotFoundError as err:
        print(f"rl_loop: {err.request.url} not found: start the server with --enable-scale-out", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
