"""The colocated weight transport: buckets as memory handles, no process group.

:class:`TensorTransport` sends each bucket of :class:`~moe_async.weight_sync.transport.BroadcastTransport`'s
update session as SGLang's ``POST /update_weights_from_tensor`` with handles to the sender's
memory (CUDA IPC, or CPU shared memory), for engines on the trainer's host and device.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any, Sequence

import torch

from moe_async.protocols import WeightReceiver
from moe_async.weight_sync.bucket import Bucket, str_to_dtype
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import WeightSyncError
from moe_async.weight_sync.transport import BroadcastTransport


class TensorTransport(BroadcastTransport):
    """Colocated engines (same host, e.g. trainer and engine sharing one GPU): each bucket
    goes as SGLang 0.5.23's ``POST /update_weights_from_tensor`` with handles to the
    sender's memory instead of a broadcast (NCCL refuses two ranks on one GPU).

    Per bucket: ``{serialized_named_tensors: one base64 ForkingPickler payload per engine TP
    rank (``ranks_per_engine``: each engine's TP size), load_format: "flattened_bucket",
    flush_cache, weight_version (a string) on the LAST bucket only}``
    (:mod:`~moe_async.weight_sync.tensor_ipc`), inside the same pause / ``begin_weight_update
    {atomic}`` / ``end_weight_update`` / continue session as :class:`BroadcastTransport`
    (same ordering, metrics and failure handling). Buckets and the send buffer live on the
    current CUDA device when there is one (CUDA IPC handles), else in CPU shared memory
    (opened by name by the engine process). Each bucket's tensors are kept alive until every
    engine has answered its call (the engine copies them into its parameters before it
    answers), so a packed buffer is reused only after that. No process group: ``connect()``
    only reads the engines' ``/weights_layout``; ``master_address``/``group_name``/
    ``world_size`` are accepted and unused. ``sync/broadcast_seconds`` is the time waiting
    for the engines to copy a bucket.

    Raises:
        WeightSyncError: before connect(), or naming the engine that answered ``success: false``.
    """

    def __init__(self, clients: Sequence[WeightReceiver], cfg: WeightSyncConfig, *, pause_mode: str = "abort",
                 ranks_per_engine: int | Sequence[int] = 1, **kw: Any):
        super().__init__(clients, cfg, pause_mode=pause_mode, ranks_per_engine=ranks_per_engine, **kw)
        self.tp_sizes = list(self.membership.engine_sizes)
        self._ready = False

    @property
    def device(self) -> torch.device:
        """The current CUDA device when CUDA is available (IPC handles), else CPU (shared memory)."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _new_send_buf(self, nbytes: int) -> torch.Tensor:
        """On CPU, allocated in shared memory at once: the first handle to a plain CPU tensor
        moves its bytes into a new segment (torch's ``share_memory_``), and a write the
        exporter thread makes into the buffer during that copy would be lost."""
        if self.device.type != "cpu":
            return super()._new_send_buf(nbytes)
        from moe_async.weight_sync.tensor_ipc import shared_uint8

        return shared_uint8(nbytes)

    def connect(self) -> None:
        """Read the engines' common ``/weights_layout`` (embedded engines); nothing to join."""
        self._set_layout(self._common_layout())
        self._ready = True

    def _connected(self) -> bool:
        return self._ready

    update_call = "update_weights_from_tensor"

    def _post_bucket(self, bucket: Bucket, flat: torch.Tensor | None,
                     weight_version: int | None) -> list[tuple[int, Future]]:
        from moe_async.weight_sync.tensor_ipc import serialize_flattened_bucket

        if flat is None:
            raise WeightSyncError("the tensor transport sends from one process: a bucket of another sender "
                                  "(weight_sync.transport: broadcast has several senders)")
        last = weight_version is not None
        dtypes = [str_to_dtype(d) for d in bucket.dtypes]
        payloads: dict[int, list[str]] = {}
        for tp in set(self.tp_sizes):
            payloads[tp] = serialize_flattened_bucket(flat, bucket.names, dtypes, bucket.shapes, copies=tp)
        return [
            (i, self._posters[i].submit(
                c.update_weights_from_tensor, serialized_named_tensors=payloads[self.tp_sizes[i]],
                load_format="flattened_bucket", flush_cache=last and self.flush_with_update,
                weight_version=str(weight_version) if last else None))  # SGLang: Optional[str]
            for i, c in enumerate(self.clients)
        ]

    def _transfer(self, flat: torch.Tensor, posted: list[tuple[int, Future]]) -> None:
        """Hold ``flat`` (this frame's reference) until every engine answered this bucket;
        errors are read with the other replies after the last bucket."""
        wait([f for _, f in posted], timeout=self.cfg.timeout_s)

    def close(self) -> None:
        self._ready = False
