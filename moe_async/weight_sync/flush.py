"""SGLang's deferred cache flush after an ``in_place`` weight update.

Under ``pause_generation(mode="in_place")`` the paused requests keep their KV, and SGLang
0.5.23 refuses a flush while any request holds KV (``Scheduler.flush_cache`` needs
``is_fully_idle``), failing an update call sent with ``flush_cache: true`` after applying it.
So an ``in_place`` sync sends no flush with its calls; after the continue, each engine gets
``POST /flush_cache?timeout=s`` (``SchedulerFlushWrapper``: performed as soon as the engine
is idle, refused when it is not idle within ``s``), which drops the prefix cache of the old
weights. The call runs on a daemon thread per engine (the sync does not wait, an exiting
process neither); :meth:`DeferredFlushes.report` logs the refused ones at the next sync.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

if TYPE_CHECKING:
    from moe_async.protocols import WeightReceiver

log = logging.getLogger(__name__)
_R = TypeVar("_R")


def in_daemon_thread(fn: Callable[..., _R], **kw: object) -> Future[_R]:
    """``fn(**kw)`` on a daemon thread; its Future."""
    fut: Future[_R] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(**kw))
        except BaseException as e:  # noqa: BLE001 - handed to the Future
            fut.set_exception(e)

    threading.Thread(target=run, name="weight-sync-deferred-flush", daemon=True).start()
    return fut


class DeferredFlushes:
    """The deferred flushes of past syncs: ``(engine index, Future[bool], weight_version)``."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, Future[bool], int]] = []

    def start(self, clients: Sequence[WeightReceiver], weight_version: int, timeout_s: float) -> None:
        """``client.flush_cache(timeout_s=timeout_s)`` on every engine, not waited for; not
        on an engine whose previous deferred flush is still waiting (SGLang refuses a second
        one, and the waiting one drops this update's stale prefixes too)."""
        waiting = {i for i, f, _ in self.pending if not f.done()}
        self.pending += [(i, in_daemon_thread(c.flush_cache, timeout_s=timeout_s), weight_version)
                         for i, c in enumerate(clients) if i not in waiting]

    def report(self) -> list[tuple[int, int, str]]:
        """Log (and return as ``(engine, weight_version, why)``) every finished flush that did
        not happen: requests admitted before it may have reused KV of older weights."""
        failed, left = [], []
        for i, f, v in self.pending:
            if not f.done():
                left.append((i, f, v))
                continue
            try:
                ok, why = bool(f.result()), "the engine was not idle within the timeout"
            except Exception as e:  # noqa: BLE001 - reported, the sync goes on
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                failed.append((i, v, why))
                log.warning("engine %d: the prefix cache was not flushed after weight_version %s (%s); "
                            "requests may have reused KV of older weights", i, v, why)
        self.pending = left
        return failed
