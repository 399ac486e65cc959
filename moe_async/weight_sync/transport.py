"""Weight transports: how a versioned set of HF-named tensors reaches the engines.

Data path of :class:`BroadcastTransport` (follows slime's distributed weight updater and
SGLang's ``update_weights_from_distributed``):

    trainer.export_hf_weights(out=transport.destination)   (gather PP/EP -> gather TP ->
                                               rename to HF -> cast, into the send buffer)
      -> in_layout_order(engines' /weights_layout)  (embedded engines; SGLang: export order)
      -> make_buckets(bucket_bytes)            (greedy, order kept; oversize tensor alone)
      -> engines: POST /pause_generation       (mode from config; sent while the first
                                                bucket is exported, answered before any
                                                bucket's POST)
      -> per bucket: POST /update_weights_from_distributed {names, dtypes, shapes,
         load_format="flattened_bucket", weight_version on the LAST bucket only}
         while rank 0 broadcasts the flat uint8 buffer over the weight-update group
      -> engines apply the staged update atomically on the last bucket
      -> POST /continue_generation             (queued behind the versioned call: each
                                                engine's poster sends it on that reply)

The HTTP call and the broadcast must overlap (the engine's handler blocks in the
receiving broadcast): each bucket's POST is queued on that engine's poster thread (one
per engine, so the engine sees the calls in broadcast order) and this thread broadcasts
at once, reading the replies only after the last bucket. Packing overlaps too
(``weight_sync.overlap``): a background thread pulls tensors from the exporter, groups and
flattens bucket k+1 (a queue of depth 1: double buffering) while this thread broadcasts
bucket k; tensors already end to end in one storage (the send buffer, in the engines'
layout order) are sent without packing.

:class:`DiskTransport` is the fallback (``weight_sync.transport: disk``): safetensors
shards of at most ``bucket_bytes`` under a directory the engines can read, then SGLang's
``/update_weights_from_disk`` with the new ``weight_version``. :func:`make_transport`
picks one from the config.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

import torch

from moe_async.weight_sync.bucket import Bucket, make_buckets, nbytes_of, str_to_dtype
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import (
    bind_master_store,
    group_broadcast,
    init_weight_update_group,
    resolve_backend,
)

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


_END = object()


class PackPool:
    """Flat buffers reused across buckets and syncs (``slots`` of them, grown on demand).

    Packing into a fresh multi-MiB allocation page-faults (and the kernel zeroes) every page
    of it on every bucket; at 64 MiB+ that costs as much as the copy itself. A bucket of one
    tensor needs no buffer at all: its own bytes are sent (zero copy).
    """

    def __init__(self, slots: int):
        self.slots = slots
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.free: queue.Queue = queue.Queue()
        self.reset()

    def reset(self) -> None:
        """All slots free again (call only when no packed buffer is in use)."""
        self.free = queue.Queue()
        for i in range(self.slots):
            self.free.put(i)

    def acquire(self, stop: threading.Event | None = None) -> int:
        while True:
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise _Stopped() from None

    def release(self, slot: int) -> None:
        self.free.put(slot)

    def pack(self, slot: int, bucket: Bucket) -> torch.Tensor:
        if len(bucket.tensors) == 1:
            return bucket.flatten()
        span = contiguous_span(bucket.tensors)
        if span is not None:  # already end to end in one storage (e.g. an exporter's flat buffer)
            return span
        n = bucket.nbytes
        buf = self.bufs[slot]
        dev = bucket.tensors[0].device
        if buf is None or buf.numel() < n or buf.device != dev:
            self.bufs[slot] = buf = torch.empty(n, dtype=torch.uint8, device=dev)
        off = 0
        for t in bucket.tensors:
            v = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off: off + v.numel()].copy_(v)
            off += v.numel()
        return buf[:n]


class _Stopped(Exception):
    pass


def contiguous_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``uint8`` view of ``tensors`` when they already lie end to end, in order, in one
    storage (each contiguous): their flattened bucket without a copy. None otherwise."""
    t0 = tensors[0]
    st = t0.untyped_storage()
    end = t0.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.device != t0.device or t.data_ptr() != end
                or t.untyped_storage().data_ptr() != st.data_ptr()):
            return None
        end += t.numel() * t.element_size()
    start = t0.data_ptr() - st.data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=t0.device).set_(st, start, (end - t0.data_ptr(),))


