"""Buckets ready to broadcast: grouping, packing into reused flat buffers, overlap.

``packed_buckets`` pulls named tensors from an exporter, groups them (``make_buckets``:
greedy, order kept, an oversize tensor alone), and packs each bucket into a flat ``uint8``
tensor on the tensors' own device (the transport's: CUDA for NCCL, CPU for gloo; see
:func:`~moe_async.weight_sync.group.transport_device`), in a background thread one bucket
ahead of the broadcast. Tensors already end to end in one storage are sent zero-copy
(``contiguous_span``); ``in_layout_order`` re-orders a stream to an engine's layout.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Generator, Iterable, Iterator, Protocol, Sequence

import torch

from moe_async.weight_sync.bucket import Bucket, make_buckets


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

    def pack(self, slot: int, bucket: Bucket, device: torch.device | None = None) -> torch.Tensor:
        """The bucket's flat ``uint8`` bytes on ``device`` (default: its first tensor's):
        zero-copy when it is one tensor or one span already there, else packed into slot
        ``slot``'s buffer (allocated on ``device``)."""
        dev = torch.device(device) if device is not None else bucket.tensors[0].device
        if len(bucket.tensors) == 1:
            flat = bucket.flatten()
            return flat if flat.device == dev else flat.to(dev)
        span = contiguous_span(bucket.tensors)
        if span is not None and span.device == dev:  # already end to end in one storage (the send buffer)
            return span
        n = bucket.nbytes
        buf = self.bufs[slot]
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
    return torch.empty(0, dtype=torch.uint8, device=t0.device).set_(st, start, (end - t0.data_ptr(),), (1,))


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


class BucketStream(Protocol):
    """Buckets ready to send: iterates ``(bucket, flat_uint8, is_last)``; ``close()`` stops a
    producer that runs ahead (safe to call at any point, also twice). ``flat`` is None for a
    bucket another sender broadcasts (its metadata only: :mod:`~moe_async.weight_sync.senders`)."""

    def __iter__(self) -> Iterator[tuple[Bucket, torch.Tensor | None, bool]]: ...

    def __next__(self) -> tuple[Bucket, torch.Tensor | None, bool]: ...

    def close(self) -> None: ...


def packed_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    overlap: bool = True,
    stats: dict[str, float] | None = None,
    pool: PackPool | None = None,
    device: torch.device | None = None,
) -> BucketStream:
    """Yield ``(bucket, flat_uint8, is_last)`` for every bucket of ``named_tensors``.

    With ``overlap`` the producer (pulling from ``named_tensors``: for the trainer, the
    gather/convert/cast of ``export_hf_weights``; then packing) runs in a background thread
    ahead of the consumer (queue depth 1: double buffering), so packing bucket k+1 overlaps
    whatever the consumer does with bucket k (the broadcast); the thread starts when this
    function returns (the first bucket is being made while the caller pauses the engines),
    and the returned iterator's ``close()`` stops it. A yielded ``flat`` is valid
    until the consumer asks for the next bucket; it lies on ``device`` (the transport's:
    CUDA for NCCL, CPU for gloo; default: each bucket's first tensor's device) (its buffer is then reused, see
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
    return _Overlapped(it, stats, pool, device) if overlap else _serial(it, stats, pool, device)


def _serial(it: Iterator[tuple[Bucket, bool]], stats: dict, pool: PackPool,
            device: torch.device | None = None) -> Generator[tuple[Bucket, torch.Tensor, bool], None, None]:
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        flat = None if b is None else pool.pack(0, b[0], device)
        dt = time.perf_counter() - t0
        stats["pack_seconds"] += dt
        stats["wait_seconds"] += dt
        if b is None or flat is None:
            return
        yield b[0], flat, b[1]


class _Overlapped:
    """Iterator of :func:`packed_buckets` with overlap: its producer thread starts at once
    (on construction, not on the first ``next``), so the exporter already runs while the
    caller does something else first (e.g. pauses the engines). ``close()`` stops the thread."""

    def __init__(self, it: Iterator[tuple[Bucket, bool]], stats: dict, pool: PackPool,
                 device: torch.device | None = None):
        self.stats, self.pool, self.device = stats, pool, device
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
                item = _END if b is None else (b[0], pool.pack(slot, b[0], self.device), b[1], slot)
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
