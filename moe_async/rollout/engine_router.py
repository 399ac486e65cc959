"""Request routing of the rollout manager: which engine serves a ``/generate``, and its failures.

:class:`EngineRouter` sends each request round-robin to a routable engine (the routing mask is
set by the driver's engine recovery and by failed requests); a transport failure takes that
engine out of routing and retries on another; with none routable it waits for one to come
back, then drops the group (:class:`~moe_async.rollout.failures.DropGroup` ``engine_lost``). It keeps the busy clocks
(:class:`EngineBusy`, seconds) and the request counters the manager reports.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence

from moe_async.engines.replies import GenerateOutput
from moe_async.logging.timeline import SpanRecorder
from moe_async.protocols import GenerateEngine
from moe_async.rollout.failures import DropGroup, EngineTimeoutError

log = logging.getLogger("moe_async.rollout.manager")


def is_timeout(exc: BaseException) -> bool:
    import httpx

    return isinstance(exc, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException))


def engine_lost(exc: BaseException) -> bool:
    """A failure that says the engine process is gone (not a timeout, not a bad request):
    connection refused/reset, a broken reply, HTTP 5xx."""
    import httpx

    from moe_async.engines.client import EngineRequestError

    if isinstance(exc, httpx.TimeoutException):
        return False
    if isinstance(exc, (httpx.TransportError, ConnectionError)):
        return True
    return isinstance(exc, EngineRequestError) and exc.status_code >= 500


class EngineBusy:
    """Wall-clock seconds during which at least one request was outstanding (per engine, or
    over all engines for the manager's generation span); overlapping requests count once."""

    def __init__(self) -> None:
        self.outstanding = 0
        self.since = 0.0
        self.busy_s = 0.0

    def enter(self) -> None:
        if self.outstanding == 0:
            self.since = time.monotonic()
        self.outstanding += 1

    def exit(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.busy_s += time.monotonic() - self.since

    def total(self) -> float:
        return self.busy_s + (time.monotonic() - self.since if self.outstanding else 0.0)


class EngineRouter:
    """Args:
        engines: the engine clients (:class:`~moe_async.protocols.GenerateEngine`), by index.
        no_engine_wait_s: seconds a request waits for a routable engine before ``engine_lost``.
        trace: the manager's span recorder (a ``generate`` span per request and engine).
        counters: the manager's counters (``requests``, ``requests/<i>``,
            ``engine_request_retries`` added here).
    """

    def __init__(self, engines: Sequence[GenerateEngine], no_engine_wait_s: float, trace: SpanRecorder,
                 counters: Counter):
        self.engines = list(engines)
        self.no_engine_wait_s = no_engine_wait_s
        self.trace = trace
        self.counters = counters
        self.routable = [True] * len(self.engines)  # the driver's (and failures') routing mask
        self.busy = [EngineBusy() for _ in self.engines]
        self.gen_busy = EngineBusy()  # any engine: the wall-clock span of generation
        self.request_seconds_sum = 0.0  # summed over requests (concurrent ones add up)
        self._rr = itertools.count()

    def set_routable(self, i: int, ok: bool) -> None:
        """Put engine ``i`` into routing (``ok``) or take it out; requests already sent to it
        are not affected (a dead engine's fail and are retried elsewhere).
        Raises ValueError for an index out of range."""
        if not 0 <= i < len(self.engines):
            raise ValueError(f"engine index {i} out of range 0..{len(self.engines) - 1}")
        self.routable[i] = bool(ok)

    def metrics(self) -> dict[str, float]:
        """``rollout/gen_wall_seconds``, ``request_seconds_sum``, ``requests_in_flight`` (now)
        and ``engine_busy_s/<i>`` (seconds; see :meth:`RolloutManager.metrics`)."""
        # wall-clock seconds with >= 1 request outstanding on any engine (<= elapsed time);
        # the per-request sum exceeds wall time when requests overlap
        m = {"rollout/gen_wall_seconds": self.gen_busy.total(), "rollout/request_seconds_sum": self.request_seconds_sum,
             "rollout/requests_in_flight": float(self.gen_busy.outstanding)}  # now, over all engines
        for i, b in enumerate(self.busy):
            m[f"rollout/engine_busy_s/{i}"] = b.total()
        return m

    def _pick_engine(self) -> int | None:
        """The next routable engine, round-robin; None when none is routable."""
        n = len(self.engines)
        for _ in range(n):
            i = next(self._rr) % n
            if self.routable[i]:
                return i
        return None

    async def call(self, ids: list[int], sp: dict[str, object], routed: bool = False,
                   lora_path: str | None = None) -> GenerateOutput:
        """One ``/generate`` on a routable engine; a transport failure (the engine died) takes
        that engine out of routing and retries on another (``docs/design/rollout.md``, step 2). With no
        engine routable it waits up to ``no_engine_wait_s`` seconds for the driver to put one
        back (a restart), polling every 0.2 s.

        Raises: DropGroup("engine_lost") when none came back in time, or after
        ``2 * engines + 1`` failed attempts; EngineTimeoutError."""
        attempts, waited_since = 0, None
        while attempts <= 2 * len(self.engines):
            i = self._pick_engine()
            if i is None:
                waited_since = waited_since if waited_since is not None else time.monotonic()
                if time.monotonic() - waited_since > self.no_engine_wait_s:
                    break
                await asyncio.sleep(0.2)
                continue
            waited_since = None
            attempts += 1
            try:
                return await self._call_one(i, ids, sp, routed, lora_path)
            except Exception as exc:
                if not engine_lost(exc):
                    raise
                self.routable[i] = False
                self.counters["engine_request_retries"] += 1
                log.warning("engine %d (%s) failed a request (%s: %s): out of routing, retrying elsewhere", i,
                            getattr(self.engines[i], "base_url", "?"), type(exc).__name__, str(exc)[:200])
        raise DropGroup("engine_lost")

    async def _call_one(self, i: int, ids: list[int], sp: dict[str, object], routed: bool,
                        lora_path: str | None) -> GenerateOutput:
        busy = self.busy[i]
        busy.enter()
        self.gen_busy.enter()
        t0, w0 = time.monotonic(), self.trace.now()
        try:
            lora = {"lora_path": lora_path} if lora_path is not None else {}
            return await self.engines[i].generate(ids, sp, return_logprob=True, return_routed_experts=routed, **lora)
        except Exception as exc:
            if not is_timeout(exc) or isinstance(exc, EngineTimeoutError):
                raise
            eng = self.engines[i]
            raise EngineTimeoutError(
                f"engine {i} ({eng.base_url}) /generate: no reply within "
                f"{eng.timeout_s} s (engine.request_timeout_s); {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.request_seconds_sum += time.monotonic() - t0
            self.trace.add(f"engine {i}", "generate", w0, self.trace.now())
            self.gen_busy.exit()
            busy.exit()
            self.counters["requests"] += 1
            self.counters[f"requests/{i}"] += 1  # per engine: a replacement's share after it rejoined
