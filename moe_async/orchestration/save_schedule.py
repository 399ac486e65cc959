"""When the driver writes the whole-run checkpoint: every ``trainer.save_interval`` steps and at
the last step, and on a stop (pre-emption) for the last finished step unless that one is
already written or is the step the run resumed from. Pure: no I/O, no actors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SaveSchedule:
    """``save_interval``: ``trainer.save_interval`` (0 or None: only on a stop); ``num_steps``:
    the run's last step; ``start_step``: the step resumed from (0 for a fresh run)."""

    save_interval: int | None
    num_steps: int
    start_step: int = 0

    def due(self, step: int) -> bool:
        """Whether finishing ``step`` writes a checkpoint (its interval, or the last step)."""
        si = self.save_interval or 0
        return si > 0 and (step % si == 0 or step == self.num_steps)

    def due_on_stop(self, done: int) -> bool:
        """Whether a stop after step ``done`` writes its checkpoint: a step this run finished
        (``done > start_step``) whose interval save has not written it already."""
        si = self.save_interval or 0
        return done > self.start_step and not (si > 0 and done % si == 0)
