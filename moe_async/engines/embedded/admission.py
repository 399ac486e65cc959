"""Who may run while weights change: SGLang 0.5.23's tokenizer-side pause and update lock.

Mirrors SGLang's ``TokenizerManager`` and its ``RWLock``: a ``/generate`` waits while paused and
then holds the reader side until it finishes; an update made without a pause takes the writer
side (waits for every request in flight), so an update never switches a running request's
weights unless the sender paused the engine first.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable


class RWLock:
    """Writer-preferring asyncio reader/writer lock (the semantics of SGLang's ``RWLock``)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writer = False
        self.waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer and self.waiting_writers == 0)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                if self.readers == 0:
                    self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer_lock(self) -> AsyncIterator[None]:
        async with self._cond:
            self.waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self.writer and self.readers == 0)
                self.writer = True
            finally:
                self.waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self.writer = False
                self._cond.notify_all()


class Admission:
    """The engine's pause flag and model-update lock (``docs/design/engines.md``)."""

    def __init__(self) -> None:
        self.is_pause = False
        self.pause_cond = asyncio.Condition()
        self.lock = RWLock()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Around one ``/generate`` request: wait while paused, then hold a reader."""
        async with self.pause_cond:
            await self.pause_cond.wait_for(lambda: not self.is_pause)
        async with self.lock.reader():
            yield

    @contextlib.asynccontextmanager
    async def update(self, exclusive: bool = True) -> AsyncIterator[bool]:
        """Around one update call. Paused: under the pause condition (a continue waits);
        else, when ``exclusive``, the writer side (waits for in-flight requests). Yields
        whether the engine was paused."""
        async with self.pause_cond:
            if self.is_pause:
                yield True
                return
        if not exclusive:
            yield False
            return
        async with self.lock.writer_lock():
            yield False

    async def pause(self, dispatch: Callable[[], Awaitable[object]]) -> None:
        """Set ``is_pause`` (new requests wait), then ``dispatch`` (the scheduler's pause)."""
        async with self.pause_cond:
            self.is_pause = True
            await dispatch()

    async def resume(self, dispatch: Callable[[], Awaitable[object]]) -> None:
        """Clear ``is_pause``, ``dispatch`` (the scheduler's continue), wake waiting requests;
        waits for an update running under the pause to finish first."""
        async with self.pause_cond:
            self.is_pause = False
            await dispatch()
            self.pause_cond.notify_all()
