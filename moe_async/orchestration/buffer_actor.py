"""The buffer's Ray actor and the rollout manager's view of it.

:class:`BufferActor` is the Ray home of :class:`moe_async.buffer.buffer.AsyncRolloutBuffer`
(``num_cpus=0``, an async actor: waiting callers do not block admissions); it adapts the
plain buffer to Ray and holds no logic of its own. :class:`BufferProxy` gives the
:class:`~moe_async.rollout.manager.RolloutManager` the async ``admit/put/cancel`` interface
over a handle of it (:class:`~moe_async.protocols.GroupBuffer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from moe_async.types import Group, JsonDict

if TYPE_CHECKING:
    from moe_async.buffer.buffer import BufferStats
    from moe_async.buffer.snapshot import BufferSnapshot


@ray.remote(num_cpus=0)
class BufferActor:
    """Ray home of :class:`moe_async.buffer.buffer.AsyncRolloutBuffer` (an async actor, so
    waiting callers do not block admissions; waits are woken by puts, version bumps and
    cancels, not polled)."""

    def __init__(self, groups_per_step: int, max_staleness: int, start_version: int = 0):
        from moe_async.buffer.buffer import AsyncRolloutBuffer

        self.abuf = AsyncRolloutBuffer(groups_per_step, max_staleness, start_version)

    async def admit(self) -> int | None:
        return self.abuf.buf.admit()

    async def admit_wait(self, timeout_s: float) -> int | None:
        """Like ``admit`` but waits up to ``timeout_s`` seconds for capacity to open."""
        return await self.abuf.admit_wait(timeout_s)

    async def cancel(self, reason: str = "cancelled") -> None:
        await self.abuf.cancel(reason)

    async def put(self, group: Group) -> None:
        await self.abuf.put(group)

    async def set_engine_version(self, version: int) -> None:
        await self.abuf.set_engine_version(version)

    async def get_batch(self, trainer_version: int, timeout_s: float) -> list[Group] | None:
        """Wait up to ``timeout_s`` seconds for ``B`` fresh groups; ``None`` on time-out."""
        return await self.abuf.get_batch_wait(trainer_version, timeout_s)

    async def stats(self) -> BufferStats:
        return self.abuf.buf.stats()

    async def snapshot(self) -> BufferSnapshot:
        """The buffered groups and counters for a checkpoint (:func:`moe_async.buffer.snapshot.snapshot`)."""
        from moe_async.buffer.snapshot import snapshot

        return snapshot(self.abuf.buf)

    async def restore(self, snap: JsonDict, trainer_version: int) -> dict[str, int]:
        """Put a checkpoint's buffered groups back, stale ones at ``trainer_version`` dropped
        (:func:`moe_async.buffer.snapshot.restore`); before generation starts."""
        from moe_async.buffer.snapshot import restore

        return restore(self.abuf.buf, snap, trainer_version)

    async def drain_stale_draws(self) -> list[int]:
        """Draw numbers of the groups dropped as stale since the last call (run_state.DrawLedger)."""
        out, self.abuf.buf.stale_draws = self.abuf.buf.stale_draws, []
        return out


class BufferProxy:
    """The async ``admit/put/cancel`` interface the RolloutManager expects, over a Ray
    handle of :class:`BufferActor`. ``admit`` waits in the actor up to ``admit_wait_s``
    seconds for capacity (``admit_waits`` tells the manager not to sleep after a refusal)."""

    admit_waits = True

    def __init__(self, handle: Any, admit_wait_s: float = 1.0):
        self.h = handle
        self.admit_wait_s = admit_wait_s

    async def admit(self) -> int | None:
        return await self.h.admit_wait.remote(self.admit_wait_s)

    async def put(self, group: Group) -> None:
        await self.h.put.remote(group)

    async def cancel(self, reason: str = "cancelled") -> None:
        await self.h.cancel.remote(reason)
