"""The fallback weight transport: safetensors shards on a shared disk.

:class:`DiskTransport` writes each weight version to its own directory, then asks every
engine for SGLang's ``POST /update_weights_from_disk`` inside a pause/continue; ``send``
returns the ``sync/*`` metrics and raises
:class:`~moe_async.weight_sync.group.WeightSyncError` naming the engine that refused.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import torch

from moe_async.protocols import WeightReceiver
from moe_async.weight_sync.bucket import make_buckets
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import WeightSyncError
from moe_async.weight_sync.transport import BroadcastTransport, WeightTransport


class DiskTransport(WeightTransport):
    """Fallback: safetensors shards in a directory every engine can read, then SGLang's
    ``POST /update_weights_from_disk {model_path, weight_version, flush_cache}``.

    Each update goes to its own subdirectory ``v{weight_version}`` (shards of at most
    ``bucket_bytes``, a tensor larger than that alone in its shard; the checkpoint's
    ``config.json`` is not needed by the engines here); the previous one is removed after
    the engines confirm. Engines apply the whole directory atomically.
    """

    def __init__(self, clients: Sequence[WeightReceiver], cfg: WeightSyncConfig, *, pause_mode: str = "abort"):
        self.clients = list(clients)
        self.cfg = cfg
        self.pause_mode = pause_mode
        self._own_dir = cfg.disk_dir is None
        self.root = cfg.disk_dir
        self._prev: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))

    def connect(self) -> None:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="moe_async_weights_")
        os.makedirs(self.root, exist_ok=True)

    def _write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], path: str) -> tuple[int, int]:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        nbytes, nfiles = 0, 0
        for bucket in make_buckets(named_tensors, self.cfg.bucket_bytes):
            tensors = {n: t.detach().contiguous() for n, t in zip(bucket.names, bucket.tensors)}
            save_file(tensors, os.path.join(path, f"model-{nfiles:05d}.safetensors"))
            nbytes += bucket.nbytes
            nfiles += 1
        return nbytes, nfiles

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        if self.root is None:
            raise WeightSyncError("DiskTransport.send before connect()")
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"v{weight_version}")
        if os.path.exists(path):
            shutil.rmtree(path)
        nbytes, nfiles = self._write(named_tensors, path)  # before pausing: engines keep generating
        t_written = time.perf_counter()
        for c in self.clients:
            c.pause_generation(mode=self.pause_mode)
        t_paused = time.perf_counter()
        try:
            # in_place: no flush while paused requests hold KV (SGLang would fail the call)
            futs = [self._pool.submit(c.update_weights_from_disk, model_path=path, weight_version=str(weight_version),
                                      flush_cache=self.pause_mode != "in_place") for c in self.clients]
            for i, f in enumerate(futs):
                BroadcastTransport._check(i, f.result(timeout=self.cfg.timeout_s), "update_weights_from_disk")
        finally:
            for c in self.clients:
                c.continue_generation()
        t1 = time.perf_counter()
        if self._prev and self._prev != path:
            shutil.rmtree(self._prev, ignore_errors=True)
        self._prev = path
        secs = t1 - t0
        return {
            "sync/bytes": float(nbytes),
            "sync/seconds": secs,
            "sync/gbps": nbytes / secs / 1e9 if secs > 0 else 0.0,
            "sync/pause_seconds": t1 - t_paused,
            "sync/buckets": float(nfiles),
            "sync/write_seconds": t_written - t0,
            "sync/weight_version": float(weight_version),
        }

    def close(self) -> None:
        if self._own_dir and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
