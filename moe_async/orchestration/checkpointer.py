"""The driver's whole-run checkpoints: when to write one and the stop-and-save path.

:class:`Checkpointer` asks :class:`~moe_async.orchestration.save_schedule.SaveSchedule` whether
a finished step writes its checkpoint (``trainer.save_interval``, the last step) and, on a stop
(SIGTERM under ``MOE_ASYNC_SIGTERM=checkpoint``, a rank's pre-emption report), whether the last
finished step still needs one. The writing itself is a callable ``write(step, data) -> path``
(:func:`ray_checkpoint_writer` in a run: the trainer's checkpoint with the data position, the
draw ledger and the buffer snapshot). It records ``last_checkpoint`` and ``stopped_at_step`` in
the run's summary dict and prints the stop line.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from moe_async.orchestration.save_schedule import SaveSchedule
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from moe_async.orchestration.run_state import DrawLedger
    from moe_async.orchestration.trainer_group import TrainerGroup

#: ``write(step, data)``: the checkpoint of ``step`` (``data``: the prompt position taken before
#: the step's sync, None: take it now); returns the checkpoint's directory.
Writer = Callable[[int, "JsonDict | None"], str]


class Checkpointer:
    """Args:
        schedule: the run's :class:`SaveSchedule` (interval, last step, resumed step).
        write: the :data:`Writer`; its errors propagate (a failed save fails the run).
        summary: the run's summary dict (``last_checkpoint``, ``stopped_at_step`` set here).
        data_state: ``() -> dict``, the rollout side's prompt position (read before a due
            step's weight sync, so a resumed sync run draws what this one would).
        on_save: ``(step) -> None`` called just before a due step's write (the timeline phase).
    """

    def __init__(self, schedule: SaveSchedule, write: Writer, summary: JsonDict,
                 data_state: Callable[[], JsonDict], on_save: Callable[[int], None] = lambda step: None):
        self.schedule = schedule
        self._write = write
        self._summary = summary
        self._data_state = data_state
        self._on_save = on_save

    def data_before_sync(self, step: int) -> JsonDict | None:
        """The prompt position for step ``step``'s checkpoint when one is due (else None)."""
        return self._data_state() if self.schedule.due(step) else None

    def after_step(self, step: int, data: JsonDict | None) -> dict[str, float]:
        """Write step ``step``'s checkpoint when due; returns ``{"perf/save_seconds": s}``
        then, else ``{}``."""
        if not self.schedule.due(step):
            return {}
        t0 = time.perf_counter()
        self._on_save(step)
        self._summary["last_checkpoint"] = self._write(step, data)
        return {"perf/save_seconds": time.perf_counter() - t0}

    def stop(self, done: int, why: str | None, waiting_for: int | None = None) -> None:
        """The run stops after step ``done`` (``why``: the signal or the rank's report;
        ``waiting_for``: the step whose batch was awaited, None when ``done`` just finished):
        its checkpoint unless already written or resumed from, ``stopped_at_step``, one line."""
        if self.schedule.due_on_stop(done):
            self._summary["last_checkpoint"] = self._write(done, None)
        self._summary["stopped_at_step"] = done
        where = f" while waiting for the batch of step {waiting_for}" if waiting_for is not None else ""
        print(f"[moe-async] {why}{where}: stopped after step {done}, checkpoint "
              f"{self._summary.get('last_checkpoint')}", flush=True)


def ray_checkpoint_writer(trainer: TrainerGroup, rollout: ActorHandle, buffer: ActorHandle, ledger: DrawLedger,
                          save_dir: str, max_staleness: int, get: Callable[[ObjectRef, str], Any],
                          reply_s: float) -> Writer:
    """The run's :data:`Writer`: the trainer's checkpoint (model, optimizer, RNG, version) in
    ``save_dir`` with the data position, the draw ledger (``run_state.py``, settled first) and
    the buffer snapshot in it. ``rollout``/``buffer``: the Ray actor handles; ``get(ref, what)``
    a bounded ``ray.get`` naming the call; ``reply_s``: the ledger drain's bound."""
    from moe_async.orchestration.preemption import wait_buffered_if_asked
    from moe_async.orchestration.run_state import record_settled

    def write(at_step: int, data: JsonDict | None) -> str:
        wait_buffered_if_asked(lambda: int(get(buffer.stats.remote(), "buffer.stats")["buffered_groups"]))
        data = data if data is not None else get(rollout.data_state.remote(), "rollout.data_state")
        record_settled(ledger, [], rollout, buffer, reply_s)
        rs = ledger.state_dict(weight_version=trainer.version(), step=at_step, max_staleness=max_staleness)
        snap = get(buffer.snapshot.remote(), "buffer.snapshot")  # the buffered groups (buffer/snapshot.py)
        return trainer.save_checkpoint(save_dir, at_step, {"dataset": data, "run_state": rs, "buffer": snap})

    return write
