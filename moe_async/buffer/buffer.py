"""RolloutBuffer: the only meeting point of generation and training.

Admission: a group may start only while ``admitted - retired < (v - v0 + K + 1) * B`` (engine
version ``v``, start version ``v0``, ``K = max_staleness``, ``B`` groups per step), so a group is
trained at most K versions after it was admitted, also after a resume (AReaL's staleness
control). Batches are whole groups, FIFO; a group whose oldest token is more than K versions
behind the trainer is dropped and counted. The wait for a batch is split into "filling" and
"straggler" seconds.

Design notes: ``docs/design/buffer.md``."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Callable, TypeVar, TypedDict

from moe_async.buffer.wait_split import WaitSplit, split_batch_wait
from moe_async.types import Group


STOPPED = "stopped"  # cancel() reason of a group that was in flight when generation stopped


class BufferStats(TypedDict):
    """:meth:`RolloutBuffer.stats`: group and sample counters (counts), the drop reasons and the
    staleness histogram (versions behind -> groups), the last hand-out's waits (seconds)."""

    engine_version: int
    capacity: int
    admitted: int
    retired: int
    in_flight: int
    buffered_groups: int
    groups_put: int
    groups_trained: int
    groups_dropped: int
    samples_generated: int
    samples_trained: int
    samples_dropped: int
    samples_buffered: int
    drop_reasons: dict[str, int]
    in_flight_at_stop: int
    staleness_hist: dict[int, int]
    wait_filling_s: float
    wait_straggler_s: float


class BufferState(TypedDict):
    """:meth:`RolloutBuffer.state_dict`: the engine weight_version and the bounds ``B``, ``K``."""

    engine_version: int
    B: int
    K: int


