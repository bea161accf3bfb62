"""The trainer's side of the `gloo` weight-transfer engine, in vLLM's trainer-side registry.

Runs in the trainer process, and needs vLLM installed there (its trainer-side engine
interface, `vllm.distributed.weight_transfer`). `register()` puts
`GlooTrainerWeightTransferEngine` in vLLM's `WeightTransferTrainerFactory` under `gloo`, so a
trainer written against vLLM's own API drives an engine served with
`--weight-transfer-config '{"backend": "gloo"}'`:

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from enginectl.client.transfer_engine import GlooTrainerInitInfo, register

    register()
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model),
    )
    engine.send_weights()

The group and the broadcast are enginectl's own (client/trainer_tensors.py `BroadcastGroup`:
rank 0 hosts the TCPStore, tensors go in buckets cut by common/buckets.py, packed into one
reused buffer); the workers' side is worker/weights/transfer/engine.py, and the names both
sides agree on (the engine's name, the default group, the join margin) are defined once, in
common/gloo_transfer.py (docs/weights.md, "vLLM's weight-transfer engines").

This is vLLM's plugin (pyproject.toml's `vllm.general_plugins` entry point names `register`),
and the one module of enginectl.client that imports vLLM: no enginectl module imports it, so
importing `enginectl.client`, or any other module of it, never imports vLLM; only a trainer
that asks for the plugin (or vLLM's plugin loader) does. `make check` holds both rules
([tool.importlinter] in pyproject.toml).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)

from enginectl.client.trainer_tensors import DEFAULT_BUCKET_BYTES, BroadcastGroup
from enginectl.common.buckets import cut
from enginectl.common.gloo_transfer import (
    DEFAULT_TRANSFER_GROUP,
    DEFAULT_TRANSFER_TIMEOUT_S,
    GLOO_TRANSFER_BACKEND,
    TRANSFER_JOIN_MARGIN_S,
)

# The names the workers' side agrees on (common/gloo_transfer.py), as this module has named them.
BACKEND = GLOO_TRANSFER_BACKEND
DEFAULT_GROUP = DEFAULT_TRANSFER_GROUP
JOIN_MARGIN_S = TRANSFER_JOIN_MARGIN_S  # past the rendezvous timeout, rank 0's join is given up on


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's group: rank 0 (the sender) hosts its TCPStore on
    `master_address:master_port` (0: a free port); `world_size` counts the trainer and every
    engine worker. `timeout_s` bounds the rendezvous and every broadcast; tensors of at most
    `bucket_bytes` go packed, one broadcast per bucket (0: one per tensor)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class StateDictSource(WeightSource):
    """A state dict (or `(name, tensor)` pairs) as vLLM's WeightSource, in its order: for a
    trainer whose weights are not one `nn.Module` (vLLM's `ModuleSource` takes that)."""

    def __init__(self, state: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        self._pairs = list(state.items() if isinstance(state, Mapping) else state)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._pairs]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._pairs)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 of the gloo group; `send_weights` drives the four steps through `client`."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool = True,
        group: BroadcastGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = group
        self.bucket_bytes = bucket_bytes

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer engine sends a WeightSource each round: pass source=")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, bucket_bytes=init_info.bucket_bytes)
        group = BroadcastGroup.host(
            init_info.group_name,
            BACKEND,  # the engine's group is a torch.distributed group of its backend's name
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            init_info.timeout_s,
        )
        workers = {
            "master_address": init_info.master_address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": init_info.world_size,
            "group_name": init_info.group_name,
            "timeout_s": init_info.timeout_s,
        }
        # The workers join inside init_weight_transfer_engine while rank 0 joins on a thread: an
        # init the engine refuses (a missing token, bad init info) answers at once, and rank 0's
        # join, which nothing interrupts, is let go (it ends at the rendezvous timeout).
        joined: list[BaseException | None] = []
        thread = threading.Thread(target=_join, args=(group, joined), name="enginectl-trainer-join", daemon=True)
        thread.start()
        try:
            client.init_weight_transfer_engine(workers)
        except BaseException:
            group.abandon("the engine's init_weight_transfer_engine failed")
            raise
        thread.join(init_info.timeout_s + JOIN_MARGIN_S)
        failure = joined[0] if joined else TimeoutError(f"rank 0 did not join within {init_info.timeout_s}s")
        if failure is not None:
            group.abandon("rank 0 did not join")
            raise failure
        return cls(client=client, source=source, group=group, bucket_bytes=init_info.bucket_bytes)

    def update_info(self) -> dict[str, Any]:
        """The `update_weights` payload of one round: the source's metadata, with the wire's
        bucket size."""
        assert self.source is not None
        meta = self.source.metadata()
        return asdict(
            _UpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
                bucket_bytes=self.bucket_bytes,
            )
        )

    def send_weights(self, weight_version: str | None = None) -> None:
        """One round: start, the batch's `update_weights` beside the broadcast, then finish
        (declaring `weight_version` where given)."""
        assert self.source is not None
        tensors = [materialize_full_tensor(t).detach().contiguous() for _, t in self.source]
        if not self.is_sender:
            return
        if self.group is None or self.group.pg is None:
            raise RuntimeError(f"the gloo group is not usable: {self.group.broken if self.group else 'not joined'}")
        info = self.update_info()
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = pool.submit(self.client.update_weights, info)
            self.group.broadcast(tensors, cut([t.numel() * t.element_size() for t in tensors], self.bucket_bytes))
            receiving.result()
        except BaseException:
            self.group.abandon("a round failed while broadcasting")
            raise
        finally:
            pool.shutdown(wait=False)  # a receive left blocked ends at the group's timeout
        if weight_version is None:
            self.client.finish_weight_update()
        else:
            self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _join(group: BroadcastGroup, joined: list[BaseException | None]) -> None:
    try:
        group.join()
        joined.append(None)
    except BaseException as exc:  # noqa: BLE001 - handed to trainer_init
        joined.append(exc)


@dataclass
class _UpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int


def register() -> None:
    """Put the trainer engine in vLLM's WeightTransferTrainerFactory under `gloo`; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, GlooTrainerWeightTransferEngine.__name__)
    except ValueError:  # registered already
        pass
