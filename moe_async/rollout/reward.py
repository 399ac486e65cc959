"""Reward scoring with a per-sample timeout and error isolation.

``await RewardPool(fn, timeout_s, max_workers).score(*args)`` returns a :class:`RewardResult`:
a call that raises or runs past ``timeout_s`` scores 0 with its error recorded and counted, and
costs one sample, never the loop (a timed-out worker process is killed and replaced).

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class RewardResult:
    reward: float
    error: str | None = None
    seconds: float = 0.0


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _worker_main(conn: Connection, fn: Callable) -> None:  # pragma: no cover - runs in a child
    try:
        conn.send(("ready", None))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            args, kwargs = msg
            try:
                conn.send(("ok", float(fn(*args, **kwargs))))
            except BaseException as exc:  # noqa: BLE001 - isolate any scorer failure
                conn.send(("err", _short(exc)))
    except (EOFError, OSError, KeyboardInterrupt):
        return


class _Worker:
    def __init__(self, ctx: Any, fn: Callable):  # ctx: a multiprocessing context
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        try:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass


class RewardPool:
    """Scores samples with ``fn`` under a per-call timeout; design notes: ``docs/design/rollout.md``."""

    def __init__(
        self,
        fn: Callable[..., float],
        timeout_s: float = 10.0,
        max_workers: int = 2,
        use_processes: bool = True,
        mp_context: str = "spawn",
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.fn = fn
        self.timeout_s = float(timeout_s)
        self.max_workers = max(1, int(max_workers))
        self.use_processes = use_processes
        self.counters: dict[str, float] = {
            "calls": 0, "ok": 0, "timeouts": 0, "errors": 0, "workers_killed": 0, "seconds": 0.0,
        }
        self._closed = False
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        if use_processes:
            self._ctx = mp.get_context(mp_context)
            self._idle: list[_Worker] = [_Worker(self._ctx, fn) for _ in range(self.max_workers)]
            # blocking pipe I/O happens here, never on the event loop; never waited on at exit
            self._io = ThreadPoolExecutor(max_workers=2 * self.max_workers, thread_name_prefix="reward-io")

    # ------------------------------------------------------------------ public
    async def score(self, *args: object, **kwargs: object) -> RewardResult:
        """``fn(*args, **kwargs)`` as a :class:`RewardResult`; never raises for scorer faults."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        sem = self._semaphore()
        async with sem:
            t0 = time.monotonic()
            self.counters["calls"] += 1
            if self.use_processes:
                res = await self._score_process(args, kwargs)
            else:
                res = await self._score_thread(args, kwargs)
            res.seconds = time.monotonic() - t0
            self.counters["seconds"] += res.seconds
            if res.error is None:
                self.counters["ok"] += 1
            elif res.error == "timeout":
                self.counters["timeouts"] += 1
            else:
                self.counters["errors"] += 1
            return res

    def metrics(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        """Kill the worker processes (idempotent)."""
        self._closed = True
        if self.use_processes:
            for w in self._idle:
                try:
                    w.conn.send(None)
                except Exception:  # noqa: BLE001
                    pass
                w.kill()
            self._idle = []
            self._io.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:  # pragma: no cover
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001
            pass

    # ----------------------------------------------------------------- helpers
    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem = asyncio.Semaphore(self.max_workers)
            self._sem_loop = loop
        return self._sem

    async def _score_thread(self, args: tuple, kwargs: dict) -> RewardResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def _set(kind: str, val: Any) -> None:
            if not fut.done():
                (fut.set_result if kind == "ok" else fut.set_exception)(val)

        def _run() -> None:
            try:
                v = float(self.fn(*args, **kwargs))
                loop.call_soon_threadsafe(_set, "ok", v)
            except BaseException as exc:  # noqa: BLE001
                try:
                    loop.call_soon_threadsafe(_set, "err", exc)
                except RuntimeError:  # loop closed: the call was abandoned
                    pass

        threading.Thread(target=_run, daemon=True, name="reward-call").start()
        try:
            return RewardResult(await asyncio.wait_for(fut, self.timeout_s))
        except asyncio.TimeoutError:
            log.warning("reward call timed out after %.1fs (abandoned)", self.timeout_s)
            return RewardResult(0.0, "timeout")
        except Exception as exc:  # noqa: BLE001
            return RewardResult(0.0, _short(exc))

    async def _score_process(self, args: tuple, kwargs: dict) -> RewardResult:
        loop = asyncio.get_running_loop()
        w = self._idle.pop() if self._idle else _Worker(self._ctx, self.fn)
        healthy = False
        try:
            if not w.ready:
                ok = await loop.run_in_executor(self._io, w.conn.poll, _STARTUP_TIMEOUT_S)
                if not ok:
                    return RewardResult(0.0, "reward worker did not start")
                kind, _ = await loop.run_in_executor(self._io, w.conn.recv)
                w.ready = kind == "ready"
            await loop.run_in_executor(self._io, w.conn.send, (args, kwargs))
            ready = await loop.run_in_executor(self._io, w.conn.poll, self.timeout_s)
            if not ready:
                log.warning("reward call timed out after %.1fs: killing its worker", self.timeout_s)
                return RewardResult(0.0, "timeout")
            kind, val = await loop.run_in_executor(self._io, w.conn.recv)
            healthy = True
            if kind == "ok":
                return RewardResult(float(val))
            return RewardResult(0.0, str(val))
        except (EOFError, OSError, BrokenPipeError) as exc:
            return RewardResult(0.0, f"reward worker died: {_short(exc)}")
        except Exception as exc:  # noqa: BLE001 - e.g. unpicklable arguments
            log.debug("reward call failed: %s", traceback.format_exc())
            return RewardResult(0.0, _short(exc))
        finally:
            if healthy and not self._closed:
                self._idle.append(w)
            else:
                self.counters["workers_killed"] += 1
                w.kill()
                if not self._closed:
                    self._idle.append(_Worker(self._ctx, self.fn))
