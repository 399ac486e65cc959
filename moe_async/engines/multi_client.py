"""Several engines behind one async client (:class:`MultiEngineClient`): least-loaded
``generate``, control calls fanned out to every engine."""

from __future__ import annotations

import asyncio

from moe_async.engines.client import EngineClient, EngineReply
from moe_async.engines.replies import GenerateOutput


class MultiEngineClient:
    """Several engines behind one async client: least-loaded dispatch of ``generate``.

    Each ``generate`` goes to the engine with the fewest requests in flight *from this
    client* (ties: the lowest index, rotated so equal loads spread). Control calls (pause,
    continue, flush, version) fan out to every engine and return their per-engine results.
    On GPU clusters ``sglang-router`` (``python -m sglang_router.launch_router
    --worker-urls ...``) does the same job for SGLang engines; pointing a single
    :class:`EngineClient` at the router is equivalent, except that weight-update calls must
    still go to each engine's own URL.
    """

    def __init__(self, urls: list[str], timeout_s: float = 600.0, **kw):
        if not urls:
            raise ValueError("MultiEngineClient needs at least one engine URL")
        self.clients = [EngineClient(u, timeout_s, **kw) for u in urls]
        self.inflight = [0] * len(urls)
        self._next = 0

    def pick(self) -> int:
        n = len(self.clients)
        order = [(self._next + j) % n for j in range(n)]
        i = min(order, key=lambda k: self.inflight[k])
        self._next = (i + 1) % n
        return i

    async def generate(self, *args, **kw) -> GenerateOutput:
        i = self.pick()
        self.inflight[i] += 1
        try:
            return await self.clients[i].generate(*args, **kw)
        finally:
            self.inflight[i] -= 1

    async def health(self) -> list[bool]:
        return list(await asyncio.gather(*[c.health() for c in self.clients]))

    async def pause_generation(self, mode: str = "abort") -> list[EngineReply]:
        return list(await asyncio.gather(*[c.pause_generation(mode) for c in self.clients]))

    async def continue_generation(self) -> list[EngineReply]:
        return list(await asyncio.gather(*[c.continue_generation() for c in self.clients]))

    async def flush_cache(self) -> list[bool]:
        return list(await asyncio.gather(*[c.flush_cache() for c in self.clients]))

    async def get_weight_version(self) -> list[int]:
        return list(await asyncio.gather(*[c.get_weight_version() for c in self.clients]))

    async def aclose(self) -> None:
        await asyncio.gather(*[c.aclose() for c in self.clients])

    async def __aenter__(self) -> "MultiEngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
