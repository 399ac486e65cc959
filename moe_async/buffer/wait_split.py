"""Where the trainer's wait for a batch went: "filling" vs "straggler" seconds.

The trainer waits from ``wait_start`` until its batch of ``B`` groups is handed out at
``wait_end``. While some group of the batch that still has staleness room is missing, the
buffer is *filling* (generation throughput is what the trainer waits for). Once every
missing group is *at its staleness limit* (``trainer_version - oldest_version >= K`` with
``K = max_staleness > 0``: it must be trained in this batch or dropped), the trainer waits
only for those long-running groups: *straggler* time. With ``K = 0`` no group can be older
than the trainer, so there are no stragglers and the whole wait is filling.

Since the set of missing groups only shrinks, the straggler part is one interval: from the
moment the last batch group with room was done (or the wait began, if later) to the moment
the last group was done (at most ``wait_end``). Filling is the rest of the wait, so the two
always add up to the whole wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class WaitSplit:
    """Seconds of one batch wait: ``filling + straggler == total`` (all >= 0)."""

    filling: float
    straggler: float

    @property
    def total(self) -> float:
        return self.filling + self.straggler


def split_batch_wait(wait_start: float, wait_end: float, done_at: Sequence[float],
                     staleness: Sequence[int], max_staleness: int) -> WaitSplit:
    """Split the wait ``[wait_start, wait_end]`` (seconds, one clock) for a batch.

    Args:
        wait_start, wait_end: when the trainer began waiting and when the batch was handed out.
        done_at: per group of the batch, when it was done (put into the buffer), same clock.
        staleness: per group, ``trainer_version - group.oldest_version`` at hand-out.
        max_staleness: ``K``, the buffer's bound.

    Returns:
        :class:`WaitSplit` whose parts add up to ``max(0, wait_end - wait_start)``.

    Raises:
        ValueError: when ``done_at`` and ``staleness`` differ in length.
    """
    if len(done_at) != len(staleness):
        raise ValueError(f"{len(done_at)} completion times for {len(staleness)} groups")
    total = max(0.0, wait_end - wait_start)
    if max_staleness <= 0 or not done_at:
        return WaitSplit(total, 0.0)
    with_room = [t for t, s in zip(done_at, staleness) if s < max_staleness]
    strag_from = max([wait_start, *with_room])
    last_done = min(wait_end, max(done_at))
    straggler = min(total, max(0.0, last_done - strag_from))
    return WaitSplit(total - straggler, straggler)


def scale_to_wait(split: WaitSplit, wait_seconds: float) -> WaitSplit:
    """The same split for a wait measured on another clock (the driver's, which adds the
    call latency): the straggler seconds kept (at most ``wait_seconds``), filling the rest."""
    straggler = min(max(0.0, wait_seconds), split.straggler)
    return WaitSplit(max(0.0, wait_seconds) - straggler, straggler)


def wait_split_metrics(buffer_stats: dict, wait_seconds: float) -> dict[str, float]:
    """``perf/wait_filling_seconds`` and ``perf/wait_straggler_seconds`` of one step: the
    buffer's split of its last hand-out (``stats()`` ``wait_filling_s`` / ``wait_straggler_s``)
    carried onto the driver's ``perf/wait_seconds``, which the two add up to."""
    s = scale_to_wait(WaitSplit(float(buffer_stats.get("wait_filling_s", 0.0)),
                                float(buffer_stats.get("wait_straggler_s", 0.0))), wait_seconds)
    return {"perf/wait_filling_seconds": s.filling, "perf/wait_straggler_seconds": s.straggler}
