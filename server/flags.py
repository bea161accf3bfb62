"""Every flag of `enginectl serve`: vLLM's, enginectl's, and what enginectl's mean.

Runs in the `enginectl serve` process, on the main thread, before anything starts. The one
module that defines an enginectl flag or reads one off the Namespace: `parse_args` parses
(with the embedded model's defaults), `take_config` checks enginectl's flags and turns them
into the typed values (server/config.py) that server/wiring.py and server/serve.py take, and
`configure_engine_args` sets the vLLM arguments enginectl needs. Also the token and TLS
files, logging, and a free gRPC port. Pure configuration, no state.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from enginectl.common.gateway import advertise_host
from enginectl.contract.engine import GLOO_TRANSFER_BACKEND
from enginectl.contract.engine_config import LOAD_CHECKS
from enginectl.server.access import TOKEN_ENV, security
from enginectl.server.config import (
    FpmRelayConfig,
    GatewayConfig,
    GrpcConfig,
    IdentityConfig,
    MultinodeConfig,
    RolloutConfig,
    ServeConfig,
    UpdateConfig,
)
from enginectl.server.errors import ControlPlaneError
from enginectl.server.fpm.identity import check_worker_id
from enginectl.server.fpm.relay import DEFAULT_QUEUE_LIMIT, DEFAULT_RING_SIZE
from enginectl.server.rollouts import SERVICE as ROLLOUT_SERVICE
from enginectl.server.weights.update.staging import DEFAULT_TTL_S

if TYPE_CHECKING:
    from enginectl.contract.engine_config import EngineConfig

log = structlog.get_logger("enginectl.fpm")  # the one warning here is about the FPM publisher

DEFAULT_GRPC_PORT = 50051
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_LIVENESS_TIMEOUT_S = 10.0
WORKER_EXTENSION = "enginectl.worker.weights.extension.EnginectlWorkerExtension"
SCHEDULER = "enginectl.worker.scheduler.make_scheduler"
# vLLM flags that suit the embedded tiny model on any machine; explicit flags still win.
DEFAULT_MODEL_FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory-bytes",
    str(64 * 1024 * 1024),
    "--max-num-seqs",
    "8",
    "--seed",
    "0",
    "--enforce-eager",
)


def build_parser() -> argparse.ArgumentParser:
    """vLLM's `serve` parser, plus the control plane's flags."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="enginectl serve",
            description="Serve a vLLM engine with its OpenAI-compatible HTTP API and the enginectl "
            "gRPC control plane, in one process. Every vLLM engine flag is accepted.",
        )
    )
    # vLLM's --grpc-port belongs to its Rust frontend, which enginectl does not start; the
    # flag is ours here, and is cleared before vLLM validates its arguments.
    for action in parser._actions:
        if "--grpc-port" in action.option_strings:
            action.default = DEFAULT_GRPC_PORT
            action.help = f"Port of the enginectl gRPC control plane (default {DEFAULT_GRPC_PORT}; 0 picks a free one)."
    parser.set_defaults(host="127.0.0.1", model=None)
    group = parser.add_argument_group("enginectl")
    group.add_argument(
        "--http-port",
        dest="port",
        type=int,
        default=argparse.SUPPRESS,
        help="Port of vLLM's HTTP API (alias of --port; default 8000; 0 picks a free one).",
    )
    group.add_argument(
        "--grpc-host", default="127.0.0.1", help="Address the gRPC control plane binds (default 127.0.0.1)."
    )
    group.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"File holding the bearer token required by mutating RPCs (or set ${TOKEN_ENV}).",
    )
    group.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve gRPC over TLS.")
    group.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert.")
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mTLS).",
    )
    group.add_argument(
        "--insecure", action="store_true", help="Allow a non-loopback gRPC address with neither token nor TLS."
    )
    group.add_argument(
        "--allow-vllm-dev-routes",
        action="store_true",
        help="With VLLM_SERVER_DEV_MODE=1, leave vLLM's dev routes that change weights behind the ledger "
        "(/collective_rpc, /sleep, /wake_up, /weight_checker, weight transfer) answering as vLLM's, for "
        "debugging and benchmarks: VerifyWeights then reports DRIFTED after such a change. /pause, /resume "
        "and the other RL names stay enginectl's (docs/http_routes.md).",
    )
    group.add_argument("--log-json", action="store_true", help="Log enginectl events as JSON lines.")
    group.add_argument(
        "--log-rpc-reads",
        action="store_true",
        help="Also log successful read RPCs (Get*, Watch*, health); mutations and failures are always logged.",
    )
    _add_fpm_relay_args(group)
    _add_identity_args(group)
    _add_weight_update_args(group)
    _add_multinode_args(group)
    _add_rollout_args(group)
    _add_gateway_args(group)
    return parser


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its error message
    return parse


