"""The contract between the `enginectl serve` process and the code it runs inside vLLM.

Torch-free and gRPC-free: imported by the server (server/engine.py, the only caller) and by
the engine side (worker/), so both sides name the same things the same way. It holds:

- every name the server calls: vLLM's own EngineCore utilities it uses, enginectl's
  EngineCore utilities (attached to vLLM's EngineCore class) and enginectl's worker RPCs
  (methods of the worker extension, reached through `collective_rpc`);
- a typed struct for what each one takes and returns. On the wire they are plain msgpack
  maps and lists (vLLM serialises utility arguments and results itself): `wire()` turns a
  struct into builtins on the sending side, `read()` turns builtins back into the struct,
  checking every field, on the receiving side;
- the failure causes the engine side reports.

The per-start engine configuration is next door, in contract/engine_config.py.

ZMQ frame layouts live next door (contract/frames.py for weight updates, contract/fpm.py for
metrics samples); the dtype table is common/dtypes.py.
docs/architecture.md ("The engine contract") shows who calls what, and on which thread.
"""

from __future__ import annotations

import enum
from typing import Any, Final, TypeVar

import msgspec

from enginectl.common import gloo_transfer
from enginectl.common.vocabulary import Reason, WeightSource

T = TypeVar("T")


def wire(value: msgspec.Struct) -> Any:
    """`value` as msgpack-able builtins (a map, or a list for array-like structs)."""
    return msgspec.to_builtins(value)


def read(kind: type[T], value: Any) -> T:
    """The struct `kind` from builtins received from the other side (checked field by field)."""
    return msgspec.convert(value, kind)


# --- names ---------------------------------------------------------------------------------

# The weight-version label vLLM stamps on generated tokens (RequestOutput.weight_versions)
# while the server declares no version: at start (instead of vLLM's own "default", which a
# caller may declare), after an update that named no version and after one that failed part
# way. The ledger refuses an empty version, so this label never means a declared one.
UNDECLARED_LABEL: Final = ""


class VllmUtility(str, enum.Enum):
    """vLLM's own EngineCore utilities the server calls on every rank."""

    PAUSE_SCHEDULER = "pause_scheduler"
    RESUME_SCHEDULER = "resume_scheduler"
    IS_SCHEDULER_PAUSED = "is_scheduler_paused"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    SET_WEIGHT_VERSION = "set_weight_version"
    COLLECTIVE_RPC = "collective_rpc"


class Utility(str, enum.Enum):
    """enginectl's EngineCore utilities (defined in worker/engine_core.py and
    worker/fpm/engine_core.py, attached to vLLM's EngineCore by worker/attach.py `attach()`);
    they run on the engine thread, between steps."""

    GENERATION_STATE = "enginectl_generation_state"
    # Pause (vLLM's pause_scheduler) or resume, answering the rank's state from just before:
    # PauseGeneration and ResumeGeneration in one round trip per rank.
    PAUSE = "enginectl_pause"
    RESUME = "enginectl_resume"
    # Say who holds the pause in effect (a PauseReason) without touching the scheduler: what
    # the rank's FPM samples report (docs/fpm.md).
    HOLD = "enginectl_hold"
    FINISH_UPDATE = "enginectl_finish_update"
    SET_WORKER_IDENTITY = "enginectl_set_worker_identity"
    GET_WORKER_IDENTITY = "enginectl_get_worker_identity"
    # A worker RPC (WorkerRpc) on every worker of the rank, bounded: answers a WorkerCall. vLLM
    # pairs workers' answers with calls by order, so an answer that comes after its call's
    # timeout would be read as the next model step's output; this call drains it instead, or
    # stops the rank's executor and says so (worker/engine_core.py, docs/architecture.md
    # "Worker calls and their deadlines").
    WORKER_CALL = "enginectl_worker_call"
    # The start-up census: what runs on this rank, where (a RankCensus; server/census.py).
    CENSUS = "enginectl_census"
    # This start's EngineConfig, to every rank after the census (contract/engine_config.py):
    # answers a RankConfigured.
    CONFIGURE = "enginectl_configure"


