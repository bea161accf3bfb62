"""FPM publish cost per scheduler step, relative to the step time (target: < 1%).

Two halves, one file:
- `phase(quick)` runs in the `python -m bench` process: it starts the worker below as a
  subprocess and turns its JSON result into a figure and a table.
- `python -m bench.fpm.publish` (the worker) runs a real vLLM engine on the embedded tiny
  model IN its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with enginectl's scheduler
  between timing layers (see `_timed_scheduler_class`), publishing to a real ZMQ SUB (the
  relay stand-in, counting what arrives). It drives rounds of batched generations and
  reports the median round:
    - engine-thread cost: the engine thread's CPU time the enginectl scheduler adds to a step
      (its `schedule` and `update_from_output` minus vLLM's own, minus the timing layer's own
      cost), over the step time (the sample's `wall_time`: start of scheduling to end of
      output processing);
    - publisher-thread cost: building, serializing and sending one sample, measured on the
      same samples, over the step time (off the engine thread, but it shares the GIL);
    - loss: samples made vs received by the SUB, and the drops reported in them.
The tiny model's steps are short (bench/README.md, figure 5, gives their length), so the ratios
are a worst case: a real model's steps are longer and the publish cost per step is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

TARGET_RATIO = 0.01  # publish cost / step time <


# -- orchestrator side (python -m bench) -----------------------------------------------------
def phase(quick: bool) -> dict[str, Any]:
    from bench.lib.procs import Worker

    worker = Worker(["--rounds", "3" if quick else "10"], module="bench.fpm.publish")
    try:
        return worker.expect("result", 600)
    finally:
        worker.finish()


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("fpm_publish")
    if not res:
        return []
    ratio = res["engine_thread_ratio"]
    return [
        {
            "figure": "FPM publish cost per scheduler step (engine thread)",
            "baseline": "step wall time",
            "baseline_value": res["step_ms_mean"],
            "enginectl_value": res["engine_thread_us_per_step"] / 1e3,
            "unit": "ms",
            "ratio": ratio,
            "target": f"< {TARGET_RATIO}",
            "met": ratio < TARGET_RATIO,
        }
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("fpm_publish")
    if not res:
        return []
    return [
        "",
        f"FPM publish cost ({res['steps']} non-empty steps, batches of {res['batch']} x "
        f"{res['max_tokens']} tokens, tiny model in-process; median round; engine-thread CPU time, "
        f"net of the timing layer's {res.get('timing_layer_us_per_step')} µs):",
        "",
        "| measure | per step | / step time |",
        "|---|---|---|",
        f"| step wall time (schedule to output processed) | {res['step_ms_mean']:.3f} ms | 1 |",
        f"| enginectl scheduler work on the engine thread | {res['engine_thread_us_per_step']:.1f} µs | "
        f"{res['engine_thread_ratio']:.4f} |",
        f"| build + serialize + send on the publisher thread | {res['publisher_us_per_sample']:.1f} µs | "
        f"{res['publisher_ratio']:.4f} |",
        f"| samples made / received / dropped | {res['samples_made']} / {res['samples_received']} / "
        f"{res['samples_dropped']} | |",
    ]


# -- worker side (python -m bench.fpm.publish) -------------------------------------------------
def _timing_layer(name: str, base: type, totals: dict[str, float]) -> type:
    """A subclass of `base` adding the engine thread's CPU time inside its `schedule` and
    `update_from_output` (super() included) to `totals[name]`. CPU time, not wall time: on a
    shared machine the thread is often descheduled, which inflates wall time at random."""

    class Layer(base):  # type: ignore[misc, valid-type]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return super().schedule(*args, **kwargs)
            finally:
                totals[name] += time.thread_time() - t0

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return super().update_from_output(*args, **kwargs)
            finally:
                totals[name] += time.thread_time() - t0

    Layer.__name__ = f"Timed_{name}"
    return Layer


def _timed_scheduler_class() -> tuple[type, dict[str, float]]:
    """enginectl's scheduler between timing layers: outer -> inner -> FpmScheduler -> vllm ->
    vLLM's Scheduler. (inner - vllm) is enginectl's work plus one layer's own cost, and
    (outer - inner) is one layer's own cost, so enginectl's work = (inner - vllm) - (outer - inner)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from enginectl.worker.fpm.scheduler import FpmScheduler

    totals = {"outer": 0.0, "inner": 0.0, "vllm": 0.0}
    timed_vllm = _timing_layer("vllm", Scheduler, totals)
    fpm = type("FpmOverTimedVllm", (FpmScheduler, timed_vllm), {})  # MRO: FpmScheduler -> vllm layer
    return _timing_layer("outer", _timing_layer("inner", fpm, totals), totals), totals