def in_layout_order(named_tensors: Iterable[tuple[str, torch.Tensor]],
                    order: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` re-ordered to follow ``order`` (an engine's ``/weights_layout``), so
    that consecutive names of a bucket are consecutive in the engine's parameter buffer and
    it receives the bucket in place. A tensor is yielded as soon as every name before it in
    ``order`` was (those that arrive early are held: memory up to what the exporter yields
    out of order); names missing from the stream are skipped at the end; names not in
    ``order`` (or repeated) follow last, in arrival order (the engine names them in its
    error)."""
    pos = {n: i for i, n in enumerate(order)}
    held: dict[int, tuple[str, torch.Tensor]] = {}
    extra: list[tuple[str, torch.Tensor]] = []
    nxt = 0
    for name, t in named_tensors:
        i = pos.get(name)
        if i is None or i < nxt or i in held:
            extra.append((name, t))
            continue
        held[i] = (name, t)
        while nxt in held:
            yield held.pop(nxt)
            nxt += 1
    for i in sorted(held):
        yield held[i]
    yield from extra


def packed_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    overlap: bool = True,
    stats: dict[str, float] | None = None,
    pool: PackPool | None = None,
) -> Iterator[tuple[Bucket, torch.Tensor, bool]]:
    """Yield ``(bucket, flat_uint8, is_last)`` for every bucket of ``named_tensors``.

    With ``overlap`` the producer (pulling from ``named_tensors``: for the trainer, the
    gather/convert/cast of ``export_hf_weights``; then packing) runs in a background thread
    ahead of the consumer (queue depth 1: double buffering), so packing bucket k+1 overlaps
    whatever the consumer does with bucket k (the broadcast); the thread starts when this
    function returns (the first bucket is being made while the caller pauses the engines),
    and the returned iterator's ``close()`` stops it. A yielded ``flat`` is valid
    until the consumer asks for the next bucket (its buffer is then reused, see
    :class:`PackPool`; 3 slots with overlap, 1 without). Exceptions of the producer re-raise
    here. ``stats`` (optional) gets ``pack_seconds`` (producer busy time) and
    ``wait_seconds`` (consumer time spent waiting for a packed bucket).
    """
    stats = stats if stats is not None else {}
    stats.setdefault("pack_seconds", 0.0)
    stats.setdefault("wait_seconds", 0.0)
    need = 3 if overlap else 1
    if pool is None or pool.slots < need:
        pool = PackPool(need)
    pool.reset()
    it = _lookahead(make_buckets(named_tensors, bucket_bytes))
    return _Overlapped(it, stats, pool) if overlap else _serial(it, stats, pool)


def _serial(it: Iterator[tuple[Bucket, bool]], stats: dict, pool: PackPool) -> Iterator[tuple[Bucket, torch.Tensor, bool]]:
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        flat = None if b is None else pool.pack(0, b[0])
        dt = time.perf_counter() - t0
        stats["pack_seconds"] += dt
        stats["wait_seconds"] += dt
        if b is None:
            return
        yield b[0], flat, b[1]


class _Overlapped:
    """Iterator of :func:`packed_buckets` with overlap: its producer thread starts at once
    (on construction, not on the first ``next``), so the exporter already runs while the
    caller does something else first (e.g. pauses the engines). ``close()`` stops the thread."""

    def __init__(self, it: Iterator[tuple[Bucket, bool]], stats: dict, pool: PackPool):
        self.stats, self.pool = stats, pool
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self.held: int | None = None  # the slot of the bucket the consumer holds
        self.done = False
        self.th = threading.Thread(target=self._produce, args=(it,), name="weight-sync-pack", daemon=True)
        self.th.start()

    def _produce(self, it: Iterator[tuple[Bucket, bool]]) -> None:
        stats, pool, q, stop = self.stats, self.pool, self.q, self.stop
        try:
            while not stop.is_set():
                slot = pool.acquire(stop)
                t0 = time.perf_counter()
                b = next(it, None)
                item = _END if b is None else (b[0], pool.pack(slot, b[0]), b[1], slot)
                stats["pack_seconds"] += time.perf_counter() - t0
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item is _END:
                    return
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            q.put(e)

    def __iter__(self) -> "_Overlapped":
        return self

    def __next__(self) -> tuple[Bucket, torch.Tensor, bool]:
        if self.held is not None:  # the consumer is done with the previous bucket's buffer
            self.pool.release(self.held)
            self.held = None
        if self.done:
            raise StopIteration
        t0 = time.perf_counter()
        item = self.q.get()
        self.stats["wait_seconds"] += time.perf_counter() - t0
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.held = item[3]
        return item[0], item[1], item[2]

    def close(self) -> None:
        self.done = True
        self.stop.set()
        while self.th.is_alive():  # unblock a producer waiting on a full queue
            try:
                self.q.get_nowait()
            except queue.Empty:
                pass
            self.th.join(0.1)


def _post(client: Any, path: str, body: dict) -> dict:
    """POST ``body`` to an engine endpoint the client has no method for (no retries)."""
    fn = getattr(client, path.strip("/"), None)
    if fn is not None:
        return fn(**body)
    return client._request("POST", path, body, retry=None).json()


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
        """Release per-connection resources (a later connect() may follow)."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """close() and release everything (thread pools)."""
        self.close()


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
        # one thread per engine posts its bucket metadata in order (the engine pairs the i-th
        # call with the i-th broadcast), without the sender waiting for each reply
        self._posters = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weight-sync-post{i}")
                         for i in range(len(self.clients))]
        self._warned: set[str] = set()
        self._pack_pool = PackPool(3)  # reused flat buffers: up to 3 x bucket_bytes
        #: the engines' common ``/weights_layout`` names (their buffer order), read at connect
        self.layout: list[str] | None = None
        self._slots: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {}  # name -> (offset, shape, dtype, bytes)
        self._send_nbytes = 0
        self._send_buf: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}  # name -> its view of _send_buf (made once)
        #: optional ``callback(bucket, is_last)`` after each bucket is broadcast (tests, logging)
        self.on_bucket = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.clients) * self.ranks_per_engine

    def connect(self) -> None:
        """Create the weight-update group with every engine (collective with them); an
        existing group is left first, so connect() also re-joins restarted engines."""
        if self.group is not None:
            self.close()
        store = bind_master_store(self.master_address, self.world_size, self.cfg.timeout_s)
        port = store.port
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
            store=store,
        )
        for i, f in enumerate(futs):
            self._check(i, f.result(timeout=self.cfg.timeout_s), "init_weights_update_group")
        self._set_layout(self._common_layout())

    def _set_layout(self, layout: dict | None) -> None:
        self.layout = None if layout is None else list(layout["names"])
        slots, off = {}, 0
        if layout is not None:
            for n, s, d in zip(layout["names"], layout["shapes"], layout["dtypes"]):
                dt = str_to_dtype(d)
                nb = nbytes_of(s, dt)
                slots[n] = (off, tuple(s), dt, nb)
                off += nb
        # the send buffer is kept only for the same layout: an exporter may keep its tensors
        # in it (MegatronTrainer.relayout_params), so its bytes are never handed out under
        # other names; a new layout gets a new buffer (the old one lives on in the exporter)
        if slots != self._slots:
            self._send_buf = None
            self._views = {}
        self._slots = slots
        self._send_nbytes = off

    def destination(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Where an exporter may write tensor ``name`` so that it is sent without packing.

        A view of this transport's send buffer (on the backend's device: CUDA for NCCL, else
        CPU; reused by every sync: valid until the
        next ``send``), laid out in the engines' ``/weights_layout`` order, so a bucket of
        consecutive names is one span (:func:`contiguous_span`). None when the engines publish
        no layout (SGLang) or ``name``/``shape``/``dtype`` differ from it: the exporter then
        makes its own copy and the bucket is packed. Memory: one copy of the model, allocated
        on first use. The same tensor object is returned for a name until the layout changes
        (callers must not resize it or change its ``.data``). Use: ``send(trainer.export_hf_weights(out=transport.destination), v)``.

        Only the exporter of this transport may write into these views: a 1-process
        ``MegatronTrainer`` moves its parameters into them (``relayout_params``) and then
        yields them without a copy (the buffer is its weights; it survives a re-connect with
        the same layout, and a different layout gets a new buffer).
        """
        slot = self._slots.get(name)
        if slot is None or tuple(shape) != slot[1] or dtype != slot[2]:
            return None
        v = self._views.get(name)  # an exporter asks several times per sync (plan, order, copy)
        if v is not None:
            return v
        if self._send_buf is None:
            # NCCL sends CUDA tensors only; gloo CPU ones
            dev = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                   else torch.device("cpu"))
            self._send_buf = torch.empty(self._send_nbytes, dtype=torch.uint8, device=dev)
            self._views = {}
        off, shp, dt, nb = slot
        v = self._views[name] = self._send_buf[off: off + nb].view(dt).view(shp)
        return v

    def _common_layout(self) -> dict | None:
        """The engines' send order when all publish the same one (embedded engines), else None
        (SGLang has no ``/weights_layout``: the exporter's order is kept)."""
        layouts = []
        for c in self.clients:
            fn = getattr(c, "weights_layout", None)
            try:
                layouts.append(fn() if fn is not None else None)
            except Exception as e:  # noqa: BLE001 - an optional extension: fall back to export order
                log.info("weights_layout unavailable (%s); sending in export order", e)
                return None
        if not layouts or layouts[0] is None or any(x != layouts[0] for x in layouts):
            return None
        return layouts[0]

    def _on_posters(self, method: str, skip: set[int] = frozenset(), **kw: Any) -> list[tuple[int, Any]]:
        """Queue ``client.<method>(**kw)`` on every engine's poster thread (but those in
        ``skip``), after what is already queued there (so it reaches each engine in order
        with the bucket calls); each future gives ``(reply, perf_counter() at the reply)``."""
        def call(c: Any) -> tuple[Any, float]:
            r = getattr(c, method)(**kw)
            return r, time.perf_counter()

        return [(i, self._posters[i].submit(call, c)) for i, c in enumerate(self.clients) if i not in skip]

    def _replies(self, futs: list[tuple[int, Any]], what: str) -> float:
        """Wait for ``futs`` of :meth:`_on_posters` (one ``timeout_s`` for all); raise on the
        first failure (naming the engine); return when the last reply arrived."""
        deadline = time.monotonic() + self.cfg.timeout_s
        last = 0.0
        for i, f in futs:
            r, t = f.result(timeout=max(0.0, deadline - time.monotonic()))
            self._check(i, r, what)
            last = max(last, t)
        return last

    @staticmethod
    def _check(i: int, resp: Any, what: str) -> None:
        if isinstance(resp, dict) and resp.get("success") is False:
            raise WeightSyncError(f"engine {i}: {what} failed: {resp.get('message')}")

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        """Send one full update (see the module docstring for the data path).

        Tensors are re-ordered to the engines' ``/weights_layout`` when they publish one
        (:func:`in_layout_order`). Each bucket's metadata POST is queued on the engine's
        poster thread and the buffer broadcast at once; replies are read after the last
        bucket (the engine refuses every later bucket of an update once one failed, and
        then fails the versioned call: nothing is applied).

        Per-sync fixed costs are kept off the critical path where that is safe: with
        ``pause_scope: sync`` the pause requests go out on the poster threads while the
        first bucket is being exported (with ``overlap``), and every engine has answered
        its pause before any bucket's POST is sent (a failed pause sends none); the
        continue request is queued behind the versioned call, so each poster sends it as
        soon as its engine has applied the update. ``sync/pause_seconds`` (the stall) runs
        from the first pause request to the last continue reply (an upper bound of the
        time any engine was paused).

        Raises:
            WeightSyncError: before connect(), or naming the engine that answered
                ``success: false`` (first failure).
        """
        if self.group is None:
            raise WeightSyncError("BroadcastTransport.send before connect()")
        t0 = time.perf_counter()
        stats: dict[str, float] = {}
        if self.layout is not None:
            named_tensors = in_layout_order(named_tensors, self.layout)
        whole = self.cfg.pause_scope == "sync"
        pauses: list[tuple[int, Any]] = []
        resumes: list[tuple[int, Any]] = []
        paused_ok = False
        t_paused = t_resumed = t0
        nbytes, nbuckets, bcast_s, oversize, ack_s = 0, 0, 0.0, 0, 0.0
        pending: list[tuple[int, Any]] = []
        last_posted = False
        buckets = None
        failed = False
        try:
            if whole:  # in flight while the exporter makes the first bucket (below)
                t_paused = time.perf_counter()
                pauses = self._on_posters("pause_generation", mode=self.pause_mode)
            buckets = packed_buckets(named_tensors, self.cfg.bucket_bytes, overlap=self.cfg.overlap, stats=stats,
                                     pool=self._pack_pool)
            for bucket, flat, last in buckets:
                if last and not pauses:  # pause_scope=last_bucket: engines stage until here
                    t_paused = time.perf_counter()
                    pauses = self._on_posters("pause_generation", mode=self.pause_mode)
                if pauses and not paused_ok:  # every engine paused before this bucket's POST
                    self._replies(pauses, "pause_generation")
                    paused_ok = True
                if bucket.nbytes > self.cfg.bucket_bytes:
                    oversize += 1
                    if bucket.names[0] not in self._warned:
                        self._warned.add(bucket.names[0])
                        log.warning("weight sync: %s (%d bytes) exceeds bucket_bytes=%d; sent alone in a "
                                    "grown bucket", bucket.names[0], bucket.nbytes, self.cfg.bucket_bytes)
                pending += [
                    (i, self._posters[i].submit(
                        c.update_weights_from_distributed,
                        names=bucket.names,
                        dtypes=bucket.dtypes,
                        shapes=bucket.shapes,
                        group_name=self.group_name,
                        weight_version=weight_version if last else None,
                        flush_cache=last,
                        load_format="flattened_bucket",
                    ))
                    for i, c in enumerate(self.clients)
                ]
                last_posted = last
                if last and pauses:  # each poster sends it right after its engine's versioned reply
                    resumes = self._on_posters("continue_generation")
                tb = time.perf_counter()
                group_broadcast(self.group, flat, src=0)
                bcast_s += time.perf_counter() - tb
                nbytes += flat.numel()
                nbuckets += 1
                if self.on_bucket is not None:
                    self.on_bucket(bucket, last)
            ta = time.perf_counter()
            deadline = time.monotonic() + self.cfg.timeout_s
            for i, f in pending:
                self._check(i, f.result(timeout=max(0.0, deadline - time.monotonic())),
                            "update_weights_from_distributed")
            ack_s = time.perf_counter() - ta
        except BaseException:
            failed = True
            if pending and not last_posted:
                # abandoned mid-update (e.g. the exporter raised): the engines hold staged
                # buckets that no versioned call will apply or drop; leaving the group makes
                # them drop those (embedded engine), so the next update starts clean. The
                # transport must be connect()ed again.
                deadline = time.monotonic() + self.cfg.timeout_s  # one bound for all replies
                for _, f in pending:
                    try:
                        f.result(timeout=max(0.0, deadline - time.monotonic()))
                    except Exception:  # noqa: BLE001 - the original error is what propagates
                        pass
                log.warning("weight sync abandoned before its last bucket: leaving the update group "
                            "(engines drop the staged buckets); connect() before the next send")
                self.close()
            raise
        finally:
            if buckets is not None:
                buckets.close()
            if pauses:  # also after a failure: a paused engine must not stay paused
                if not resumes:  # (not to an engine whose pause request itself raised: gone)
                    gone = {i for i, f in pauses if f.done() and not f.cancelled() and f.exception() is not None}
                    resumes = self._on_posters("continue_generation", skip=gone)
                try:
                    t_resumed = self._replies(resumes, "continue_generation")
                except Exception as e:  # noqa: BLE001
                    if not failed:
                        raise
                    log.warning("weight sync: continue_generation after a failed sync failed too: %s", e)
        t1 = time.perf_counter()
        secs = t1 - t0
        return {
            "sync/bytes": float(nbytes),
            "sync/seconds": secs,
            "sync/gbps": nbytes / secs / 1e9 if secs > 0 else 0.0,
            "sync/pause_seconds": t_resumed - t_paused if pauses else 0.0,
            "sync/buckets": float(nbuckets),
            "sync/broadcast_seconds": bcast_s,
            "sync/ack_wait_seconds": ack_s,
            "sync/pack_seconds": stats["pack_seconds"],
            "sync/pack_wait_seconds": stats["wait_seconds"],
            "sync/oversize_buckets": float(oversize),
            "sync/weight_version": float(weight_version),
        }

    def close(self) -> None:
        """Leave the weight-update group on every engine (``/destroy_weights_update_group``)
        so a later :meth:`connect` (this transport or a new one) can re-create it."""
        if self.group is not None:
            for i, c in enumerate(self.clients):
                try:
                    _post(c, "/destroy_weights_update_group", {"group_name": self.group_name})
                except Exception as e:  # noqa: BLE001 - best effort on the way out
                    log.warning("engine %d: destroy_weights_update_group failed: %s", i, e)
        self.group = None

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self._posters:
            p.shutdown(wait=False, cancel_futures=True)


class DiskTransport(WeightTransport):
    """Fallback: safetensors shards in a directory every engine can read, then SGLang's
    ``POST /update_weights_from_disk {model_path, weight_version, flush_cache}``.

    Each update goes to its own subdirectory ``v{weight_version}`` (shards of at most
    ``bucket_bytes``, a tensor larger than that alone in its shard; the checkpoint's
    ``config.json`` is not needed by the engines here); the previous one is removed after
    the engines confirm. Engines apply the whole directory atomically.
    """

    def __init__(self, clients: Sequence[Any], cfg: WeightSyncConfig, *, pause_mode: str = "abort"):
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
            body = {"model_path": path, "weight_version": weight_version, "flush_cache": True}
            futs = [self._pool.submit(_post, c, "/update_weights_from_disk", body) for c in self.clients]
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


def make_transport(clients: Sequence[Any], cfg: WeightSyncConfig, *, pause_mode: str = "abort",
                   **kw: Any) -> WeightTransport:
    """The transport ``cfg.transport`` names (``broadcast`` | ``disk``), not yet connected."""
    if cfg.transport == "disk":
        return DiskTransport(clients, cfg, pause_mode=pause_mode)
    return BroadcastTransport(clients, cfg, pause_mode=pause_mode, **kw)


def check_engines(clients: Sequence[Any], trainer_checksums: dict[str, str], weight_version: int) -> dict[str, float]:
    """Check mode: every engine serves ``weight_version`` and its per-tensor checksums equal
    the trainer's, bit for bit.

    Returns ``sync/check_seconds`` and ``sync/check_tensors``.
    Raises: WeightSyncError naming the engine, the version and the first differing tensors.
    """
    t0 = time.perf_counter()
    for i, c in enumerate(clients):
        theirs = c.weights_checksum()
        if int(theirs["weight_version"]) != int(weight_version):
            raise WeightSyncError(f"engine {i} serves version {theirs['weight_version']}, trainer is at {weight_version}")
        sums = theirs["checksums"]
        bad = sorted(k for k in set(trainer_checksums) | set(sums) if trainer_checksums.get(k) != sums.get(k))
        if bad:
            raise WeightSyncError(f"engine {i} weights differ from the trainer's at version {weight_version}: "
                                  f"{bad[:5]} ({len(bad)} of {len(trainer_checksums)} tensors)")
    return {"sync/check_seconds": time.perf_counter() - t0, "sync/check_tensors": float(len(trainer_checksums))}
