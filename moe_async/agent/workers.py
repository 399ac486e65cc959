"""A bounded pool of daemon threads for blocking tool calls and environment steps.

``asyncio.to_thread`` would use the event loop's default executor: a few hung synchronous
tools (a sandbox that never answers) would take all its threads and stall every other user of
it, and ``concurrent.futures`` threads are joined at interpreter exit, so one hung call would
also block shutdown. :class:`WorkerPool` runs calls on at most ``max_workers`` daemon threads
of its own (started on demand, each leaving after ``idle_s`` without work); :meth:`run` waits
at most ``timeout_s`` seconds, time queued for a free worker included, then raises
:class:`WorkerTimeout`. Python cannot stop a thread: a call past its timeout keeps its worker
until it returns (counted in :attr:`WorkerPool.hung`), but the caller does not wait for it
and the process can exit while it runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable


class WorkerTimeout(TimeoutError):
    """A call did not finish within its timeout (the message says whether it was queued)."""


#: A queued call: the function, the caller's loop, the future it awaits, and the call's state
#: flags (``abandoned``, ``started``, ``finished``).
_Job = tuple[Callable[[], object], asyncio.AbstractEventLoop, "asyncio.Future[object]", dict[str, bool]]


class WorkerPool:
    """At most ``max_workers`` daemon threads running blocking calls (module docstring)."""

    def __init__(self, max_workers: int, name: str = "agent-worker", idle_s: float = 5.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self.idle_s = idle_s
        self._q: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self.busy = 0
        self.hung = 0  # calls past their timeout still holding a worker

    def _worker(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._q.empty():
                        self._threads -= 1
                        self._idle -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self.busy += 1
            fn, loop, fut, state = item
            try:
                with self._lock:
                    if state["abandoned"]:
                        continue
                    state["started"] = True
                try:
                    res, exc = fn(), None
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                    res, exc = None, e
                with self._lock:
                    state["finished"] = True
                    if state["abandoned"]:
                        self.hung -= 1
                        continue
                try:
                    loop.call_soon_threadsafe(_settle, fut, res, exc)
                except RuntimeError:  # the loop is closed: nobody waits
                    pass
            finally:
                with self._lock:
                    self.busy -= 1
                    self._idle += 1

    def _submit(self, item: _Job) -> None:
        with self._lock:
            spawn = self._idle == 0 and self._threads < self.max_workers
            if spawn:
                self._threads += 1
                self._idle += 1
            self._q.put(item)
        if spawn:
            threading.Thread(target=self._worker, name=f"{self.name}-{self._threads}", daemon=True).start()

    async def run(self, fn: Callable[[], object], timeout_s: float) -> object:
        """``fn()`` on a worker; its result or exception. Raises
        :class:`WorkerTimeout` after ``timeout_s`` seconds (queued or running)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        state = {"abandoned": False, "started": False, "finished": False}
        self._submit((fn, loop, fut, state))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                state["abandoned"] = True
                started = state["started"]
                if started and not state["finished"]:
                    self.hung += 1
            if isinstance(exc, asyncio.CancelledError):
                raise
            where = ("still running" if started else
                     f"never started: all {self.max_workers} workers busy ({self.hung} hung)")
            raise WorkerTimeout(f"no result within {timeout_s:g} s ({where})") from None


def _settle(fut: asyncio.Future[object], res: object, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)
