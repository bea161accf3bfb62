"""The vocabulary client and server share: error domain and reasons, field violations, and
where a weight version came from.

Pure Python (no gRPC, no torch): `enginectl.client` and `enginectl.server` both import it, so
neither imports the other. Values never change once released.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DOMAIN = "enginectl.dev"


class Reason:
    """Stable `ErrorInfo.reason` strings. Values never change once released."""

    # WeightVersionService
    VERSION_REQUIRED = "VERSION_REQUIRED"
    VERSION_TOO_LONG = "VERSION_TOO_LONG"
    VERSION_INVALID = "VERSION_INVALID"  # a control character (as WORKER_ID_INVALID)
    ETAG_MISMATCH = "ETAG_MISMATCH"
    REQUEST_ID_INVALID = "REQUEST_ID_INVALID"
    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"
    REVISION_COMPACTED = "REVISION_COMPACTED"
    REVISION_IN_FUTURE = "REVISION_IN_FUTURE"
    # Weight updates
    UPDATE_IN_PROGRESS = "UPDATE_IN_PROGRESS"
    PATH_INVALID = "PATH_INVALID"
    PATH_NOT_FOUND = "PATH_NOT_FOUND"
    TOO_MANY_TENSORS = "TOO_MANY_TENSORS"
    BUCKET_BYTES_INVALID = "BUCKET_BYTES_INVALID"
    TENSOR_SPEC_INVALID = "TENSOR_SPEC_INVALID"
    PAUSE_MODE_INVALID = "PAUSE_MODE_INVALID"
    PAUSE_TIMEOUT = "PAUSE_TIMEOUT"
    UPDATE_TIMEOUT = "UPDATE_TIMEOUT"
    UPDATE_CANCELLED = "UPDATE_CANCELLED"
    LOAD_FAILED = "LOAD_FAILED"
    STREAM_BROKEN = "STREAM_BROKEN"
    HEADER_REQUIRED = "HEADER_REQUIRED"
    CHUNK_TOO_LARGE = "CHUNK_TOO_LARGE"
    CHUNK_OUT_OF_ORDER = "CHUNK_OUT_OF_ORDER"
    DATA_SIZE_MISMATCH = "DATA_SIZE_MISMATCH"
    GROUP_NAME_INVALID = "GROUP_NAME_INVALID"
    MASTER_ADDRESS_INVALID = "MASTER_ADDRESS_INVALID"
    GROUP_SIZE_INVALID = "GROUP_SIZE_INVALID"
    GROUP_BACKEND_REQUIRED = "GROUP_BACKEND_REQUIRED"
    BACKEND_UNAVAILABLE = "BACKEND_UNAVAILABLE"
    GROUP_EXISTS = "GROUP_EXISTS"
    TOO_MANY_GROUPS = "TOO_MANY_GROUPS"
    GROUP_INIT_FAILED = "GROUP_INIT_FAILED"
    GROUP_IN_USE = "GROUP_IN_USE"
    GROUP_BROKEN = "GROUP_BROKEN"
    OPERATION_NAME_INVALID = "OPERATION_NAME_INVALID"
    OPERATION_NOT_FOUND = "OPERATION_NOT_FOUND"
    OPERATION_RUNNING = "OPERATION_RUNNING"
    PAGE_SIZE_INVALID = "PAGE_SIZE_INVALID"
    PAGE_TOKEN_INVALID = "PAGE_TOKEN_INVALID"
    PATH_NOT_ALLOWED = "PATH_NOT_ALLOWED"
    UNSUPPORTED_FORMAT = "UNSUPPORTED_FORMAT"
    NOT_A_REGULAR_FILE = "NOT_A_REGULAR_FILE"  # a FIFO, socket or device where a file must be
    TENSOR_MISMATCH = "TENSOR_MISMATCH"
    GROUP_NOT_FOUND = "GROUP_NOT_FOUND"
    GROUP_TIMEOUT = "GROUP_TIMEOUT"
    PARTIAL_UPDATE = "PARTIAL_UPDATE"
    # A worker can not read a disk update's files as the server planned it (missing on its node,
    # not a regular file, another header): refused before anything was touched (DESIGN §13).
    CHECKPOINT_NOT_ON_RANK = "CHECKPOINT_NOT_ON_RANK"
    # InitWeightsUpdateGroup: a loopback master_address while a rank runs on another host.
    MASTER_ADDRESS_LOOPBACK = "MASTER_ADDRESS_LOOPBACK"
    # UpdateWeightsFromIpc
    NOT_SAME_HOST = "NOT_SAME_HOST"  # the trainer is on another host (or the server can not tell)
    IPC_HANDLE_INVALID = "IPC_HANDLE_INVALID"  # a malformed handle, refused by the RPC
    IPC_HANDLE_UNAVAILABLE = "IPC_HANDLE_UNAVAILABLE"  # a worker could not map a handle
    # Two-phase updates (stage_only, CommitStagedWeights, DiscardStagedWeights)
    STAGED_WEIGHTS_EXIST = "STAGED_WEIGHTS_EXIST"  # one staged set per server
    STAGING_LIMIT_EXCEEDED = "STAGING_LIMIT_EXCEEDED"  # over --max-staged-bytes
    STAGED_NAME_INVALID = "STAGED_NAME_INVALID"
    STAGED_WEIGHTS_NOT_FOUND = "STAGED_WEIGHTS_NOT_FOUND"
    STAGED_WEIGHTS_EXPIRED = "STAGED_WEIGHTS_EXPIRED"
    STAGE_INCOMPLETE = "STAGE_INCOMPLETE"  # a commit of a set still being received
    STAGED_COMMITTING = "STAGED_COMMITTING"  # a discard of a set a commit is applying
    # Fleet.repair (client side, never sent by a server): a server holds nothing to repair it with
    NOT_REPAIRABLE = "NOT_REPAIRABLE"
    # FPM identity
    IDENTITY_SYNC_FAILED = "IDENTITY_SYNC_FAILED"
    IDENTITY_READ_FAILED = "IDENTITY_READ_FAILED"
    WORKER_ID_REQUIRED = "WORKER_ID_REQUIRED"
    WORKER_ID_TOO_LONG = "WORKER_ID_TOO_LONG"
    WORKER_ID_INVALID = "WORKER_ID_INVALID"
    TIMEOUT_INVALID = "TIMEOUT_INVALID"
    # FPM stream (ForwardPassMetricsService)
    FILTER_INVALID = "FILTER_INVALID"
    MAX_BATCH_SIZE_TOO_LARGE = "MAX_BATCH_SIZE_TOO_LARGE"
    SEQUENCE_EVICTED = "SEQUENCE_EVICTED"
    SEQUENCE_IN_FUTURE = "SEQUENCE_IN_FUTURE"
    INCARNATION_CHANGED = "INCARNATION_CHANGED"  # also WatchWeightVersion
    # Any RPC
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    ENGINE_DEAD = "ENGINE_DEAD"
    # A call into the engine's workers outlived its timeout; its late answer was dropped and the
    # engine goes on (docs/architecture.md, "Worker calls and their deadlines").
    WORKER_TIMEOUT = "WORKER_TIMEOUT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # HTTP RL routes (docs/http_routes.md)
    ROUTE_REFUSED = "ROUTE_REFUSED"  # a vLLM dev route that would go around enginectl
    LOAD_FORMAT_UNSUPPORTED = "LOAD_FORMAT_UNSUPPORTED"  # SGLang's load_format: safetensors only
    FLUSH_FAILED = "FLUSH_FAILED"  # vLLM's FlushCache answered success=false
    NOT_SERVING = "NOT_SERVING"  # a liveness probe while gRPC health is NOT_SERVING
    # vLLM's weight-transfer engines (docs/weights.md, "vLLM's weight-transfer engines")
    TRANSFER_NOT_CONFIGURED = "TRANSFER_NOT_CONFIGURED"  # served without --weight-transfer-config
    TRANSFER_INIT_INVALID = "TRANSFER_INIT_INVALID"  # the engine refused the init info
    TRANSFER_INIT_FAILED = "TRANSFER_INIT_FAILED"  # a worker could not connect
    TRANSFER_ALREADY_INITIALIZED = "TRANSFER_ALREADY_INITIALIZED"  # no longer sent: an init takes over
    TRANSFER_NOT_INITIALIZED = "TRANSFER_NOT_INITIALIZED"  # a round before any init
    TRANSFER_NOT_STARTED = "TRANSFER_NOT_STARTED"  # a batch or finish without an open round
    TRANSFER_STEP_TIMEOUT = "TRANSFER_STEP_TIMEOUT"  # the trainer's next step did not come in time
    TRANSFER_FAILED = "TRANSFER_FAILED"  # the engine failed a batch or the finish
    # After a load, a layer of the model computes NaN or infinity (docs/weights.md,
    # "Recovery after a partial update"): the weights are not served.
    WEIGHTS_NOT_FINITE = "WEIGHTS_NOT_FINITE"
    # After a load, a layer does not compute with what the load wrote into it (written only in
    # part, or its kernel built from other bytes; docs/weights.md, "The check after every
    # load"): the weights are not served.
    WEIGHTS_MISMATCH = "WEIGHTS_MISMATCH"
    STAGE_UNSUPPORTED = "STAGE_UNSUPPORTED"  # stage_only through an engine that can not stage


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field (`google.rpc.BadRequest.FieldViolation`)."""

    field: str
    description: str


class WeightSource(str, enum.Enum):
    """How the version in effect was declared."""

    UNSPECIFIED = "UNSPECIFIED"
    DECLARED = "DECLARED"
    DISK = "DISK"
    DISTRIBUTED = "DISTRIBUTED"
    TENSORS = "TENSORS"
    IPC = "IPC"
    TRANSFER_ENGINE = "TRANSFER_ENGINE"
