"""A reward that never returns a number must stop the run, not train on zero rewards.

:class:`RewardErrorStreak` counts the scored samples whose reward failed (raised, timed out,
or was not a finite number: :class:`moe_async.rollout.reward.RewardPool` records each as the
sample's ``reward_error`` and scores it 0) in a row, in the order their results arrive,
training and evaluation alike; a sample that scores resets the count. At
``rollout.max_consecutive_reward_errors`` in a row it raises :class:`RewardFailureError`
naming the reward setting (``rollout.reward_function=...``, ``rollout.reward_url=...`` or
``rollout.reward=...``) and the last error; 0 turns the limit off. Until the first sample scores, the limit is ``first_limit`` (one
training step's samples) when smaller and that many of the failures were not timeouts: a
reward that has never returned a number stops the run before its first step trains on zeros,
however short the run. The per-sample error count
(``rollout/reward_errors``, ``reward/errors``, ``reward/timeouts``) is kept either way.
"""

from __future__ import annotations

from typing import Iterable


class RewardFailureError(RuntimeError):
    """The reward function failed on too many samples in a row; the message names it and the
    last error."""


class RewardErrorStreak:
    """Consecutive reward failures (see the module docstring).

    Args:
        limit: failures in a row that stop the run (``rollout.max_consecutive_reward_errors``);
            0: never.
        source: the reward setting, as the error names it (e.g. ``rollout.reward_function='m:f'``).
        timeout_s: the per-sample timeout (``rollout.reward_timeout_s``), named when the last
            error is the pool's ``"timeout"``.
        first_limit: the limit while no sample has scored yet (0/None: ``limit``).
    """

    def __init__(self, limit: int, source: str, timeout_s: float | None = None, first_limit: int | None = None):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = int(limit)
        self.source = source
        self.timeout_s = timeout_s
        self.count = 0
        self.last_error: str | None = None
        self.failure: RewardFailureError | None = None
        self.first_limit = int(first_limit or 0)
        self.ever_scored = False
        self.first_error: str | None = None
        self.never_count = 0  # failures other than timeouts before the first scored sample

    def update(self, errors: Iterable[str | None]) -> None:
        """Add the results of some samples (their ``reward_error``, None when scored).

        Raises:
            RewardFailureError: when the count reaches ``limit`` (and on every later call: a
                failed reward stays failed); also kept as :attr:`failure`.
        """
        for err in errors:
            if err is None:
                self.count = 0
                self.ever_scored = True
                continue
            self.count += 1
            self.last_error = err
            self.first_error = self.first_error or err
            limit = self.limit
            # a timeout is not proof the reward never returns a number (a loaded machine)
            self.never_count += err != "timeout"
            if limit and self.first_limit and not self.ever_scored and self.never_count >= self.first_limit:
                limit = min(limit, self.first_limit)
            if limit and self.count >= limit and self.failure is None:
                if err == "timeout" and self.timeout_s is not None:
                    err = f"timeout: no result within rollout.reward_timeout_s={self.timeout_s:g} s"
                never = "" if self.ever_scored else ", every sample of the run so far"
                first = "" if self.first_error == err else f"; first error: {self.first_error}"
                self.failure = RewardFailureError(
                    f"reward ({self.source}) failed on {self.count} samples in a row{never} "
                    f"(rollout.max_consecutive_reward_errors={self.limit}); last error: {err}{first}")
        if self.failure is not None:
            raise self.failure
