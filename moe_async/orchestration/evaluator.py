"""The driver's held-out evaluations: ``eval_before``, the curve, ``eval_after``.

:class:`Evaluator` decides when to evaluate and what goes into the run's summary dict. With
``rollout.eval_interval`` set the held-out curve (:class:`~moe_async.rollout.evaluation.EvalCurve`)
runs at the start step, every interval and at the last step, and its greedy answers serve as
``eval_before`` / ``eval_after`` (not asked twice); a resumed run keeps the first run's step-0
``eval_before`` (from ``metrics.jsonl``) and records the resumed point as ``eval_at_resume``.
Without a curve, ``eval_before``/``eval_after`` are one greedy evaluation each. A stopped run
(pre-emption) has no ``eval_after``. The evaluations themselves are callables (Ray calls in a
run; their timeouts name ``rollout.eval_timeout_s``).

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from moe_async.orchestration.lifecycle import first_run_eval_before, report_eval
from moe_async.rollout.evaluation import EvalCurve
from moe_async.types import JsonDict


class Phases(Protocol):
    """The timeline's phase seam (:class:`~moe_async.logging.timeline.Timeline`)."""

    def phase(self, name: str, step: int | None = None, label: str | None = None) -> None: ...


class Evaluator:
    """Args:
        eval_before / eval_after: the config's switches.
        eval_interval / num_steps: ``rollout.eval_interval`` (0: no curve), the run's last step.
        curve_point: ``() -> dict``, one curve evaluation (``evaluate_heldout``'s dict).
        greedy: ``(label) -> dict``, one greedy evaluation (``accuracy``, ``reward_mean``, ``n``).
        summary: the run's summary dict (``eval_before``, ``eval_at_resume``, ``eval_after``,
            ``eval_curve`` set here).
        timeline: :class:`Phases` (``eval_before`` / ``eval_after`` phases).
        run_dir / resumed: a resumed run (``trainer.load`` or auto) reads its first run's
            step-0 record from ``run_dir/metrics.jsonl``.
    """

    def __init__(self, eval_before: bool, eval_after: bool, eval_interval: int, num_steps: int,
                 curve_point: Callable[[], JsonDict], greedy: Callable[[str], JsonDict],
                 summary: JsonDict, timeline: Phases, run_dir: Path, resumed: bool):
        self.eval_before, self.eval_after = eval_before, eval_after
        self.curve = EvalCurve(eval_interval, num_steps, curve_point)
        self._greedy = greedy
        self._summary = summary
        self._timeline = timeline
        self._run_dir, self._resumed = run_dir, resumed

    def _evaluate(self, key: str, label: str) -> None:
        report_eval(self._summary, key, label, self._greedy(label))

    def before(self, start_step: int) -> dict[str, float]:
        """``eval_before`` and the curve's first point (at ``start_step``), before generation
        starts; returns that point's ``eval/*`` metrics (``{}`` without a curve)."""
        if self.eval_before:
            self._timeline.phase("eval_before", label="held-out eval (before)")
            if not self.curve.enabled:
                self._evaluate("eval_before", "before")
        ev0 = self.curve.run(start_step)
        if self.eval_before and self.curve.enabled:  # its greedy answers are eval_before's: not asked twice
            first = first_run_eval_before(self._run_dir) if self._resumed else None  # resumed: step 0's
            if first is not None:
                self._summary["eval_at_resume"] = self.curve.last_greedy
            report_eval(self._summary, "eval_before", "before", first or self.curve.last_greedy)
        return ev0

    def at_step(self, step: int) -> dict[str, float]:
        """The curve's point at ``step`` when due (every interval, the last step), else ``{}``."""
        return self.curve.run(step)

    def after(self, last_step: int) -> None:
        """``eval_after`` on the final weights (``last_step``: the loop's last step): the curve's
        last point when it was taken there, else one greedy evaluation; none on a stopped run."""
        if not self.eval_after or "stopped_at_step" in self._summary:
            return
        if self.curve.points and self.curve.points[-1]["step"] == last_step:  # on these weights
            report_eval(self._summary, "eval_after", "after", self.curve.last_greedy)
        else:
            self._timeline.phase("eval_after", label="held-out eval (after)")
            self._evaluate("eval_after", "after")

    def report_curve(self) -> None:
        """``eval_curve`` in the summary and the curve's table printed (nothing without points)."""
        if self.curve.points:
            self._summary["eval_curve"] = self.curve.points
            print(self.curve.format(), flush=True)
