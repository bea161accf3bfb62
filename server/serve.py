"""`enginectl serve`: one process with AsyncLLM, vLLM's HTTP API and the gRPC control plane.

Runs in the `enginectl serve` process (the API process of vLLM). vLLM's own engine and HTTP
flags pass through unchanged; with no model it serves the embedded default tiny Llama.

Shutdown on SIGTERM/SIGINT, in order: gRPC health flips to NOT_SERVING, watch streams end
with UNAVAILABLE, the gRPC server stops, the HTTP server stops, the engine stops, and every
child process is reaped. Exit code 0.

When the engine dies (an EngineCore killed or crashed), the moment vLLM's engine reports it:
the log says `engine_dead` with the cause, health turns NOT_SERVING, every RPC but health and
reflection answers UNAVAILABLE ENGINE_DEAD and open streams end with that reason; then the
same shutdown runs and the process exits with ENGINE_DEAD_EXIT_CODE within
ENGINE_DEAD_EXIT_BOUND_S, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil
import structlog

from enginectl.server.access import check_port_free
from enginectl.server.config import ServeConfig
from enginectl.server.cpu_binding import threads_bind_default
from enginectl.server.engine_processes import adopt_orphans, engine_ipc_dir, remove_engine_ipc_dir
from enginectl.server.flags import (
    configure_engine_args,
    configure_logging,
    parse_args,
    take_config,
)
from enginectl.server.http.routes import mount
from enginectl.server.wiring import (
    StartupError,
    before_engine,
    http_routes,
    rollout_service,
    start_control_plane,
    start_gateway,
)

if TYPE_CHECKING:
    import uvicorn

    from enginectl.server.engine import EngineAdapter
    from enginectl.server.gateway import GatewayRegistration
    from enginectl.server.grpc_server import ControlPlaneServer

log = structlog.get_logger("enginectl.serve")

STOP_GRACE_S = 5.0
REAP_TIMEOUT_S = 15.0
HTTP_START_TIMEOUT_S = 60.0
# After the engine died, the process has exited within this bound, counted from the death
# being noticed (milliseconds after it: EngineAdapter.on_death). The orderly shutdown takes a
# few seconds (STOP_GRACE_S at most for gRPC and for HTTP, ENGINE_DEAD_REAP_TIMEOUT_S per
# reaping step); should a step hang anyway, a backstop kills every child and exits
# ENGINE_DEAD_BACKSTOP_MARGIN_S before the bound.
ENGINE_DEAD_EXIT_BOUND_S = 30.0
ENGINE_DEAD_EXIT_CODE = 1
ENGINE_DEAD_REAP_TIMEOUT_S = 5.0
ENGINE_DEAD_BACKSTOP_MARGIN_S = 3.0


async def _http_started(server: uvicorn.Server, http: asyncio.Task[Any], stop: asyncio.Event) -> None:
    """Return once uvicorn accepts connections (or the HTTP task ended, or we are stopping):
    SERVING and the `serving` log line must not come before the HTTP API is up. uvicorn only
    exposes a `started` flag, so poll it, briefly."""
    deadline = time.monotonic() + HTTP_START_TIMEOUT_S
    while not server.started and not http.done() and not stop.is_set():
        if time.monotonic() > deadline:
            raise SystemExit("enginectl serve: vLLM's HTTP server did not start")
        await asyncio.sleep(0.005)


def _start_exit_backstop(exit_code: int) -> None:
    """Guarantee ENGINE_DEAD_EXIT_BOUND_S: if the orderly shutdown is still running just
    before it, kill every child process and exit at once with `exit_code`."""

    def force_exit() -> None:
        log.error("engine_dead_exit_forced", after_s=ENGINE_DEAD_EXIT_BOUND_S - ENGINE_DEAD_BACKSTOP_MARGIN_S)
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=ENGINE_DEAD_BACKSTOP_MARGIN_S / 2)
        remove_engine_ipc_dir()
        sys.stdout.flush()
        os._exit(exit_code)

    timer = threading.Timer(ENGINE_DEAD_EXIT_BOUND_S - ENGINE_DEAD_BACKSTOP_MARGIN_S, force_exit)
    timer.daemon = True
    timer.start()


async def _start_engine(args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> EngineAdapter:
    """Start vLLM's engine between a `starting engine` and an `engine ready` line. A KV-cache
    size chosen for the user (flags.parse_args) is announced first, and a start that fails
    with it names the flag that sets it."""
    from enginectl.server.engine import EngineAdapter

    kv_default = getattr(args, "kv_cache_default", None)
    if kv_default is not None:
        log.info("kv cache default", **kv_default.describe())
    threads_bind = threads_bind_default(args)
    if threads_bind is not None:
        log.info("cpu threads bind default", **threads_bind.describe())
    log.info("starting engine", model=args.model, dp_size=args.data_parallel_size)
    began = time.monotonic()
    try:
        engine = await asyncio.to_thread(EngineAdapter.start, args, loop)
    except Exception:
        if kv_default is not None:
            log.error(
                "engine start failed",
                kv_cache_memory_bytes=kv_default.bytes_per_worker,
                hint="the KV cache size above was a default: set --kv-cache-memory-bytes, or lower --max-model-len",
            )
        raise
    log.info("engine ready", took_s=round(time.monotonic() - began, 1))
    return engine


async def serve(args: argparse.Namespace, config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT (or the engine dies); returns the exit code. `args` holds
    vLLM's flags, `config` enginectl's (flags.take_config)."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    from enginectl.server.control_loop import ControlLoop

    grpc = config.grpc
    validate_parsed_serve_args(args)
    check_port_free(grpc.host, grpc.port)

    _, sock = setup_server(args, reuse_port=False)  # binds the HTTP port before the engine starts
    http_port = sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    before = before_engine(config, loop, stop)  # every EngineCore is told the relay's endpoint
    configure_engine_args(args, before.engine_config)
    if not adopt_orphans():
        log.warning("not_a_subreaper", effect="a worker orphaned by a dead EngineCore may outlive this process")
    engine = await _start_engine(args, loop)
    control = ControlLoop().start()
    plane: ControlPlaneServer | None = None

    def engine_died(cause: str) -> None:
        """On this loop, once, the moment vLLM's engine dies: flip the control plane now
        (it lives on the control loop), then shut down as on SIGTERM."""
        log.error(
            "engine_dead",
            cause=cause,
            action="shutting down",
            exit_code=ENGINE_DEAD_EXIT_CODE,
            exit_within_s=ENGINE_DEAD_EXIT_BOUND_S,
        )
        _start_exit_backstop(ENGINE_DEAD_EXIT_CODE)
        if plane is not None:  # else it is flipped as soon as it exists, below
            asyncio.run_coroutine_threadsafe(plane.engine_dead(cause), control.loop)
        stop.set()

    engine.on_death(engine_died)
    rollouts = rollout_service(config.rollouts, engine, loop)
    exit_code = 0
    try:
        try:
            started, bound = await control.run(start_control_plane(engine, config, before, rollouts))
        except StartupError as exc:
            raise SystemExit(f"enginectl serve: {exc}") from None
        plane = started  # engine_died (another thread's callback) reads `plane`
        if engine.death_cause is not None:  # it died while the plane was being built
            await control.run(started.engine_dead(engine.death_cause))

        client = engine.client
        log_config = get_uvicorn_log_config(args)
        app = build_app(args, await client.get_supported_tasks(), client.model_config)
        await init_app_state(client, app.state, args, await client.get_supported_tasks())
        # The RL routes (vLLM's, SGLang's, Dynamo's names) on this HTTP port, through the
        # control plane; in place of vLLM's dev routes of the same paths (docs/http_routes.md).
        replaced, kept = mount(
            app, http_routes(config, started, control.loop), keep_vllm_dev_routes=config.allow_vllm_dev_routes
        )
        if replaced:
            log.info("vllm_dev_routes_replaced", routes=replaced)
        if kept:
            log.warning("vllm_dev_routes_bypass_enginectl", routes=kept, effect="weights may change behind the ledger")
        uvicorn_kwargs: dict[str, Any] = {"log_config": log_config} if log_config is not None else {}
        http = asyncio.create_task(
            serve_http(
                app,
                sock=sock,
                enable_ssl_refresh=args.enable_ssl_refresh,
                host=args.host,
                port=http_port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count,
                **uvicorn_kwargs,
            )
        )
        # serve_http installs its own SIGTERM/SIGINT handlers (engine first, then HTTP) before
        # its first await; take them back so the control plane goes NOT_SERVING first.
        await asyncio.sleep(0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await _http_started(app.state.server, http, stop)
        await before.identity.wait_until_identified(
            http, grpc_host=grpc.host, grpc_port=bound, http_host=args.host, http_port=http_port, pid=os.getpid()
        )
        gateway: GatewayRegistration | None = None
        if not stop.is_set() and not http.done():
            await control.run(started.set_serving(True))
            log.info(
                "serving",
                grpc_host=grpc.host,
                grpc_port=bound,
                http_host=args.host,
                http_port=http_port,
                model=engine.info.model,
                served_model_name=engine.info.served_model_names[0],
                dp_size=engine.info.data_parallel_size,
                incarnation=started.ledger.incarnation,
                auth=grpc.token is not None,
                tls=grpc.tls is not None,
                pid=os.getpid(),
                worker_id=config.identity.worker_id,
                await_worker_id=config.identity.await_worker_id,
            )
            gateway = await control.run(
                start_gateway(config.gateway, started.ledger, token=grpc.token, grpc_port=bound, http_port=http_port)
            )

        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({stopping, http}, return_when=asyncio.FIRST_COMPLETED)
        if engine.death_cause is not None:
            exit_code = ENGINE_DEAD_EXIT_CODE
        elif http in done:  # the HTTP server ended by itself
            log.error("http server stopped; shutting down", engine_errored=engine.errored)
            exit_code = 1
        stopping.cancel()
        log.info("shutting down")
        if gateway is not None:  # first: SMG stops routing here while the engine still answers
            await control.run(gateway.stop())
        await control.run(started.stop(STOP_GRACE_S))
        if not http.done():
            app.state.server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(http), STOP_GRACE_S)
            except asyncio.TimeoutError:
                http.cancel()
        if http.done() and not http.cancelled():
            result = http.exception() or http.result()
            if inspect.iscoroutine(result):  # serve_http hands back a no-op shutdown coroutine
                await result
    finally:
        reap_timeout = REAP_TIMEOUT_S if engine.death_cause is None else ENGINE_DEAD_REAP_TIMEOUT_S
        await asyncio.to_thread(engine.shutdown, reap_timeout)
        await control.run(before.fpm.stop())
        control.stop()
        sock.close()
    exit_code = exit_code or before.identity.exit_code  # a failed sync with --await-worker-id
    log.info("stopped", exit_code=exit_code)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of `enginectl serve`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    args = parse_args(argv)
    config = take_config(args)
    configure_logging(config.log_json)
    with engine_ipc_dir():  # removed once every child is reaped
        if getattr(args, "headless", False):  # this node's EngineCores only (server/headless.py)
            from enginectl.server import headless

            return headless.run(args, config)
        import uvloop

        return uvloop.run(serve(args, config))