def _add_fpm_relay_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--fpm-ring-size",
        type=_at_least(1),
        default=DEFAULT_RING_SIZE,
        help=f"Forward-pass metrics samples kept for resuming streams (default {DEFAULT_RING_SIZE}).",
    )
    group.add_argument(
        "--fpm-subscriber-queue",
        type=_at_least(2),
        default=DEFAULT_QUEUE_LIMIT,
        help="Samples queued per stream before it coalesces to the latest per "
        f"(worker_id, dp_rank) and counts the rest as missed (default {DEFAULT_QUEUE_LIMIT}).",
    )


def _add_identity_args(group: argparse._ArgumentGroup) -> None:
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--worker-id",
        default="",
        help="Worker identity stamped on every forward-pass metrics sample of every "
        "data-parallel rank, from the first one (1 to 256 bytes of UTF-8).",
    )
    mode.add_argument(
        "--await-worker-id",
        action="store_true",
        help="Start without a worker identity: gRPC health stays NOT_SERVING and no "
        "sample leaves the relay until FpmIdentityService.SetWorkerIdentity succeeds "
        "on every rank (for pre-warmed or snapshot-restored engines).",
    )
    group.add_argument(
        "--identity-sync-failure",
        choices=("exit", "retry"),
        default="exit",
        help="With --await-worker-id, what a failed SetWorkerIdentity does: exit "
        "(default: shut the engine down and exit non-zero) or retry (log it and "
        "wait for another SetWorkerIdentity; health stays NOT_SERVING until one succeeds).",
    )
    group.add_argument(
        "--fpm-heartbeat-interval",
        type=float,
        default=DEFAULT_HEARTBEAT_INTERVAL_S,
        metavar="SECONDS",
        help="Each rank sends a heartbeat sample after this long without a step "
        f"(default {DEFAULT_HEARTBEAT_INTERVAL_S}).",
    )


def _add_multinode_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--channel-address",
        default=None,
        metavar="ADDRESS",
        help="When ranks run on other nodes (--data-parallel-size-local below "
        "--data-parallel-size): the address of this head the FPM relay and every weight "
        "update's channels listen on for them (default: --data-parallel-address; never a "
        "loopback address then). docs/multinode.md.",
    )
    group.add_argument(
        "--liveness-timeout",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT_S,
        metavar="SECONDS",
        help="A rank on another node silent this long is a dead engine (the server exits "
        "non-zero); a headless node whose head is silent this long stops "
        f"(default {DEFAULT_LIVENESS_TIMEOUT_S}).",
    )


def _multinode_config(args: argparse.Namespace) -> MultinodeConfig:
    """Whether ranks may run on other nodes (by vLLM's DP flags), and where to listen for them."""
    timeout = float(args.liveness_timeout)
    if not timeout >= 3 * args.fpm_heartbeat_interval:
        raise SystemExit(
            "enginectl serve: --liveness-timeout must be at least 3 times --fpm-heartbeat-interval "
            "(a rank's heartbeats are what the head watches)"
        )
    size = int(getattr(args, "data_parallel_size", 1) or 1)
    local = getattr(args, "data_parallel_size_local", None)
    if local is None or int(local) >= size or getattr(args, "data_parallel_hybrid_lb", False):
        return MultinodeConfig(None, timeout)
    address = args.channel_address or getattr(args, "data_parallel_address", None)
    if not address:
        raise SystemExit(
            "enginectl serve: ranks on other nodes (--data-parallel-size-local below --data-parallel-size) "
            "need --data-parallel-address (or --channel-address): where they reach this head"
        )
    return MultinodeConfig(str(address), timeout)


