"""A reward that never returns a number must stop the run, not train on zero rewards.

:class:`RewardErrorStreak` counts the scored samples whose reward failed (raised, timed out,
or was not a finite number: :class:`moe_async.rollout.reward.RewardPool` records each as the
sample's ``reward_error`` and scores it 0) in a row, in the order their results arrive,
training and evaluation alike; a sample that scores resets the count. At
``rollout.max_consecutive_reward_errors`` in a row it raises :class:`RewardFailureError`
naming the reward setting (``rollout.reward_function=...``, ``rollout.reward_url=...`` or
``rollout.reward=...``), the failure kinds (:func:`failure_kind`: raised, returned a
non-number, timed out, worker died) with their counts, and the first and last error; 0 turns
the limit off. Until the first sample scores, the limit is ``first_limit`` (one training step's
samples) when smaller, timeouts included: a reward with zero successes over the first step's
samples stops the run before that step trains on zeros, however short the run, while a run
whose reward times out now and then (it scored once) keeps to the configured limit. The
per-sample error count (``rollout/reward_errors``, ``reward/errors``, ``reward/timeouts``) is
kept either way.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable


class RewardFailureError(RuntimeError):
    """The reward function failed on too many samples in a row; the message names it, the
    failure kinds and the first and last error."""


def failure_kind(err: str) -> str:
    """The kind of a sample's ``reward_error``: ``"timed out"`` (the pool's ``"timeout"``),
    ``"returned a non-number"`` (:class:`moe_async.rollout.rewards.RewardValueError`),
    ``"worker died"`` or ``"raised"`` (any other exception)."""
    if err == "timeout":
        return "timed out"
    if err.startswith("RewardValueError"):
        return "returned a non-number"
    if err.startswith("reward worker"):
        return "worker died"
    return "raised"


class RewardErrorStreak:
    """Consecutive reward failures (see the module docstring).

    Args:
        limit: failures in a row that stop the run (``rollout.max_consecutive_reward_errors``);
            0: never.
        source: the reward setting, as the error names it (e.g. ``rollout.reward_function='m:f'``).
        timeout_s: the per-sample timeout (``rollout.reward_timeout_s``), named when an error
            is the pool's ``"timeout"``.
        first_limit: the limit while no sample has scored yet (0/None: ``limit``).
    """

    def __init__(self, limit: int, source: str, timeout_s: float | None = None, first_limit: int | None = None):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = int(limit)
        self.source = source
        self.timeout_s = timeout_s
        self.count = 0
        self.kinds: Counter = Counter()  # failure kinds of the current run of failures
        self.last_error: str | None = None
        self.failure: RewardFailureError | None = None
        self.first_limit = int(first_limit or 0)
        self.ever_scored = False
        self.first_error: str | None = None

    def _name(self, err: str) -> str:
        if err == "timeout" and self.timeout_s is not None:
            return f"timeout: no result within rollout.reward_timeout_s={self.timeout_s:g} s"
        return err

    def update(self, errors: Iterable[str | None]) -> None:
        """Add the results of some samples (their ``reward_error``, None when scored).

        Raises:
            RewardFailureError: when the count reaches the limit (and on every later call: a
                failed reward stays failed); also kept as :attr:`failure`.
        """
        for err in errors:
            if err is None:
                self.count = 0
                self.kinds.clear()
                self.ever_scored = True
                continue
            self.count += 1
            self.kinds[failure_kind(err)] += 1
            self.last_error = err
            self.first_error = self.first_error or err
            limit = self.limit
            first_step = bool(limit and self.first_limit and not self.ever_scored and self.first_limit < limit)
            if first_step:
                limit = self.first_limit
            if limit and self.count >= limit and self.failure is None:
                self.failure = RewardFailureError(self._message(err, first_step))
        if self.failure is not None:
            raise self.failure

    def _message(self, err: str, first_step: bool) -> str:
        never = "" if self.ever_scored else ", every sample of the run so far"
        why = (f"zero successes over the first step's {self.first_limit} samples" if first_step
               else f"rollout.max_consecutive_reward_errors={self.limit}")
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds.most_common())
        hint = ""
        if self.kinds["timed out"] and self.timeout_s is not None:
            hint = f" (no result within rollout.reward_timeout_s={self.timeout_s:g} s: raise it for a slow scorer)"
        first = "" if self.first_error == err else f"; first error: {self._name(self.first_error or '')}"
        return (f"reward ({self.source}) failed on {self.count} samples in a row{never} ({why}): "
                f"{kinds}{hint}; last error: {self._name(err)}{first}")