class WorkerRpc(str, enum.Enum):
    """Methods of enginectl's worker extension (worker/weights/extension.py), called on every
    worker through vLLM's `collective_rpc`, on the worker's RPC thread."""

    LOAD = "enginectl_load"
    # Joining a group runs on a thread of the worker (a rendezvous can outlast any bound):
    # INIT_GROUP starts it and answers at once, GROUP_JOIN_STATE reads how it stands.
    INIT_GROUP = "enginectl_init_group"
    GROUP_JOIN_STATE = "enginectl_group_join_state"
    DESTROY_GROUP = "enginectl_destroy_group"
    FINGERPRINT = "enginectl_fingerprint"
    DECLARE_FINGERPRINT = "enginectl_declare_fingerprint"
    FULL_DIGEST = "enginectl_full_digest"
    # Two-phase updates (worker/weights/staging.py): start staging on a background thread,
    # read how it ended, drop a staged set.
    STAGE = "enginectl_stage"
    STAGE_RESULT = "enginectl_stage_result"
    DISCARD_STAGED = "enginectl_discard_staged"
    # vLLM's weight-transfer engine (the worker's own four-step methods), one step per call.
    TRANSFER = "enginectl_transfer"
    # After a load, before generation resumes: every layer computes finite values; after a
    # partial update, the KV cache is zeroed too (worker/weights/checks.py).
    CHECK_LOADED = "enginectl_check_loaded"
    # The start-up census of one worker (a WorkerCensus), asked by its EngineCore's CENSUS.
    CENSUS = "enginectl_census"
    # Before an update writes anything: every worker opens every file the update will read and
    # compares its safetensors header with the one the server planned from (worker/weights/
    # prepare.py); answers a Prepared (contract/prepare.py). Header reads only: milliseconds.
    PREPARE = "enginectl_prepare"


# enginectl's weight-transfer engine, in vLLM's factory (worker/weights/transfer/engine.py).
GLOO_TRANSFER_BACKEND: Final = gloo_transfer.GLOO_TRANSFER_BACKEND  # common/gloo_transfer.py: one definition


class TransferStep(str, enum.Enum):
    """A step of vLLM's weight-transfer API, run by WorkerRpc.TRANSFER on every worker."""

    INIT = "init"  # init_weight_transfer_engine(payload)
    START = "start"  # start_weight_update(); payload: a stage token, for a round that stages
    UPDATE = "update"  # update_weights(payload)
    FINISH = "finish"  # finish_weight_update()
    ABORT = "abort"  # end an open round without finishing it (enginectl's, not vLLM's)
    SHUTDOWN = "shutdown"  # shutdown_weight_transfer_engine()


class TransferAnswer(msgspec.Struct, frozen=True):
    """A worker's answer to one TRANSFER step: empty `error` when it ran; `invalid` when the
    engine refused its arguments before doing anything (vLLM's parse_*_info: ValueError)."""

    dp_rank: int
    worker_rank: int
    error: str = ""
    invalid: bool = False
    seconds: float = 0.0


# --- failure causes ------------------------------------------------------------------------


class Cause(str, enum.Enum):
    """Why the engine side stopped an update (the operation's error reason; a partial update
    carries it in its metadata). Each value is the public API's Reason of that name
    (common/vocabulary.py), not a copy of it: the reasons an update can fail with."""

    UPDATE_TIMEOUT = Reason.UPDATE_TIMEOUT
    GROUP_TIMEOUT = Reason.GROUP_TIMEOUT
    UPDATE_CANCELLED = Reason.UPDATE_CANCELLED
    STREAM_BROKEN = Reason.STREAM_BROKEN
    DATA_SIZE_MISMATCH = Reason.DATA_SIZE_MISMATCH
    CHUNK_OUT_OF_ORDER = Reason.CHUNK_OUT_OF_ORDER
    CHUNK_TOO_LARGE = Reason.CHUNK_TOO_LARGE
    HEADER_REQUIRED = Reason.HEADER_REQUIRED
    GROUP_NOT_FOUND = Reason.GROUP_NOT_FOUND
    GROUP_BROKEN = Reason.GROUP_BROKEN
    ENGINE_DEAD = Reason.ENGINE_DEAD
    ETAG_MISMATCH = Reason.ETAG_MISMATCH
    LOAD_FAILED = Reason.LOAD_FAILED
    IPC_HANDLE_UNAVAILABLE = Reason.IPC_HANDLE_UNAVAILABLE  # a worker could not map a handle
    WORKER_TIMEOUT = Reason.WORKER_TIMEOUT  # a worker RPC outlived its timeout (its answer was dropped)
    TRANSFER_STEP_TIMEOUT = Reason.TRANSFER_STEP_TIMEOUT  # the trainer's next step did not come
    TRANSFER_FAILED = Reason.TRANSFER_FAILED  # a transfer engine failed a batch or the finish
    WEIGHTS_NOT_FINITE = Reason.WEIGHTS_NOT_FINITE  # a layer computes NaN or infinity after the load
    WEIGHTS_MISMATCH = Reason.WEIGHTS_MISMATCH  # a layer does not compute with what the load wrote


