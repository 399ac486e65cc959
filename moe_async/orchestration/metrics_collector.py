"""The step loop's metrics state: baselines, per-step ``perf/*`` numbers, summary contents.

:class:`MetricsCollector` takes the rollout metrics read after ``eval_before`` as its baselines
(engine busy seconds, generation seconds, reward sums: the loop's own counts start there) and the
clock when generation starts. Each step it adds to the trainer's metrics dict the cumulative
counts (:func:`~moe_async.orchestration.metrics.loop_metrics`), the step's wait/busy/generation
seconds, throughput over the loop's seconds without evaluations (``eval/seconds`` is taken off),
the wait split and the per-step generated reward. It owns the run's ``summary`` dict (keys in
summary.json's order) and fills ``perf``, ``buffer`` and ``rollout`` when the loop ends.
Units: seconds (``perf.perf_counter``), samples, tokens. Pure: no I/O, no actors."""

from __future__ import annotations

import time
from typing import Callable

from moe_async.buffer.buffer import BufferStats
from moe_async.buffer.wait_split import wait_split_metrics
from moe_async.orchestration.metrics import loop_metrics
from moe_async.types import JsonDict

BUSY = "rollout/engine_busy_s/"  # prefix of the per-engine cumulative busy seconds


def mean_engine_busy(rmetrics: dict[str, float]) -> float:
    """Mean over engines of the cumulative busy seconds in the rollout metrics (0 without any)."""
    busy = [v for k, v in rmetrics.items() if k.startswith(BUSY)]
    return sum(busy) / len(busy) if busy else 0.0


class MetricsCollector:
    """Args:
        summary: the run's summary dict so far (``run_dir``, ``seed``, ...); kept as :attr:`summary`.
        clock: seconds (``time.perf_counter``; a fake in tests).
    """

    def __init__(self, summary: JsonDict, clock: Callable[[], float] = time.perf_counter):
        self.summary = summary
        self._clock = clock
        self.busy0: dict[str, float] = {}
        self._busy_prev = self._gen_prev = 0.0
        self._reward_prev = (0.0, 0.0)
        self.t_loop0 = self._t_start = 0.0
        self.idle = self.tokens = self.samples = self.elapsed = 0.0

    def start(self, rm0: dict[str, float]) -> None:
        """Baselines from the rollout metrics ``rm0`` read before generation starts; the loop's
        clock starts now."""
        self.busy0 = {k: v for k, v in rm0.items() if k.startswith(BUSY)}
        self._gen_prev = rm0.get("rollout/gen_wall_seconds", 0.0)
        self._reward_prev = (rm0.get("rollout/reward_sum", 0.0), rm0.get("rollout/samples_generated", 0.0))
        self._busy_prev = mean_engine_busy(self.busy0)
        self._t_start = self.t_loop0 = self._clock()

    def waited(self, t0: float, t1: float) -> None:
        """The trainer waited for a batch from ``t0`` to ``t1`` (seconds of :attr:`idle`)."""
        self.idle += t1 - t0

    def counted(self, m: dict[str, float]) -> None:
        """The trained batch's ``train/response_tokens`` and ``train/samples`` counted, the
        loop's seconds (without evaluations) taken now."""
        self.tokens += m["train/response_tokens"]
        self.samples += m["train/samples"]
        self.elapsed = self._clock() - self._t_start

    def step(self, m: dict[str, float], bstats: BufferStats, rm: dict[str, float], t0: float, t1: float,
             version: int, synced_version: int, extra: dict[str, float]) -> dict[str, float]:
        """Add the step's loop metrics to ``m`` (after :meth:`counted`) and return it. ``bstats``/``rm``: the buffer's stats and the
        rollout metrics now; ``t0``/``t1``: the step's start and batch arrival; ``version`` /
        ``synced_version``: trainer's and engines' weight versions; ``extra``: added after the
        wait split (the engine recovery counters). Raises KeyError for a missing
        ``rollout/gen_wall_seconds`` or buffer stat (named)."""
        m.update(loop_metrics(bstats, rm, self.busy0, self.elapsed))
        busy_now = mean_engine_busy(rm)
        m.update({
            "perf/wait_seconds": t1 - t0,  # trainer idle this step (waiting for a batch)
            "perf/engine_busy_seconds": busy_now - self._busy_prev,  # this step, mean over engines
            "perf/gen_seconds": rm["rollout/gen_wall_seconds"] - self._gen_prev,  # this step, any engine busy
            "train/weight_version": float(version),
            "engine/weight_version": float(synced_version),
            "perf/step_seconds": self._clock() - t0,
            "perf/tokens_per_s": self.tokens / self.elapsed,
            "perf/trainer_idle_frac": self.idle / self.elapsed,
            "perf/samples_per_s": self.samples / self.elapsed,
            "buffer/samples_dropped": float(bstats["samples_dropped"]),
            "buffer/buffered_groups": float(bstats["buffered_groups"]),
        })
        m.update(wait_split_metrics(dict(bstats), t1 - t0))  # the wait split: filling + straggler = wait
        m.update(extra)
        # reward per sample generated since the last step, filtered/dropped ones included
        rg = (rm.get("rollout/reward_sum", 0.0), rm.get("rollout/samples_generated", 0.0))
        if rg[1] > self._reward_prev[1]:
            m["rollout/reward_mean_generated_step"] = (rg[0] - self._reward_prev[0]) / (rg[1] - self._reward_prev[1])
        self._busy_prev, self._gen_prev, self._reward_prev = busy_now, rm["rollout/gen_wall_seconds"], rg
        return m

    def evaluated(self, m: dict[str, float]) -> None:
        """The step's held-out evaluation (``m["eval/seconds"]``) is not loop time for the rates."""
        self._t_start += m.get("eval/seconds", 0.0)

    def loop_done(self, m: dict[str, float], bstats: BufferStats, rm: dict[str, float]) -> None:
        """``perf`` (the last step's rates, ``loop_seconds``), ``buffer`` (the buffer's
        ``samples_generated`` named ``samples_put``: what was put into it, after dynamic
        filtering) and ``rollout`` (its metrics) in the summary."""
        perf: dict[str, float | None] = {k: m.get(k) for k in ("perf/samples_per_s", "perf/tokens_per_s",
                                                      "perf/trainer_idle_frac", "perf/engine_idle_frac")}
        perf["loop_seconds"] = self.elapsed
        self.summary["perf"] = perf
        self.summary["buffer"] = {("samples_put" if k == "samples_generated" else k): v for k, v in bstats.items()}
        self.summary["rollout"] = rm