def _add_weight_update_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--allow-weights-from",
        dest="allow_weights_from",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="A directory UpdateWeightsFromDisk may load from (repeatable). Real paths are "
        "checked, symlinks resolved. Default: the directory holding the served model.",
    )

    group.add_argument(
        "--max-staged-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="Largest set a stage_only update may hold, per worker (default: the served model's "
        "size). A bigger stage is refused with RESOURCE_EXHAUSTED before anything is received.",
    )
    group.add_argument(
        "--staged-weights-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        metavar="SECONDS",
        help=f"A staged set not committed or discarded within this long is dropped (default {DEFAULT_TTL_S:.0f}).",
    )
    group.add_argument(
        "--load-check",
        choices=LOAD_CHECKS,
        default="full",
        help="What every worker checks after a load, before generation resumes: 'full' (every layer "
        "computes finite values with the bytes the load wrote into it) or 'finite' (finite values "
        "only: for a model whose layers vLLM's reload processes in a way the full check does not "
        "know). Default full; docs/weights.md, 'The check after every load'.",
    )


def _add_rollout_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-grpc-rollouts",
        dest="grpc_rollouts",
        action="store_false",
        help=f"Do not serve vLLM's gRPC engine service ({ROLLOUT_SERVICE}: Generate, Abort, ...) on the "
        "control port (served by default when smg-grpc-servicer is installed).",
    )
    group.add_argument(
        "--token-guards-rollouts",
        action="store_true",
        help=f"Require the bearer token for every {ROLLOUT_SERVICE} RPC, generation and reads included "
        "(by default only its admin RPCs need it: generation is the data plane).",
    )


def _add_gateway_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--gateway",
        metavar="URL",
        default=None,
        help="Register with the SMG gateway at URL (e.g. http://10.0.0.5:30000; SMG runs with --enable-igw "
        "--enable-rl), keep its weight_version label current and deregister on shutdown. Serving never waits "
        "for the gateway: a down one is retried.",
    )
    group.add_argument(
        "--gateway-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="File holding the bearer token of SMG's control plane (its --control-plane-api-keys or --api-key), "
        "for registering and updating the worker.",
    )
    group.add_argument(
        "--gateway-advertise-host",
        metavar="HOST",
        default=None,
        help="The host SMG is told to reach this server on (grpc://HOST:GRPC_PORT, http://HOST:HTTP_PORT). "
        "Default: --grpc-host, or this machine's address when that is a wildcard.",
    )


def _gateway_config(args: argparse.Namespace) -> GatewayConfig | None:
    if args.gateway is None:
        if args.gateway_token_file is not None or args.gateway_advertise_host is not None:
            raise SystemExit("enginectl serve: --gateway-token-file and --gateway-advertise-host need --gateway")
        return None
    if not args.gateway.startswith(("http://", "https://")):
        raise SystemExit(f"enginectl serve: --gateway must be an http:// or https:// URL, got {args.gateway!r}")
    token = None
    if args.gateway_token_file is not None:
        try:
            token = args.gateway_token_file.read_text().strip()
        except OSError as exc:
            raise SystemExit(f"enginectl serve: --gateway-token-file: {exc}") from None
        if not token:
            raise SystemExit(f"enginectl serve: {args.gateway_token_file} is empty")
    host = args.gateway_advertise_host or advertise_host(args.grpc_host)
    return GatewayConfig(url=args.gateway, token=token, advertise_host=host)


def take_config(args: argparse.Namespace) -> ServeConfig:
    """Check enginectl's flags (SystemExit with the reason when one is wrong), read the token
    and TLS files, and take enginectl's flags off `args`: vLLM's --grpc-port is enginectl's
    here (build_parser) and is cleared, so vLLM does not validate it as its own."""
    token, tls = security(args)
    if args.worker_id:
        try:
            check_worker_id(args.worker_id)
        except ControlPlaneError as err:
            raise SystemExit(f"enginectl serve: --worker-id: {err.message}") from None
    if not args.fpm_heartbeat_interval > 0:
        raise SystemExit("enginectl serve: --fpm-heartbeat-interval must be more than 0")
    if args.max_staged_bytes is not None and args.max_staged_bytes < 0:
        raise SystemExit("enginectl serve: --max-staged-bytes must be >= 0")
    if args.staged_weights_ttl <= 0:
        raise SystemExit("enginectl serve: --staged-weights-ttl must be > 0")
    grpc_port, args.grpc_port = args.grpc_port, None
    return ServeConfig(
        grpc=GrpcConfig(args.grpc_host, grpc_port, token, tls, bool(args.log_rpc_reads)),
        fpm=FpmRelayConfig(args.fpm_ring_size, args.fpm_subscriber_queue),
        identity=IdentityConfig(
            worker_id=args.worker_id,
            await_worker_id=bool(args.await_worker_id),
            exit_on_failure=args.identity_sync_failure == "exit",
            heartbeat_interval_s=float(args.fpm_heartbeat_interval),
        ),
        updates=UpdateConfig(
            tuple(args.allow_weights_from), args.max_staged_bytes, args.staged_weights_ttl, args.load_check
        ),
        rollouts=RolloutConfig(
            enabled=bool(args.grpc_rollouts),
            token_guards=bool(args.token_guards_rollouts),
            log_requests=bool(getattr(args, "enable_log_requests", False)),
        ),
        log_json=bool(args.log_json),
        gateway=_gateway_config(args),
        allow_vllm_dev_routes=bool(args.allow_vllm_dev_routes),
        weight_transfer_backend=_transfer_backend(getattr(args, "weight_transfer_config", None)),
        multinode=_multinode_config(args),
    )