class RankFailure(str, enum.Enum):
    """Why one rank gave no answer to a per-rank call (server/engine.py `_call_each`)."""

    RANK_TIMEOUT = "RANK_TIMEOUT"
    RANK_ERROR = "RANK_ERROR"
    ENGINE_DEAD = "ENGINE_DEAD"


# --- generation state (Utility.GENERATION_STATE, FINISH_UPDATE) ----------------------------


class PauseReason(str, enum.Enum):
    """Who holds a rank's pause: the names and meanings of enginectl.weights.v1.PauseReason.
    The server passes it with Utility.PAUSE and HOLD; a pause made any other way (vLLM's own
    API) is EXTERNAL. The rank's FPM samples report it (worker/fpm/generation.py)."""

    CALLER = "CALLER"
    UPDATE = "UPDATE"
    PARTIAL_UPDATE = "PARTIAL_UPDATE"
    EXTERNAL = "EXTERNAL"


class RankGenerationState(msgspec.Struct, frozen=True):
    """One DP rank's pause state and request counts, read between two steps."""

    dp_rank: int
    paused: bool
    running: int = 0
    waiting: int = 0


class FinishUpdate(msgspec.Struct, frozen=True):
    """The end of a successful update in one round trip per rank: reset the prefix cache,
    fingerprint the weights (the workers keep the full digest under `fingerprint_token`; ""
    for none), stamp `version` on outputs (None: leave it), resume generation."""

    reset_cache: bool
    fingerprint_token: str
    version: str | None
    resume: bool


# --- loading (WorkerRpc.LOAD) ----------------------------------------------------------------


class Source(str, enum.Enum):
    """What a worker loads from (LoadPlan.source; these lower-case values are what the wire
    carries). Not common/vocabulary.py's WeightSource, which says how the version in effect
    was declared (DECLARED, UNSPECIFIED) and has no STAGED: an update of WeightSource X loads
    from Source X (`of`, the one mapping between them), a commit from STAGED."""

    DISK = "disk"
    TENSORS = "tensors"
    DISTRIBUTED = "distributed"
    IPC = "ipc"
    STAGED = "staged"  # a commit: the tensors staged under LoadPlan.stage_token

    @classmethod
    def of(cls, source: WeightSource) -> Source:
        """What the workers of an update of `source` load from (KeyError for DECLARED and
        UNSPECIFIED, which no update has)."""
        return cls[source.name]


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor to load: its checkpoint name, dtype name (common/dtypes.py) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


# The name torch gives a POSIX shared-memory segment (at::NewProcessWideShmHandle): the only
# names an IPC update may map, so a handle can name no other object under /dev/shm.
SHM_SEGMENT_PATTERN: Final = r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}"


class CudaShare(msgspec.Struct, frozen=True, array_like=True):
    """One `UntypedStorage._share_cuda_()` result, as torch returns it, for one worker."""

    device: int
    memory_handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor of an IPC update lives in the trainer's memory: a storage torch
    shared (a CPU shared-memory `segment` of `storage_nbytes`, or `cuda`: one share per
    worker, in global worker order) and the tensor's place in it, in elements."""

    storage_offset: int
    stride: tuple[int, ...]
    segment: str = ""
    storage_nbytes: int = 0
    cuda: tuple[CudaShare, ...] = ()


