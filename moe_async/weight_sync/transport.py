"""Weight transports: how a versioned set of HF-named tensors reaches the engines.

Data path of :class:`BroadcastTransport` (follows slime's distributed weight updater and
SGLang's ``update_weights_from_distributed``):

    trainer.export_hf_weights()   (gather PP/EP -> gather TP -> rename to HF -> cast)
      -> make_buckets(bucket_bytes)            (greedy, order kept; oversize tensor alone)
      -> engines: POST /pause_generation       (mode from config)
      -> per bucket: POST /update_weights_from_distributed {names, dtypes, shapes,
         load_format="flattened_bucket", weight_version on the LAST bucket only}
         while rank 0 broadcasts the flat uint8 buffer over the weight-update group
      -> engines apply the staged update atomically on the last bucket
      -> POST /continue_generation

The HTTP call and the broadcast must overlap (the engine's handler blocks in the
receiving broadcast), so each bucket's POSTs run in threads while this thread
broadcasts.
"""

from __future__ import annotations

import abc
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

import torch

from moe_async.weight_sync.bucket import Bucket, make_buckets
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import group_broadcast, init_weight_update_group, resolve_backend

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update; the message names the engine."""


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (bound and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _lookahead(it: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Yield ``(bucket, is_last)``."""
    it = iter(it)
    try:
        prev = next(it)
    except StopIteration:
        return
    for cur in it:
        yield prev, False
        prev = cur
    yield prev, True


class WeightTransport(abc.ABC):
    """Moves one versioned update of HF-named tensors into every engine."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Set up whatever the transport needs (process groups, directories)."""

    @abc.abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        """Send a full update; engines serve ``weight_version`` afterwards.

        Returns metrics: ``sync/bytes`` (bytes), ``sync/seconds`` (s), ``sync/gbps``
        (GB/s), ``sync/pause_seconds`` (s engines were paused), ``sync/buckets``.
        """

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources."""


class BroadcastTransport(WeightTransport):
    """Bucketed broadcast from the trainer (group rank 0) into engines (ranks 1..N).

    Args:
        clients: synchronous engine clients (one per engine), each exposing
            ``init_weights_update_group``, ``update_weights_from_distributed``,
            ``pause_generation``, ``continue_generation``.
        cfg: bucket size, backend, timeout.
        pause_mode: SGLang ``pause_generation`` mode (``abort``, ``retract``, ``in_place``).
        ranks_per_engine: engine TP size (ranks each engine contributes to the group).
        master_address: address the trainer's TCPStore binds (loopback on CPU).

    Raises:
        WeightSyncError: an engine answered ``success: false`` or an HTTP error.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        cfg: WeightSyncConfig,
        *,
        pause_mode: str = "abort",
        ranks_per_engine: int = 1,
        master_address: str = "127.0.0.1",
        group_name: str = "moe_async_weight_sync",
    ):
        self.clients = list(clients)
        self.cfg = cfg
        self.pause_mode = pause_mode
        self.ranks_per_engine = ranks_per_engine
        self.master_address = master_address
        self.group_name = group_name
        self.backend = resolve_backend(cfg.backend)
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))

    @property
    def world_size(self) -> int:
        return 1 + len(self.clients) * self.ranks_per_engine

    def connect(self) -> None:
        port = free_port(self.master_address)
        futs = [
            self._pool.submit(
                c.init_weights_update_group,
                master_address=self.master_address,
                master_port=port,
                rank_offset=1 + i * self.ranks_per_engine,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for i, c in enumerate(self.clients)
        ]
        self.group = init_weight_update_group(
            master_address=self.master_address,
            master_port=port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.cfg.timeout_s,
        )
        for i, f in enumerate(futs):
            self._check(i, f.result(timeout=self.cfg.timeout_s), "init_weights_update_group")

    @staticmethod
    def _check(i: int, resp: Any, what: str) -> None:
        if isinstance(resp, dict) and resp.get("success") is False:
            raise WeightSyncError(f"engine {i}: {what} failed: {resp.get('message')}")

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        if self.group is None:
            raise WeightSyncError("BroadcastTransport.send before connect()")
        t0 = time.perf_counter()
        for c in self.clients:
            c.pause_generation(mode=self.pause_mode)
        t_paused = time.perf_counter()
        nbytes, nbuckets = 0, 0
        try:
            for bucket, last in _lookahead(make_buckets(named_tensors, self.cfg.bucket_bytes)):
                flat = bucket.flatten()
                futs = [
                    self._pool.submit(
                        c.update_weights_from_distributed,
                        names=bucket.names,
                        dtypes=bucket.dtypes,
                        shapes=bucket.shapes,
                        group_name=self.group_name,
                        weight_version=weight_version if last else None,
                        flush_cache=last,
                        load_format="flattened_bucket",
                    )
                    for c in self.clients
                ]
                group_broadcast(self.group, flat, src=0)
                for i, f in enumerate(futs):
                    self._check(i, f.result(timeout=self.cfg.timeout_s), "update_weights_from_distributed")
                nbytes += flat.numel()
                nbuckets += 1
        finally:
            for c in self.clients:
                c.continue_generation()
        t1 = time.perf_counter()
        secs = t1 - t0
        return {
            "sync/bytes": float(nbytes),
            "sync/seconds": secs,
            "sync/gbps": nbytes / secs / 1e9 if secs > 0 else 0.0,
            "sync/pause_seconds": t1 - t_paused,
            "sync/buckets": float(nbuckets),
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.group = None