def _transfer_backend(config: object) -> str | None:
    """The backend of vLLM's --weight-transfer-config (its parser gives a WeightTransferConfig,
    or a dict), None without one."""
    if config is None:
        return None
    backend = config.get("backend", "nccl") if isinstance(config, dict) else getattr(config, "backend", "nccl")
    known = _transfer_backends()
    if backend not in known:
        # vLLM would fail each worker at load, after the engine's slow start: say it now.
        raise SystemExit(
            f"enginectl serve: --weight-transfer-config backend {backend!r} is not a weight-transfer engine "
            f"(known here: {', '.join(sorted(known))})"
        )
    return str(backend)


def _transfer_backends() -> set[str]:
    """The engines vLLM's factory knows (its built-ins, any a vLLM general plugin registers)
    and enginectl's own, which its worker extension registers in every worker."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return set(getattr(WeightTransferEngineFactory, "_registry", {})) | {GLOO_TRANSFER_BACKEND}


def configure_engine_args(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    """Before the engine starts: every worker gets enginectl's weight extension, every
    EngineCore enginectl's scheduler (unless the user named their own) and `engine_config`
    (relay endpoint, incarnation, worker id: values that change with every start or every
    worker), through the environment they inherit. Any `additional_config[CONFIG_KEY]` of the
    user's is taken out of `additional_config` (serve's flags decide those values): vLLM hashes
    `additional_config` into its compile-cache key, so leaving them there would make every
    start of a compiled model miss that cache."""
    from enginectl.contract.engine_config import CONFIG_KEY

    if not getattr(args, "worker_extension_cls", None):
        args.worker_extension_cls = WORKER_EXTENSION
    if args.scheduler_cls is None:
        args.scheduler_cls = SCHEDULER
    else:  # the user's own scheduler: it has neither the publisher nor the identity
        log.warning(
            "fpm_publisher_disabled",
            scheduler_cls=str(args.scheduler_cls),
            reason="--scheduler-cls is not enginectl's; SetWorkerIdentity will fail",
        )
    if isinstance(getattr(args, "additional_config", None), dict):
        args.additional_config.pop(CONFIG_KEY, None)
    engine_config.to_env()


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags of a start. With no model, the embedded one with DEFAULT_MODEL_FLAGS, served
    as SERVED_MODEL_NAME unless --served-model-name says otherwise. With the user's model on
    vLLM's CPU build and no memory flag, a KV-cache size that fits the machine;
    `args.kv_cache_default` says what was chosen (None if nothing was)."""
    from enginectl.server.default_model import (
        SERVED_MODEL_NAME,
        cpu_kv_cache_default,
        ensure_default_model,
        memory_flags_unset,
    )

    parser = build_parser()
    args = parser.parse_args(argv, namespace=memory_flags_unset())
    if args.model_tag:
        args.model = args.model_tag
    if args.model is None:
        model = ensure_default_model()
        name = [] if args.served_model_name else ["--served-model-name", SERVED_MODEL_NAME]
        args = parser.parse_args(["--model", str(model), *DEFAULT_MODEL_FLAGS, *name, *argv])
        args.kv_cache_default = None
    else:
        args.kv_cache_default = cpu_kv_cache_default(args, parser.get_default("gpu_memory_utilization"))
    return args


def configure_logging(json_lines: bool) -> None:
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        # One write per line (print() writes the newline separately, so a line of vLLM's or of
        # another thread could land in between and break the JSON line).
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
