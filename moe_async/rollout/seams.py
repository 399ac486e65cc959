"""What the rollout manager takes, as Protocols: a drawn prompt (a reasoning-gym
:class:`~moe_async.rollout.tasks.Problem`, a data file's :class:`~moe_async.data.rows.Row`)
and the distillation teacher (:class:`~moe_async.distill.teacher.TeacherScorer`, a later
layer)."""

from __future__ import annotations

from typing import Protocol

from moe_async.logging.timeline import SpanRecorder
from moe_async.rollout.rewards import ScoredPrompt
from moe_async.types import Sample


class DrawnPrompt(ScoredPrompt, Protocol):
    """A drawn prompt as the manager reads it (a :class:`~moe_async.rollout.tasks.Problem`, a
    data file's :class:`~moe_async.data.rows.Row`): its question, gold answer and row index."""

    @property
    def index(self) -> int: ...


class GroupTeacher(Protocol):
    """The distillation teacher as the manager uses it (``moe_async.distill.teacher.TeacherScorer``):
    scores a group's samples beside the reward, and stops the run once it has failed too often."""

    @property
    def failure(self) -> Exception | None: ...

    async def score_group(self, problem: object, samples: list[Sample], trace: SpanRecorder | None = None) -> None: ...

    def metrics(self) -> dict[str, float]: ...