class WorkerLayout(msgspec.Struct, frozen=True, array_like=True):
    """How an engine's workers are laid out: `ranks` DP ranks of `workers_per_rank` workers
    each (vLLM's parallel world size, TP x PP). A worker's index among all workers is
    `dp_rank * workers_per_rank + worker_rank` (worker/weights/ranks.py `global_rank`): an
    update's data channels are addressed by it, one per worker, because with tensor
    parallelism every worker of a rank loads every tensor (docs/architecture.md, "Update
    channels")."""

    ranks: int
    workers_per_rank: int = 1
    # The first DP rank this server manages: 0, or under hybrid / external load balancing the
    # node's `--data-parallel-start-rank` (docs/multinode.md, "One server per node").
    first_rank: int = 0

    @property
    def workers(self) -> int:
        return self.ranks * self.workers_per_rank

    @property
    def dp_ranks(self) -> range:
        """The DP ranks this server manages, by their engine-wide numbers."""
        return range(self.first_rank, self.first_rank + self.ranks)

    @property
    def first_worker(self) -> int:
        """The engine-wide index (worker/weights/ranks.py `global_rank`) of the first worker."""
        return self.first_rank * self.workers_per_rank

    def index(self, dp_rank: int, worker_rank: int) -> int:
        """The worker's index among this server's workers, rank by rank."""
        if dp_rank not in self.dp_ranks or not 0 <= worker_rank < self.workers_per_rank:
            raise ValueError(
                f"no worker {worker_rank} of DP rank {dp_rank} in ranks {self.first_rank}.."
                f"{self.first_rank + self.ranks - 1} x {self.workers_per_rank}"
            )
        return (dp_rank - self.first_rank) * self.workers_per_rank + worker_rank


class LoadPlan(msgspec.Struct, frozen=True):
    """What one update asks of every worker."""

    source: Source
    files: tuple[str, ...]  # DISK: the safetensors files, in order
    tensors: tuple[TensorSpec, ...]  # every tensor, in the order they arrive
    group: str  # DISTRIBUTED: the update group
    # One per worker, indexed by WorkerLayout.index: stream chunks and abort frames (frames.py).
    data_endpoints: tuple[str, ...]
    progress_endpoint: str  # every worker on the server's host reports progress here
    # The update's time left when the plan was sent: each worker counts it down on its own
    # monotonic clock (a wall-clock deadline means nothing on another host's clock).
    timeout_s: float
    # DISTRIBUTED: 0 broadcasts each tensor on its own; otherwise consecutive tensors are
    # packed into flat buffers of at most this many bytes, one broadcast per bucket
    # (common/buckets.py; a tensor larger than a bucket goes alone, unflattened).
    bucket_bytes: int = 0
    # IPC: one handle per tensor, in `tensors` order (worker/weights/ipc.py maps them).
    handles: tuple[IpcHandle, ...] = ()
    # STAGE: the token the staged set is kept under; LOAD of Source.STAGED: the set to load.
    stage_token: str = ""
    # Every message on the channels begins with it (contract/frames.py; b"": no key).
    key: bytes = b""
    # Where a worker whose data endpoint is a tcp:// one (a rank on another host) reports.
    progress_tcp_endpoint: str = ""
    # WorkerLayout.first_worker: a worker's data endpoint is `data_endpoints[global index -
    # first_worker]` (the server lists only the workers of the ranks it manages).
    first_worker: int = 0


class LoadError(msgspec.Struct, frozen=True, array_like=True):
    cause: Cause
    message: str


class LoadResult(msgspec.Struct, frozen=True):
    """One worker's answer to LOAD (it never raises: a failure is `error`)."""

    dp_rank: int
    worker_rank: int
    tensors_loaded: int
    bytes_loaded: int
    weights_modified: bool  # a tensor was handed to vLLM: the weights may be mixed
    duration: float
    error: LoadError | None = None


