"""The request metrics of a forward-pass sample, computed from a vLLM scheduler's own state.

Runs inside each EngineCore process, on the engine thread (called by the FPM scheduler).
Field meanings are those of ScheduledRequestMetrics and QueuedRequestMetrics in
protos/enginectl/fpm/v1/forward_pass_metrics.proto (Dynamo's names). Variances are
population variances. Reads only attributes every vLLM `Request` has, so the functions take
any object with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol


class RequestLike(Protocol):
    """The attributes of vllm.v1.request.Request used here."""

    num_prompt_tokens: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


def _variance(n: int, total: int, squares: int) -> float:
    """Population variance from count, sum and sum of squares (exact integer sums; only the
    final division rounds). 0 for fewer than two values."""
    if n < 2:
        return 0.0
    return max(0.0, (n * squares - total * total) / (n * n))


class ScheduledLoad(NamedTuple):
    """ScheduledRequestMetrics of one step. (NamedTuples: cheap to build on the engine thread.)"""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedLoad(NamedTuple):
    """QueuedRequestMetrics of a waiting queue."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


def scheduled_load(num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, RequestLike]) -> ScheduledLoad:
    """The step just scheduled, read right after `Scheduler.schedule()` returned: by then
    vLLM has already advanced each request's `num_computed_tokens` by its scheduled tokens.

    A request is in prefill when its tokens computed before this step are fewer than its
    prompt; the prompt tokens computed this step are its chunk (capped at the prompt), and the
    tokens it had before (prefix-cache hits, earlier chunks) count as reused KV. A decode
    request's KV context is everything computed once this step ran.
    """
    # Plain local accumulators: this runs on the engine thread every step.
    n_prefill = prefill_tokens = prefill_kv = prompt_sum = prompt_squares = 0
    n_decode = decode_sum = decode_squares = 0
    for req_id, scheduled in num_scheduled_tokens.items():
        request = requests[req_id]
        after = request.num_computed_tokens
        before = after - scheduled
        prompt = request.num_prompt_tokens
        if before < prompt:
            n_prefill += 1
            prompt_sum += prompt
            prompt_squares += prompt * prompt
            prefill_tokens += min(scheduled, prompt - before)
            prefill_kv += before
        else:
            n_decode += 1
            decode_sum += after
            decode_squares += after * after
    return ScheduledLoad(
        n_prefill,
        prefill_tokens,
        _variance(n_prefill, prompt_sum, prompt_squares),
        prefill_kv,
        n_decode,
        decode_sum,
        _variance(n_decode, decode_sum, decode_squares),
    )


def queued_load(*queues: Iterable[RequestLike]) -> QueuedLoad:
    """The waiting requests of `queues`: those that never started (prompt length), and those
    preempted after generating (KV context = prompt plus output so far). Raw counts:
    prefix-cache hits are unknown until a request is scheduled."""
    n_new = new_sum = new_squares = n_preempted = kv_sum = kv_squares = 0
    for queue in queues:
        for request in queue:
            if request.num_output_tokens > 0:
                tokens = request.num_tokens
                n_preempted += 1
                kv_sum += tokens
                kv_squares += tokens * tokens
            else:
                prompt = request.num_prompt_tokens
                n_new += 1
                new_sum += prompt
                new_squares += prompt * prompt
    if not n_new and not n_preempted:
        return EMPTY_QUEUE
    return QueuedLoad(
        n_new,
        new_sum,
        _variance(n_new, new_sum, new_squares),
        n_preempted,
        kv_sum,
        _variance(n_preempted, kv_sum, kv_squares),
    )


EMPTY_QUEUE = QueuedLoad()
NO_STEP = ScheduledLoad()