class RolloutBuffer:
    """Bounded, staleness-checked FIFO of GRPO groups.

    Args:
        groups_per_step: ``B``, groups handed to the trainer per step (> 0).
        max_staleness: ``K`` >= 0, in weight versions.
        start_version: ``v0``, the weight_version at (re)start.
        clock: seconds (monotonic) for the wait split; ``time.monotonic`` by default.

    Raises:
        ValueError: on ``groups_per_step < 1`` or ``max_staleness < 0``.
    """

    def __init__(self, groups_per_step: int, max_staleness: int, start_version: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.B = groups_per_step
        self.K = max_staleness
        self.v0 = start_version
        self.engine_version = start_version
        self._queue: deque[Group] = deque()
        self.admitted = 0
        self.retired = 0
        self.cancelled = 0
        self.groups_put = 0
        self.groups_trained = 0
        self.groups_dropped = 0
        self.samples_generated = 0
        self.samples_trained = 0
        self.samples_dropped = 0
        self.drop_reasons: Counter[str] = Counter()
        self.in_flight_at_stop = 0
        self.stale_draws: list[int] = []  # draw numbers of groups dropped as stale, until drained
        self.staleness_hist: Counter[int] = Counter()
        self._clock = clock
        self._put_at: dict[int, float] = {}  # id(group) -> when it was put (for the wait split)
        self._wait_since: float | None = None  # when the trainer began waiting for the next batch
        self.last_wait = WaitSplit(0.0, 0.0)  # the last hand-out's filling/straggler seconds

    # ---- admission (rollout side) -------------------------------------------------
    @property
    def capacity(self) -> int:
        """Groups that may be admitted-and-not-retired at the current engine version."""
        return (self.engine_version - self.v0 + self.K + 1) * self.B

    def admit(self) -> int | None:
        """Reserve a slot for one group. Returns the engine weight_version it starts at,
        or ``None`` when the staleness bound forbids starting another group now."""
        if self.admitted - self.retired >= self.capacity:
            return None
        self.admitted += 1
        return self.engine_version

    def cancel(self, reason: str = "cancelled") -> None:
        """Give back an admitted slot whose group will never be put (e.g. prompt too long).

        ``reason`` is counted in ``drop_reasons``, except :data:`STOPPED` (the group was in
        flight when generation stopped), counted in ``in_flight_at_stop``."""
        self.retired += 1
        self.cancelled += 1
        if reason == STOPPED:
            self.in_flight_at_stop += 1
        else:
            self.drop_reasons[reason] += 1

    def put(self, group: Group) -> None:
        """Add a finished group (all samples scored)."""
        for s in group.samples:
            s.validate()
        self._queue.append(group)
        self._put_at[id(group)] = self._clock()
        self.groups_put += 1
        self.samples_generated += len(group.samples)

    def set_engine_version(self, version: int) -> None:
        """Record that the engines now serve ``version`` (after a weight sync)."""
        if version < self.engine_version:
            raise ValueError(f"engine version went back: {self.engine_version} -> {version}")
        self.engine_version = version

    # ---- hand-out (trainer side) --------------------------------------------------
    def _drop_stale(self, trainer_version: int) -> None:
        keep: deque[Group] = deque()
        for g in self._queue:
            if trainer_version - g.oldest_version > self.K:
                self.groups_dropped += 1
                self.samples_dropped += len(g.samples)
                self.retired += 1
                self.drop_reasons["stale"] += 1
                seq = g.samples[0].metadata.get("draw_seq") if g.samples else None
                if seq is not None:  # the run's draw ledger (orchestration/run_state.py)
                    self.stale_draws.append(int(seq))
                self._put_at.pop(id(g), None)
            else:
                keep.append(g)
        self._queue = keep

    def get_batch(self, trainer_version: int) -> list[Group] | None:
        """Pop ``B`` groups for a training step at ``trainer_version``, oldest first.

        Stale groups (oldest token more than ``K`` versions behind) are dropped and counted
        first. Returns ``None`` when fewer than ``B`` fresh groups are buffered. A hand-out
        sets ``last_wait``, the wait counted from the first call since the previous one.
        """
        now = self._clock()
        if self._wait_since is None:
            self._wait_since = now
        self._drop_stale(trainer_version)
        if len(self._queue) < self.B:
            return None
        batch = [self._queue.popleft() for _ in range(self.B)]
        self.last_wait = split_batch_wait(
            self._wait_since, now, [self._put_at.pop(id(g), now) for g in batch],
            [trainer_version - g.oldest_version for g in batch], self.K)
        self._wait_since = None
        for g in batch:
            self.groups_trained += 1
            self.samples_trained += len(g.samples)
            for s in g.samples:
                for v, m in zip(s.weight_versions, s.response_mask()):
                    if m:  # sampled tokens only (a trajectory's observations are not generated)
                        self.staleness_hist[trainer_version - v] += 1
        return batch

    # ---- state --------------------------------------------------------------------
    def buffered_groups(self) -> list[Group]:
        """The groups put and not handed out, oldest first (a checkpoint's buffer contents:
        :mod:`moe_async.buffer.snapshot`)."""
        return list(self._queue)

    def restore_groups(self, groups: list[Group], trainer_version: int) -> None:
        """A resumed run's buffer contents (saved by :func:`moe_async.buffer.snapshot.snapshot`):
        each group counts as admitted and put in this buffer (so the admission bound and the
        accounting invariant include it), in the given order; then the groups more than ``K``
        versions behind ``trainer_version`` are dropped as stale (counted, draws reported)."""
        for g in groups:
            self.admitted += 1
            self.put(g)
        self._drop_stale(trainer_version)

    @property
    def num_buffered_groups(self) -> int:
        return len(self._queue)

    @property
    def samples_buffered(self) -> int:
        return sum(len(g.samples) for g in self._queue)

    def stats(self) -> BufferStats:
        """Counters for logging and the accounting invariant."""
        return {
            "engine_version": self.engine_version,
            "capacity": self.capacity,
            "admitted": self.admitted,
            "retired": self.retired,
            "in_flight": self.admitted - self.cancelled - self.groups_put,
            "buffered_groups": len(self._queue),
            "groups_put": self.groups_put,
            "groups_trained": self.groups_trained,
            "groups_dropped": self.groups_dropped,
            "samples_generated": self.samples_generated,
            "samples_trained": self.samples_trained,
            "samples_dropped": self.samples_dropped,
            "samples_buffered": self.samples_buffered,
            "drop_reasons": dict(self.drop_reasons),
            "in_flight_at_stop": self.in_flight_at_stop,
            "staleness_hist": dict(self.staleness_hist),
            "wait_filling_s": self.last_wait.filling,
            "wait_straggler_s": self.last_wait.straggler,
        }

    def state_dict(self) -> BufferState:
        """The version and the bounds (the buffered groups and the counters are saved by
        :mod:`moe_async.buffer.snapshot`; groups in flight are not kept: regenerated)."""
        return {"engine_version": self.engine_version, "B": self.B, "K": self.K}

    @classmethod
    def from_state_dict(cls, state: BufferState) -> "RolloutBuffer":
        """Restart at the saved version; admission counts restart from zero."""
        v = int(state["engine_version"])
        return cls(int(state["B"]), int(state["K"]), start_version=v)


_T = TypeVar("_T")


class AsyncRolloutBuffer:
    """A :class:`RolloutBuffer` for one asyncio event loop whose waits are woken by the
    events that can end them, not by polling: ``put`` wakes :meth:`get_batch_wait`;
    ``set_engine_version``, ``cancel`` and stale drops (slots given back) wake
    :meth:`admit_wait`. Used by the Ray buffer actor, so neither the trainer nor the
    rollout side loses a poll interval per step (in ``sync`` mode both waits are on the
    step's critical path)."""

    def __init__(self, groups_per_step: int, max_staleness: int, start_version: int = 0):
        self.buf = RolloutBuffer(groups_per_step, max_staleness, start_version)
        self._changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_for(self, attempt: Callable[[], _T | None], timeout_s: float) -> _T | None:
        """``attempt()`` now and after every change until it is not ``None``, or ``None``
        once ``timeout_s`` seconds have passed."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                out = attempt()
                left = deadline - time.monotonic()
                if out is not None or left <= 0:
                    return out
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def admit_wait(self, timeout_s: float) -> int | None:
        """:meth:`RolloutBuffer.admit`, waiting up to ``timeout_s`` s for capacity."""
        return await self._wait_for(self.buf.admit, timeout_s)

    async def get_batch_wait(self, trainer_version: int, timeout_s: float) -> list[Group] | None:
        """:meth:`RolloutBuffer.get_batch`, waiting up to ``timeout_s`` s for ``B`` fresh groups."""
        retired = self.buf.retired
        batch = await self._wait_for(lambda: self.buf.get_batch(trainer_version), timeout_s)
        if self.buf.retired != retired:  # stale groups dropped: their slots reopen admission
            await self._notify()
        return batch

    async def put(self, group: Group) -> None:
        self.buf.put(group)
        await self._notify()

    async def cancel(self, reason: str = "cancelled") -> None:
        self.buf.cancel(reason)
        await self._notify()

    async def set_engine_version(self, version: int) -> None:
        self.buf.set_engine_version(version)
        await self._notify()