class LoadCheck(msgspec.Struct, frozen=True):
    """One worker's answer to CHECK_LOADED: how long it took, the KV-cache bytes it zeroed, the
    first tensor or layer that computes a non-finite value ("" when none does), and else the
    first layer that does not compute with what the loads wrote into it, and why."""

    dp_rank: int
    worker_rank: int
    seconds: float
    kv_bytes_cleared: int = 0
    not_finite: str = ""
    mismatch_layer: str = ""
    mismatch: str = ""
    # Kernels rebuilt from a weight the load wrote through another layer (a tied LM head).
    rebuilt: tuple[str, ...] = ()


# --- staging (WorkerRpc.STAGE, STAGE_RESULT, DISCARD_STAGED) -------------------------------


class StageAck(msgspec.Struct, frozen=True, array_like=True):
    """A worker's answer to STAGE: it started staging (it reports `frames.staged` when done)."""

    dp_rank: int
    worker_rank: int


class StageResult(msgspec.Struct, frozen=True):
    """How one worker's staging ended (or `done` False while it still receives)."""

    dp_rank: int
    worker_rank: int
    done: bool
    tensors: int = 0
    nbytes: int = 0
    digest: str = ""  # of the staged bytes (STAGED_DIGEST_METHOD), when done without error
    error: LoadError | None = None


# How StageResult.digest is computed (worker/weights/staging.py): equal on two servers that
# staged the same tensors.
STAGED_DIGEST_METHOD: Final = "staged-crc32"


# --- bounded worker calls (Utility.WORKER_CALL) ---------------------------------------------


class LateAnswer(msgspec.Struct, frozen=True):
    """A worker RPC outlived the timeout it was sent with. `drained`: every late answer
    arrived within the grace that followed and was dropped, so the rank's executor is in step
    again; else the executor was stopped (no model step may read a late answer as its own)
    and the rank must be taken for dead."""

    rpc: str
    timeout: float
    drained: bool
    message: str


class WorkerCall(msgspec.Struct, frozen=True):
    """The answer to Utility.WORKER_CALL: every worker's answer in worker order, or `late`."""

    answers: list[Any] = msgspec.field(default_factory=list)
    late: LateAnswer | None = None


# The timeouts worker RPCs are sent with (docs/architecture.md, "Worker calls and their
# deadlines", states each method's worst case beside them). A call that must answer at once
# (start a thread, read a state, drop a buffer) takes milliseconds:
QUICK_RPC_TIMEOUT_S: Final = 10.0
# A sampled fingerprint, a declaration's, or one slice of a full digest: milliseconds each (a
# full digest is cut into slices of bounded time).
DIGEST_RPC_TIMEOUT_S: Final = 60.0
# A LOAD is sent with its update's timeout plus this: the workers stop at the plan's deadline
# (an abort frame reaches them), then finish the layer in hand and vLLM's finalising.
LOAD_RPC_GRACE_S: Final = 30.0
# How long an EngineCore waits for late answers after a worker RPC's timeout before it stops
# its executor (Utility.WORKER_CALL). Generation waits meanwhile: better than a dead engine.
LATE_ANSWER_GRACE_S: Final = 20.0


# --- fingerprints (WorkerRpc.FINGERPRINT, DECLARE_FINGERPRINT, FULL_DIGEST) -----------------


class WorkerDigest(msgspec.Struct, frozen=True):
    """A worker's sampled digest of the weights, naming both methods it uses."""

    dp_rank: int
    worker_rank: int
    digest: str
    method: str
    sampled_method: str
    full_method: str


class DigestJob(str, enum.Enum):
    BASELINE = "baseline"  # the full digest of the declaration named by the token
    VERIFY = "verify"  # the full digest of the weights now (a job named by the token)


class DigestSlice(msgspec.Struct, frozen=True):
    """A worker's answer to one slice of a full digest."""

    dp_rank: int
    worker_rank: int
    done: bool
    digest: str = ""  # when done
    superseded: bool = False  # BASELINE: another declaration or a write replaced it
    method: str = ""


# --- worker identity (Utility.SET_WORKER_IDENTITY, GET_WORKER_IDENTITY) ---------------------


class RankIdentity(msgspec.Struct, frozen=True):
    """The identity one rank stamps on its samples (generation 0: none was ever set)."""

    dp_rank: int
    worker_id: str
    identity_generation: int
