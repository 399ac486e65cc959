"""Bucket streams timed and read one bucket ahead (weight sync's export side).

:func:`timed_items` times a bucket iterator in the caller's thread; :class:`ReadAhead` runs
it in a thread one bucket ahead, two send buffers in turn. Both add ``pack_seconds`` (making
buckets) and ``wait_seconds`` (the consumer waiting) to a stats dict, in seconds; an error
in the producer is raised by the consumer's next ``next()``.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Generator, Iterator, TypeVar

import torch

from moe_async.weight_sync.bucket import Bucket

Tensor = torch.Tensor
T = TypeVar("T")


def timed_items(it: Iterator[T], stats: dict[str, float]) -> Generator[T, None, None]:
    """``it``'s items, the time spent waiting for each added to ``stats['pack_seconds']`` and
    ``stats['wait_seconds']``; an item is not held while the next one is made."""
    while True:
        t0 = time.perf_counter()
        item = next(it, None)
        dt = time.perf_counter() - t0
        stats["pack_seconds"] += dt
        stats["wait_seconds"] += dt
        if item is None:
            return
        yield item
        item = None  # not held while the next bucket is made (the memory bound counts on it)


_END = object()


class ReadAhead:
    """Runs a bucket generator one bucket ahead in a thread (two buffers: the semaphore's two
    tokens; the consumer gives one back when it asks for the next bucket). ``make(sem)``: the
    generator, taking a token per buffer it fills; ``stats``: ``pack_seconds``/``wait_seconds``
    added to; ``abandon()``: called by :meth:`close` before the generator finished (its
    buffers may still be written: never reuse them)."""

    def __init__(self, make: Callable[[threading.Semaphore], Iterator], stats: dict[str, float],
                 abandon: Callable[[], None]):
        self.abandon = abandon
        self.sem = threading.Semaphore(2)
        self.q: queue.Queue = queue.Queue()
        self.stats = stats
        self.held = False
        self.done = self.finished = False
        self.th = threading.Thread(target=self._run, args=(make(self.sem),), name="weight-sync-export", daemon=True)
        self.th.start()

    def _run(self, it: Iterator) -> None:
        try:
            t0 = time.perf_counter()
            for item in it:
                self.stats["pack_seconds"] += time.perf_counter() - t0
                if self.done:
                    return
                self.q.put(item)
                item = None  # not held while the next bucket is made
                t0 = time.perf_counter()
            self.q.put(_END)
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            self.q.put(e)

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> tuple[Bucket, Tensor, bool]:
        if self.held:
            self.sem.release()
            self.held = False
        if self.done:
            raise StopIteration
        t0 = time.perf_counter()
        item = self.q.get()
        self.stats["wait_seconds"] += time.perf_counter() - t0
        if item is _END:
            self.done = self.finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.held = True
        return item

    def close(self) -> None:
        if not self.finished:  # the producer may still write into its buffers: never reuse them
            self.abandon()
        self.done = True
        self.sem.release()  # a producer waiting for a buffer goes on and sees ``done``
        self.sem.release()
