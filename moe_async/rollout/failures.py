"""How a rollout group fails: drops counted by reason, and errors that stop the run.

:class:`DropGroup` (a group that cannot be produced; its ``reason`` is counted in
``rollout/dropped/<reason>``), :class:`EngineTimeoutError` (a request past
``engine.request_timeout_s``, naming the engine), :class:`PromptsAllDroppedError` (an epoch of
train prompts all too long) and :class:`GroupsFailingError` (:data:`MAX_GROUP_ERRORS_IN_A_ROW`
groups in a row failed with an error)."""

from __future__ import annotations


class DropGroup(Exception):
    """A group that cannot be produced; ``reason`` is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EngineTimeoutError(TimeoutError):
    """An engine request that timed out, naming the engine (index, URL) and the limit."""


class PromptsAllDroppedError(ValueError):
    """Every train prompt of an epoch was too long to generate from (a data or config error)."""


class GroupsFailingError(RuntimeError):
    """Group after group failed with an error (not a drop by a rule): a config, data, environment
    or tool error that every group hits, so the run stops instead of drawing forever."""


#: consecutive groups failing with an error that stop the run (:class:`GroupsFailingError`)
MAX_GROUP_ERRORS_IN_A_ROW = 16
