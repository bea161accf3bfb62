"""Every bound the server puts on its inputs, in one table.

Runs in the `enginectl serve` process. Pure: no gRPC, no vLLM.

The values are the ones the protos document (ServerLimits in weight_update_service.proto,
the field comments of every request) and that GetServerInfo.limits reports; docs/operations.md
"Limits" lists them. A request over a bound is refused with INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED for server-wide counts) and a stable reason before anything changes.
"""

from __future__ import annotations

from typing import Final

# The label rule (versions, worker ids) lives with the EngineCore code that checks it too.
from enginectl.common.labels import MAX_WORKER_ID_BYTES as MAX_WORKER_ID_BYTES
from enginectl.common.labels import LabelProblem as LabelProblem
from enginectl.common.labels import label_problem as label_problem

# --- strings (bytes of UTF-8) --------------------------------------------------------------

# A weight version: 1..256 bytes, no control characters (VERSION_REQUIRED / VERSION_TOO_LONG /
# VERSION_INVALID). It ends up in logs, metric labels, gRPC metadata and vLLM outputs.
MAX_VERSION_BYTES: Final = 256
# A request_id: a UUID (REQUEST_ID_INVALID). uuid.UUID also takes braces, "urn:uuid:" and any
# number of hyphens, so the text is bounded too (canonical form: 36, URN form: 45).
MAX_REQUEST_ID_BYTES: Final = 64
# A worker id (SetWorkerIdentity, `--worker-id`, FPM stream filters): 1..256 bytes, no
# control characters (WORKER_ID_REQUIRED / WORKER_ID_TOO_LONG / WORKER_ID_INVALID). Defined
# with the label rule in common/labels.py, which the EngineCores check it with too.
# A TensorSpec name (TENSOR_SPEC_INVALID).
MAX_TENSOR_NAME_BYTES: Final = 1024
# An update group name, 1..128 bytes of [A-Za-z0-9._-] (GROUP_NAME_INVALID).
MAX_GROUP_NAME_BYTES: Final = 128
# InitWeightsUpdateGroup.master_address: a DNS name's limit (MASTER_ADDRESS_INVALID).
MAX_MASTER_ADDRESS_BYTES: Final = 253
# UpdateWeightsFromDisk.path: PATH_MAX on Linux (PATH_INVALID).
MAX_PATH_BYTES: Final = 4096

# --- files read by disk updates --------------------------------------------------------------

# A safetensors JSON header (UNSUPPORTED_FORMAT beyond): the format's own limit is 100 MB.
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
# A `*.safetensors.index.json` (UNSUPPORTED_FORMAT beyond); real ones are well under 10 MiB.
MAX_INDEX_BYTES: Final = 64 * 1024 * 1024

# --- counts ---------------------------------------------------------------------------------

# Tensors in one update (TOO_MANY_TENSORS); a 384-expert MoE checkpoint with scales has ~150k.
MAX_TENSORS: Final = 262_144
# BadRequest field violations listed in one TENSOR_MISMATCH error (the rest are counted).
MAX_VIOLATIONS: Final = 100
# Update groups existing at once on one server (RESOURCE_EXHAUSTED TOO_MANY_GROUPS).
MAX_GROUPS: Final = 8
# Entries of each FPM stream filter list, worker_ids and dp_ranks (FILTER_INVALID).
MAX_FILTER_ENTRIES: Final = 1_024
# Samples in one FPM batch (MAX_BATCH_SIZE_TOO_LARGE), and the batch size when unset.
MAX_BATCH_SIZE: Final = 10_000
DEFAULT_BATCH_SIZE: Final = 1_000
# Finished update Operations kept readable, and the largest ListOperations page.
MAX_RETAINED: Final = 64
MAX_PAGE_SIZE: Final = 100
# The FPM ring (`--fpm-ring-size`) and each subscriber's queue (`--fpm-subscriber-queue`,
# beyond it the queue coalesces and counts `missed`) live in fpm/relay.py: operator flags,
# not request inputs.

# --- sizes ----------------------------------------------------------------------------------

# Dimensions of one tensor, and its elements in all (TENSOR_SPEC_INVALID).
MAX_SHAPE_RANK: Final = 8
MAX_TENSOR_ELEMENTS: Final = 1 << 40
# TensorStreamChunk.data (CHUNK_TOO_LARGE); 1-4 MiB chunks stream fastest.
MAX_CHUNK_BYTES: Final = 4 * 1024 * 1024
# A CUDA IPC memory or event handle of UpdateWeightsFromIpc (IPC_HANDLE_INVALID); torch's are
# 64 bytes, or a little more with expandable segments.
MAX_IPC_HANDLE_BYTES: Final = 1024
# Any request or response message on the wire (gRPC refuses larger with RESOURCE_EXHAUSTED):
# bounds the tensor list of UpdateWeightsFromDistributed and of a stream header.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024

# --- process groups -------------------------------------------------------------------------

# InitWeightsUpdateGroup: world_size at most this; rank_offset at least 1 (the trainer is rank
# 0) and at most world_size - num_workers (GROUP_SIZE_INVALID); master_port 1..65535.
MAX_WORLD_SIZE: Final = 65_536
MIN_RANK_OFFSET: Final = 1
MAX_PORT: Final = 65_535

# --- timeouts (seconds; every timeout field must be in (0, max], TIMEOUT_INVALID otherwise) --

# Weight updates, group rendezvous and PauseGeneration.wait_timeout.
DEFAULT_TIMEOUT_S: Final = 600.0
# InitWeightsUpdateGroup's rendezvous: the engine answers nothing else while its workers wait
# for the other members, so its bound is shorter (TIMEOUT_INVALID beyond the max).
DEFAULT_GROUP_TIMEOUT_S: Final = 60.0
MAX_GROUP_TIMEOUT_S: Final = 600.0
MAX_TIMEOUT_S: Final = 24 * 3600.0
# Beyond an update's own timeout, how long the workers get to report back (not a request field).
RPC_GRACE_S: Final = 30.0
# SetWorkerIdentity / GetWorkerIdentity: defaults when unset, and the bound of both.
DEFAULT_SET_IDENTITY_TIMEOUT_S: Final = 10.0
DEFAULT_GET_IDENTITY_TIMEOUT_S: Final = 5.0
MAX_IDENTITY_TIMEOUT_S: Final = 300.0
# WaitOperation without a timeout waits this long (AIP-151: then returns the Operation as it
# is); the call's own deadline bounds it too.
DEFAULT_WAIT_OPERATION_S: Final = 3600.0


# --- error statuses ---------------------------------------------------------------------------

# An error travels in gRPC's trailers, which clients refuse beyond 8 KiB (a soft limit that
# fails at random up to 16 KiB): the message twice (grpc-message, percent-encoded, up to 3x;
# and inside the Status) and the Status in base64 (4/3x). With these bounds the whole stays
# under ~6.5 KiB. Longer texts are clipped; violations past the budget are counted instead.
MAX_ERROR_MESSAGE_BYTES: Final = 512
MAX_ERROR_METADATA_VALUE_BYTES: Final = 256
MAX_ERROR_STATUS_BYTES: Final = 3_072  # the serialized google.rpc.Status
