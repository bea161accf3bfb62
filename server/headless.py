"""`enginectl serve --headless`: this node's EngineCores of an engine whose head runs elsewhere.

Runs as the whole `enginectl serve --headless` process, on its main thread (DESIGN §13,
docs/multinode.md). A head (`enginectl serve --data-parallel-size N --data-parallel-size-local L
--data-parallel-address HEAD --data-parallel-rpc-port P`) runs the API server, the control plane
and its local EngineCores; every other node runs this with the same model and engine flags plus
`--data-parallel-start-rank` (and its own `--data-parallel-size-local`). It is vLLM's headless
mode (`vllm serve --headless`, vllm/entrypoints/cli/serve.py `run_headless`) with what the head
needs of every rank: enginectl's scheduler on each EngineCore and enginectl's worker extension
on each worker (server/flags.py `configure_engine_args`), so every control call the head makes
reaches this node's ranks. It opens no gRPC or HTTP port.

The process owns its children: it is their subreaper (server/engine_processes.py), stops them
on SIGTERM/SIGINT and reaps every one before it exits; an EngineCore that dies ends the node
with a non-zero exit code, as an EngineCore's death ends `enginectl serve`.
"""

from __future__ import annotations

import argparse
import signal
import threading
from multiprocessing import connection
from types import FrameType
from typing import Any

import structlog

from enginectl.contract.engine_config import EngineConfig
from enginectl.server.config import ServeConfig
from enginectl.server.engine_processes import adopt_orphans, reap_children
from enginectl.server.flags import configure_engine_args

log = structlog.get_logger("enginectl.headless")

ENGINE_DEAD_EXIT_CODE = 1  # as server/serve.py's
REAP_TIMEOUT_S = 15.0


def refusal(args: argparse.Namespace) -> str | None:
    """Why these flags can not start a headless node (None: they can)."""
    if getattr(args, "data_parallel_hybrid_lb", False):
        return "--data-parallel-hybrid-lb runs an API server on every node: start each with `enginectl serve`"
    if getattr(args, "api_server_count", None) not in (None, 1):
        return "--api-server-count: a headless node runs no API server"
    if not args.data_parallel_address:
        return "--data-parallel-address HEAD is required: the head's address its EngineCores handshake with"
    return None


def run(args: argparse.Namespace, config: ServeConfig) -> int:
    """Start this node's EngineCores, wait until SIGTERM/SIGINT or one of them dies, stop and
    reap every child; returns the exit code."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    why = refusal(args)
    if why is not None:
        raise SystemExit(f"enginectl serve --headless: {why}")
    # The per-start values the head's EngineCores get (relay endpoint, incarnation, worker id)
    # are the head's; only what this node's flags say travels here.
    configure_engine_args(
        args,
        EngineConfig(
            load_check=config.updates.load_check,
            liveness_timeout_s=config.multinode.liveness_timeout_s,
            headless=True,
        ),
    )
    if not adopt_orphans():
        log.warning("not_a_subreaper", effect="a worker orphaned by a dead EngineCore may outlive this process")
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size_local <= 0:
        raise SystemExit("enginectl serve --headless: --data-parallel-size-local must be > 0")
    if parallel.node_rank_within_dp > 0:
        raise SystemExit(
            "enginectl serve --headless: ranks whose workers span nodes (--nnodes, multi-node TP/PP) are not supported"
        )
    head = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
    first = parallel.data_parallel_rank
    ranks = list(range(first, first + parallel.data_parallel_size_local))

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    log.info("starting engine", headless=True, model=args.model, dp_ranks=ranks, head=head)
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local,
        start_index=first,
        local_start_index=0,
        vllm_config=vllm_config,
        local_client=False,
        handshake_address=head,
        executor_class=Executor.get_class(vllm_config),
        log_stats=not engine_args.disable_log_stats,
    )
    exit_code = 0
    try:
        log.info("engine cores started", dp_ranks=ranks, pids=[p.pid for p in manager.processes])
        exit_code = _wait(manager.processes, stop)
    finally:
        log.info("shutting down", headless=True)
        manager.shutdown(timeout=REAP_TIMEOUT_S)
        reap_children(REAP_TIMEOUT_S)
    log.info("stopped", exit_code=exit_code)
    return exit_code


def _wait(processes: list[Any], stop: threading.Event) -> int:
    """Until `stop` or an EngineCore ends: 0, or ENGINE_DEAD_EXIT_CODE naming the one that died."""
    sentinels = {p.sentinel: p for p in processes}
    while not stop.is_set():
        ended = connection.wait(list(sentinels), timeout=0.5)
        if ended:
            proc = sentinels[ended[0]]
            log.error("engine_dead", cause=f"{proc.name} exited with {proc.exitcode}", exit_code=ENGINE_DEAD_EXIT_CODE)
            return ENGINE_DEAD_EXIT_CODE
    return 0