class Subscriber:
    """The relay stand-in: a real ZMQ SUB bound on `endpoint`. No reader thread: frames wait
    in ZMQ's buffer (C, no GIL) while the engine runs, and are read between rounds, so the
    bench itself does not compete with the engine thread the way an in-process reader would
    (the real relay runs in another process)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 1_000_000)
        self._sock.bind(endpoint)

    def take(self, count: int, timeout: float = 30.0) -> list[bytes]:
        """Up to `count` frames, waiting at most `timeout` for them to arrive."""
        frames: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(frames) < count and self._sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames.append(self._sock.recv())
        return frames

    def close(self) -> None:
        self._sock.close(linger=0)


def _publisher_cost(frames: list[bytes]) -> float:
    """Seconds per sample to build, serialize and send (to a socket nobody reads: PUB drops
    without subscribers, so this is the sender's cost alone) the received samples again."""
    import zmq

    from enginectl.contract.fpm import sample_frame
    from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
    from enginectl.worker.fpm.identity import IdentityState
    from enginectl.worker.fpm.load import QueuedLoad, ScheduledLoad
    from enginectl.worker.fpm.publisher import Sample, sample_proto

    samples = []
    for frame in frames:
        m = fpm_pb2.ForwardPassMetrics.FromString(frame)
        s, q = m.scheduled, m.queued
        samples.append(
            Sample(
                kind=m.kind,
                counter_id=m.counter_id,
                identity=IdentityState(m.worker_id, m.identity_generation),
                emit_time_ns=m.emit_time.ToNanoseconds(),
                wall_time=m.wall_time,
                idle=m.idle,
                scheduled=ScheduledLoad(
                    s.num_prefill_requests,
                    s.sum_prefill_tokens,
                    s.var_prefill_length,
                    s.sum_prefill_kv_tokens,
                    s.num_decode_requests,
                    s.sum_decode_kv_tokens,
                    s.var_decode_kv_tokens,
                ),
                queued=QueuedLoad(
                    q.num_prefill_requests,
                    q.sum_prefill_tokens,
                    q.var_prefill_length,
                    q.num_decode_requests,
                    q.sum_decode_kv_tokens,
                    q.var_decode_kv_tokens,
                ),
                kv_cache_usage=m.kv_cache_usage,
                num_running=m.num_running,
                num_waiting=m.num_waiting,
                dropped_since_last=m.dropped_since_last,
            )
        )
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.XPUB)
    sock.bind("inproc://fpm-publish-cost")
    t0 = time.perf_counter()
    for sample in samples:
        sock.send(sample_frame(sample_proto(sample, 0, "bench")), zmq.NOBLOCK)
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    return elapsed / max(1, len(samples))


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fpm.publish")
    parser.add_argument("--rounds", type=int, default=10, help="batches of generations (the median round is reported)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler runs here: its counters are ours
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    from vllm import LLM, SamplingParams

    from enginectl.contract.engine import wire
    from enginectl.contract.engine_config import CONFIG_KEY, EngineConfig
    from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
    from enginectl.server.default_model import ensure_default_model

    scheduler_cls, totals = _timed_scheduler_class()
    with tempfile.TemporaryDirectory(prefix="fpm-bench-") as tmp:
        endpoint = f"ipc://{tmp}/fpm.sock"
        sub = Subscriber(endpoint)
        llm = LLM(
            model=str(ensure_default_model()),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=64 * 1024 * 1024,
            max_num_seqs=args.batch,
            seed=0,
            scheduler_cls=scheduler_cls,
            additional_config={
                CONFIG_KEY: wire(
                    EngineConfig(
                        fpm_endpoint=endpoint, worker_id="bench", heartbeat_interval_s=3600.0, incarnation="bench"
                    )
                )
            },
        )
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 200 for j in range(8 + 4 * i)]} for i in range(args.batch)]
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        made_before = scheduler.fpm_publisher._counter
        sub.take(made_before)
        # Per round: the machine is shared, so report the median round, not a sum over bursts.
        # (enginectl's engine-thread CPU s, step wall s, steps, one timing layer's CPU s)
        rounds: list[tuple[float, float, int, float]] = []
        received: list[bytes] = []
        for _ in range(args.rounds):
            totals.update(outer=0.0, inner=0.0, vllm=0.0)
            first = scheduler.fpm_publisher._counter + 1
            llm.generate(prompts, params, use_tqdm=False)
            frames = sub.take(scheduler.fpm_publisher._counter - first + 1)
            received += frames
            steps_now = [
                m
                for m in map(fpm_pb2.ForwardPassMetrics.FromString, frames)
                if m.kind == fpm_pb2.SAMPLE_KIND_STEP and m.counter_id >= first
            ]
            layer = totals["outer"] - totals["inner"]
            rounds.append(
                (totals["inner"] - totals["vllm"] - layer, sum(m.wall_time for m in steps_now), len(steps_now), layer)
            )
        made = scheduler.fpm_publisher._counter - made_before
        sub.close()
        samples = [fpm_pb2.ForwardPassMetrics.FromString(f) for f in received]
        steps = [s for s in samples if s.kind == fpm_pb2.SAMPLE_KIND_STEP]
        median = sorted(rounds, key=lambda r: r[0] / r[1])[len(rounds) // 2]
        engine_thread_s, step_s, n_steps, layer_s = median
        per_sample_s = _publisher_cost(received)
        result = {
            "event": "result",
            "rounds": args.rounds,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "steps": len(steps),
            "step_ms_mean": round(step_s / n_steps * 1e3, 4),
            "engine_thread_us_per_step": round(engine_thread_s / n_steps * 1e6, 2),
            "engine_thread_ratio": round(engine_thread_s / step_s, 5),
            "engine_thread_ratio_per_round": [round(r[0] / r[1], 5) for r in rounds],
            "timing_layer_us_per_step": round(layer_s / n_steps * 1e6, 2),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "publisher_us_per_sample": round(per_sample_s * 1e6, 2),
            "publisher_ratio": round(per_sample_s * n_steps / step_s, 5),
            "samples_made": made,
            "samples_received": len(samples),
            "samples_dropped": sum(s.dropped_since_last for s in samples),
        }
        print(json.dumps(result), flush=True)
        scheduler.fpm_publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
