"""UpdateValidator: everything an update request is checked for before the model is touched.

Runs in the `enginectl serve` process, on the control loop. Names, shapes and dtypes are
checked against the served checkpoint's safetensors headers; files against the allowed roots
and their own headers (disk.py); the group (groups.py), version, etag, request id, pause mode
and timeout against their bounds (server/limits.py); an IPC update's host and handles in
ipc.py. A request that passes becomes the UpdatePlan (update/plans.py) its update runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import grpc

from enginectl.common import dtypes
from enginectl.common.buckets import MAX_BUCKET_BYTES
from enginectl.common.vocabulary import WeightSource
from enginectl.server.errors import ControlPlaneError, FieldViolation, Reason, invalid_field
from enginectl.server.limits import (
    MAX_SHAPE_RANK,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSOR_NAME_BYTES,
    MAX_TENSORS,
    MAX_VIOLATIONS,
)
from enginectl.server.weights.convert import parse_pause_mode, parse_timeout
from enginectl.server.weights.sources.disk import read_planned, resolve_checkpoint
from enginectl.server.weights.sources.groups import UpdateGroups, check_group_name
from enginectl.server.weights.sources.ipc import check_host, check_ranks_local, ipc_handles
from enginectl.server.weights.update.plans import TensorInfo, UpdatePlan
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2


class UpdateValidator:
    """Turns update requests into plans, or refuses them with a precise error."""

    def __init__(
        self,
        ledger: WeightVersionLedger,
        groups: UpdateGroups,
        *,
        allowed_roots: list[Path],
        expected: dict[str, TensorInfo],
        served_dtype: str,
        remote_ranks: Mapping[int, str] = MappingProxyType({}),
    ) -> None:
        self._ledger = ledger
        self._remote_ranks = remote_ranks  # dp_rank -> host of the ranks on other hosts (the census)
        self._groups = groups
        self.allowed_roots = allowed_roots
        self._expected = expected
        self._served_dtype = served_dtype

    def check_tensors(self, tensors: list[TensorInfo], field: str = "tensors") -> None:
        """TENSOR_MISMATCH unless every tensor is one the model takes, in a dtype it can load."""
        if len(tensors) > MAX_TENSORS:
            raise invalid_field(Reason.TOO_MANY_TENSORS, field, f"{len(tensors)} tensors; at most {MAX_TENSORS}")
        if not tensors:
            raise invalid_field(Reason.TENSOR_SPEC_INVALID, field, "no tensor to load")
        violations: list[FieldViolation] = []
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            problem = ""
            want = self._expected.get(t.name)
            if t.name in seen:
                problem = f"duplicate tensor {t.name!r}"
            elif self._expected and want is None:
                problem = f"unknown tensor {t.name!r}: the model has no such weight"
            elif want is not None and t.shape != want.shape:
                problem = f"{t.name}: shape {list(t.shape)} but the model takes {list(want.shape)}"
            elif (
                want is not None
                and t.dtype not in {want.dtype, self._served_dtype}
                and not (dtypes.BY_NAME[t.dtype].floating and dtypes.BY_NAME[want.dtype].floating)
            ):
                problem = f"{t.name}: dtype {t.dtype} but the model takes {want.dtype}"
            seen.add(t.name)
            if problem:
                violations.append(FieldViolation(f"{field}[{i}]", problem))
        if violations:
            raise ControlPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                Reason.TENSOR_MISMATCH,
                f"{len(violations)} tensor(s) the model can not take; first: {violations[0].description}",
                field_violations=violations[:MAX_VIOLATIONS],
            )

    def specs_from_proto(self, specs: Sequence[pb2.TensorSpec], field: str = "tensors") -> list[TensorInfo]:
        if len(specs) > MAX_TENSORS:
            raise invalid_field(Reason.TOO_MANY_TENSORS, field, f"{len(specs)} tensors; at most {MAX_TENSORS}")
        tensors = []
        for i, spec in enumerate(specs):
            name_bytes = len(spec.name.encode())
            if not spec.name or name_bytes > MAX_TENSOR_NAME_BYTES:
                raise invalid_field(
                    Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].name", f"required, at most {MAX_TENSOR_NAME_BYTES} bytes"
                )
            dtype = dtypes.BY_PROTO.get(spec.dtype)
            if dtype is None:
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].dtype", "a known TensorDtype")
            if len(spec.shape) > MAX_SHAPE_RANK or any(d < 0 for d in spec.shape):
                raise invalid_field(
                    Reason.TENSOR_SPEC_INVALID,
                    f"{field}[{i}].shape",
                    f"at most {MAX_SHAPE_RANK} non-negative dimensions",
                )
            info = TensorInfo(spec.name, dtype.name, tuple(int(d) for d in spec.shape))
            if info.nbytes // dtype.itemsize > MAX_TENSOR_ELEMENTS:
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].shape", "too many elements")
            tensors.append(info)
        return tensors

    def disk(self, request: pb2.UpdateWeightsFromDiskRequest) -> UpdatePlan:
        common = self._common(request, "")
        files = resolve_checkpoint(request.path, self.allowed_roots)
        headers = tuple(read_planned(file) for file in files)
        tensors = [TensorInfo(t.name, t.dtype, t.shape) for header in headers for t in header.tensors]
        self.check_tensors(tensors)
        return UpdatePlan(
            WeightSource.DISK, tensors, files, "", *common, stage_only=request.stage_only, headers=headers
        )

    def distributed(self, request: pb2.UpdateWeightsFromDistributedRequest) -> UpdatePlan:
        common = self._common(request, "")
        check_group_name(request.group_name)
        tensors = self.specs_from_proto(request.tensors)
        self.check_tensors(tensors)
        if request.group_name not in self._groups:
            raise ControlPlaneError(
                grpc.StatusCode.NOT_FOUND,
                Reason.GROUP_NOT_FOUND,
                f"no update group {request.group_name!r}; create it with InitWeightsUpdateGroup",
            )
        if request.bucket_bytes > MAX_BUCKET_BYTES:
            raise invalid_field(
                Reason.BUCKET_BYTES_INVALID,
                "bucket_bytes",
                f"{request.bucket_bytes}; at most {MAX_BUCKET_BYTES} (4 GiB)",
            )
        return UpdatePlan(
            WeightSource.DISTRIBUTED,
            tensors,
            [],
            request.group_name,
            *common,
            bucket_bytes=request.bucket_bytes,
            stage_only=request.stage_only,
        )

    def transfer(self, request: pb2.StartWeightUpdateRequest) -> UpdatePlan:
        """A transfer engine's round (transfer.py): the fields every update has; its tensors
        are the engine's business (its batches name them)."""
        return UpdatePlan(
            WeightSource.TRANSFER_ENGINE, [], [], "", *self._common(request, ""), stage_only=request.stage_only
        )

    def tensors(self, header: pb2.TensorStreamHeader) -> UpdatePlan:
        common = self._common(header, "header.")
        tensors = self.specs_from_proto(header.tensors, "header.tensors")
        self.check_tensors(tensors, "header.tensors")
        return UpdatePlan(WeightSource.TENSORS, tensors, [], "", *common, stage_only=header.stage_only)

    def ipc(self, request: pb2.UpdateWeightsFromIpcRequest, num_workers: int) -> UpdatePlan:
        """Ranks on other hosts first, then the trainer's host (an update no rank elsewhere
        could map, or from a trainer elsewhere, is told so whatever else it sent), then the
        tensors as every update's, then their handles (ipc.py)."""
        check_ranks_local(self._remote_ranks)
        common = self._common(request, "")
        check_host(request.host)
        tensors = self.specs_from_proto(request.tensors)
        self.check_tensors(tensors)
        handles = ipc_handles(tensors, request.handles, num_workers)
        return UpdatePlan(WeightSource.IPC, tensors, [], "", *common, handles=handles)

    def commit(self, request: pb2.CommitStagedWeightsRequest, staged: UpdatePlan, token: str) -> UpdatePlan:
        """The update CommitStagedWeights runs: the tensors `staged` holds (under the workers'
        `token`), loaded from memory, with the commit's own version (else the stage's), etag,
        request id, pause mode, cache reset and timeout."""
        version, etag, request_id, mode, reset_cache, timeout = self._common(request, "")
        return UpdatePlan(
            staged.source,
            staged.tensors,
            [],
            "",
            version if request.HasField("weight_version") else staged.version,
            etag,
            request_id,
            mode,
            reset_cache,
            timeout,
            stage_token=token,
        )

    def _common(self, request: UpdateRequest, prefix: str) -> tuple[str | None, str, str, str, bool, float]:
        """The fields every update has, checked: (version, etag, request_id, pause mode,
        reset_cache, timeout); `prefix` names where they sit in the request."""
        version = request.weight_version if request.HasField("weight_version") else None
        self._ledger.check_write(version=version, etag=request.etag, request_id=request.request_id)
        mode = parse_pause_mode(f"{prefix}pause_mode", request.pause_mode)
        timeout = parse_timeout(f"{prefix}timeout", request.timeout, request.HasField("timeout"))
        reset_cache = request.reset_prefix_cache if request.HasField("reset_prefix_cache") else True
        return version, request.etag, request.request_id, mode, reset_cache, timeout


UpdateRequest = (
    pb2.UpdateWeightsFromDiskRequest
    | pb2.UpdateWeightsFromDistributedRequest
    | pb2.TensorStreamHeader
    | pb2.UpdateWeightsFromIpcRequest
    | pb2.CommitStagedWeightsRequest
    | pb2.StartWeightUpdateRequest
)
