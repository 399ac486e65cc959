"""The driver's held-out evaluations: ``eval_before``, the curve, ``eval_after``.

:class:`Evaluator` decides when to evaluate and what goes into the run's summary dict. With
``rollout.eval_interval`` set the held-out curve (:class:`~moe_async.rollout.evaluation.EvalCurve`)
runs at the start step, every interval and at the last step, and its greedy answers serve as
``eval_before`` / ``eval_after`` (not asked twice); a resumed run keeps the first run's step-0
``eval_before`` (from ``metrics.jsonl``) and records the resumed point as ``eval_at_resume``.
Without a curve, ``eval_before``/``eval_after`` are one greedy evaluation each. A stopped run
(pre-emption) has no ``eval_after``. With a distillation teacher (``teacher.eval``) the teacher
is evaluated once before the curve's first point (``eval_teacher``: the reference the student
moves toward; not on a resumed run). The evaluations themselves are callables (Ray calls in a
run; their timeouts name ``rollout.eval_timeout_s``); the policy's each run inside ``engine_threads``
(:class:`~moe_async.orchestration.eval_threads.EvalThreads`: the engines' evaluation threads).

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
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
        teacher_point: ``() -> dict``, the teacher's held-out evaluation (``evaluate_heldout``'s
            dict); None: no teacher evaluation.
        engine_threads: context entered around each curve point and greedy evaluation
            (default: none).
    """

    def __init__(self, eval_before: bool, eval_after: bool, eval_interval: int, num_steps: int,
                 curve_point: Callable[[], JsonDict], greedy: Callable[[str], JsonDict],
                 summary: JsonDict, timeline: Phases, run_dir: Path, resumed: bool,
                 teacher_point: Callable[[], JsonDict] | None = None,
                 engine_threads: AbstractContextManager[object] | None = None):
        self.eval_before, self.eval_after = eval_before, eval_after
        self._threads = engine_threads or nullcontext()
        self.curve = EvalCurve(eval_interval, num_steps, self._point(curve_point))
        self._greedy = greedy
        self._summary = summary
        self._timeline = timeline
        self._run_dir, self._resumed = run_dir, resumed
        self._teacher_point = teacher_point

    def _point(self, curve_point: Callable[[], JsonDict]) -> Callable[[], JsonDict]:
        def run() -> JsonDict:
            with self._threads:
                return curve_point()
        return run

    def _evaluate(self, key: str, label: str) -> None:
        with self._threads:
            ev = self._greedy(label)
        report_eval(self._summary, key, label, ev)

    def before(self, start_step: int) -> dict[str, float]:
        """``eval_before`` and the curve's first point (at ``start_step``), before generation
        starts, and the teacher's evaluation (first run only, with a curve); returns that
        point's ``eval/*`` and the teacher's ``eval_teacher/*`` metrics (``{}`` without a curve)."""
        teacher = self._evaluate_teacher() if self.curve.enabled and not self._resumed else {}
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
        return {**ev0, **teacher}

    def _evaluate_teacher(self) -> dict[str, float]:
        """The teacher's held-out point as ``eval_teacher/*`` metrics; ``summary["eval_teacher"]``."""
        if self._teacher_point is None:
            return {}
        self._timeline.phase("eval_teacher", label="held-out eval (teacher)")
        ev = self._teacher_point()
        ev.pop("greedy", None)
        ev.pop("per_problem", None)
        point = {k: float(v) for k, v in ev.items() if k.startswith("eval/")}
        self._summary["eval_teacher"] = point
        print("[moe-async] teacher held-out (its prompt, its engines): " + teacher_line(point), flush=True)
        return {"eval_teacher/" + k[len("eval/"):]: v for k, v in point.items()}

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
        if "eval_teacher" in self._summary:
            print("  teacher    | " + teacher_line(self._summary["eval_teacher"]), flush=True)


def teacher_line(p: dict[str, float]) -> str:
    """``greedy g +- se [95%] | mean@k m +- se [95%] | pass@k`` of one held-out point (``eval/*``
    keys, as :func:`moe_async.rollout.evaluation.summarize`); 95%: the normal interval."""
    def ci(name: str) -> str:
        v, se = p[f"eval/{name}"], p[f"eval/{name}_se"]
        return f"{v:.3f} +- {se:.3f} [{v - 1.96 * se:.3f}, {v + 1.96 * se:.3f}]"

    k = p.get("eval/k", 0.0)
    return (f"greedy {ci('greedy_accuracy')} | mean@{k:.0f} {ci('mean_at_k')} | pass@{k:.0f} "
            f"{p['eval/pass_at_k']:.3f} (n={p['eval/n']:.0f}, {p.get('eval/seconds', 0.0):.0f} s)")
