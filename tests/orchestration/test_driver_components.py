"""The driver loop's components with fakes (no Ray, no model): the checkpointer's save and
stop-and-save decisions, the evaluator's schedule (eval_before/after, the curve, a resumed
run's kept eval_before and eval_at_resume), the metrics collector's baselines and summary.
End to end: test_e2e_smoke.py, test_resume.py, test_preemption_resume.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moe_async.orchestration.checkpointer import Checkpointer
from moe_async.orchestration.evaluator import Evaluator
from moe_async.orchestration.metrics_collector import MetricsCollector, mean_engine_busy
from moe_async.orchestration.save_schedule import SaveSchedule


class Writes:
    """A fake checkpoint writer: records (step, data) and returns ``ckpt/step_<N>``."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[int, Any]] = []
        self.fail_at = fail_at

    def __call__(self, step: int, data: dict | None) -> str:
        if step == self.fail_at:
            raise OSError(f"disk full at step {step}")
        self.calls.append((step, data))
        return f"ckpt/step_{step}"


def _ckpt(interval: int | None, num_steps: int, start_step: int = 0, fail_at: int | None = None):
    w, summary, saved_phases = Writes(fail_at), {}, []
    reads = []

    def data_state() -> dict:
        reads.append(1)
        return {"pos": len(reads)}

    c = Checkpointer(SaveSchedule(interval, num_steps, start_step), w, summary, data_state, saved_phases.append)
    return c, w, summary, saved_phases, reads


def test_checkpointer_saves_on_the_interval_and_the_last_step_with_the_data_read_before_the_sync() -> None:
    c, w, summary, phases, reads = _ckpt(2, 5)
    out = {}
    for step in range(1, 6):
        data = c.data_before_sync(step)
        out[step] = c.after_step(step, data)
    assert [s for s, _ in w.calls] == [2, 4, 5] and phases == [2, 4, 5]
    assert [d for _, d in w.calls] == [{"pos": 1}, {"pos": 2}, {"pos": 3}]  # read only when due
    assert len(reads) == 3
    assert [s for s, m in out.items() if "perf/save_seconds" in m] == [2, 4, 5]
    assert all(m == {} for s, m in out.items() if s in (1, 3))
    assert summary == {"last_checkpoint": "ckpt/step_5"}


def test_checkpointer_stop_after_an_unsaved_step_writes_it_and_names_the_signal(capsys) -> None:
    c, w, summary, _, _ = _ckpt(2, 10)
    c.after_step(2, c.data_before_sync(2))
    c.stop(3, "SIGTERM")
    assert w.calls == [(2, {"pos": 1}), (3, None)]  # the stop's data position is read by the writer
    assert summary == {"last_checkpoint": "ckpt/step_3", "stopped_at_step": 3}
    assert capsys.readouterr().out == "[moe-async] SIGTERM: stopped after step 3, checkpoint ckpt/step_3\n"


def test_checkpointer_stop_after_a_saved_step_writes_nothing_more(capsys) -> None:
    c, w, summary, _, _ = _ckpt(2, 10)
    c.after_step(4, c.data_before_sync(4))
    c.stop(4, "rank 1: SIGTERM")
    assert [s for s, _ in w.calls] == [4]
    assert summary == {"last_checkpoint": "ckpt/step_4", "stopped_at_step": 4}
    assert "stopped after step 4, checkpoint ckpt/step_4" in capsys.readouterr().out


def test_checkpointer_stop_while_waiting_at_the_resumed_step_writes_nothing(capsys) -> None:
    c, w, summary, _, _ = _ckpt(None, 6, start_step=4)
    c.stop(4, "SIGTERM", waiting_for=5)
    assert w.calls == [] and summary == {"stopped_at_step": 4}
    assert capsys.readouterr().out == ("[moe-async] SIGTERM while waiting for the batch of step 5: stopped "
                                       "after step 4, checkpoint None\n")


def test_checkpointer_without_interval_never_saves_a_step_but_saves_on_a_stop() -> None:
    c, w, summary, phases, reads = _ckpt(0, 3)
    assert [c.after_step(s, c.data_before_sync(s)) for s in (1, 2, 3)] == [{}, {}, {}]
    assert w.calls == [] and reads == [] and phases == []
    c.stop(2, "SIGTERM", waiting_for=3)
    assert w.calls == [(2, None)] and summary["last_checkpoint"] == "ckpt/step_2"


def test_checkpointer_a_failed_write_propagates_and_records_nothing() -> None:
    c, _, summary, _, _ = _ckpt(1, 3, fail_at=2)
    c.after_step(1, None)
    with pytest.raises(OSError, match="disk full at step 2"):
        c.after_step(2, None)
    assert summary == {"last_checkpoint": "ckpt/step_1"}


# ---------------------------------------------------------------- evaluator


class Phases:
    def __init__(self) -> None:
        self.names: list[str] = []

    def phase(self, name: str, step: int | None = None, label: str | None = None) -> None:
        self.names.append(name)


def _point(acc: float) -> dict[str, Any]:
    """A curve evaluation's reply (evaluate_heldout's shape) with greedy accuracy ``acc``."""
    return {"eval/greedy_accuracy": acc, "eval/greedy_accuracy_se": 0.1, "eval/k": 2.0, "eval/mean_at_k": acc,
            "eval/mean_at_k_se": 0.1, "eval/pass_at_k": acc, "eval/n": 2.0, "eval/seconds": 1.5,
            "per_problem": {"greedy_accuracy": [acc, acc], "mean_at_k": [acc, acc]},
            "greedy": {"accuracy": acc, "reward_mean": acc, "n": 2}}


def _evaluator(tmp_path: Path, interval: int, num_steps: int = 4, before: bool = True, after: bool = True,
               resumed: bool = False):
    asked: list[str] = []
    points = iter([0.25, 0.5, 0.75, 1.0])

    def curve_point() -> dict:
        asked.append("curve")
        return _point(next(points))

    def greedy(label: str) -> dict:
        asked.append(label)
        return {"accuracy": 0.5 if label == "before" else 0.75, "reward_mean": 0.5, "n": 4}

    summary: dict[str, Any] = {}
    tl = Phases()
    ev = Evaluator(before, after, interval, num_steps, curve_point, greedy, summary, tl, tmp_path, resumed)
    return ev, asked, summary, tl


def test_evaluator_without_a_curve_asks_greedy_before_and_after(tmp_path) -> None:
    ev, asked, summary, tl = _evaluator(tmp_path, interval=0)
    assert ev.before(0) == {}
    assert [ev.at_step(s) for s in (1, 2, 3, 4)] == [{}, {}, {}, {}]
    ev.after(4)
    ev.report_curve()
    assert asked == ["before", "after"] and tl.names == ["eval_before", "eval_after"]
    assert summary["eval_before"]["accuracy"] == 0.5 and summary["eval_after"]["accuracy"] == 0.75
    assert "eval_curve" not in summary


def test_evaluator_switches_off_ask_nothing(tmp_path) -> None:
    ev, asked, summary, tl = _evaluator(tmp_path, interval=0, before=False, after=False)
    ev.before(0)
    ev.after(4)
    assert asked == [] and summary == {} and tl.names == []


def test_evaluator_curve_serves_eval_before_and_after_without_asking_twice(tmp_path, capsys) -> None:
    ev, asked, summary, tl = _evaluator(tmp_path, interval=2, num_steps=4)
    m0 = ev.before(0)
    assert m0["eval/greedy_accuracy"] == 0.25 and m0["eval/seconds"] == 1.5
    due = [s for s in (1, 2, 3, 4) if ev.at_step(s)]
    ev.after(4)
    ev.report_curve()
    assert due == [2, 4] and asked == ["curve"] * 3  # step 0, 2 and the last step; no greedy call
    assert tl.names == ["eval_before"]  # eval_after is the curve's last point: no phase of its own
    assert summary["eval_before"] == {"accuracy": 0.25, "reward_mean": 0.25, "n": 2}
    assert summary["eval_after"] == {"accuracy": 0.75, "reward_mean": 0.75, "n": 2}  # the step-4 point's
    assert [p["step"] for p in summary["eval_curve"]] == [0, 2, 4]
    assert summary["eval_curve"][-1]["eval/greedy_accuracy_gain"] == pytest.approx(0.5)  # paired with step 0
    assert "held-out curve" in capsys.readouterr().out
    assert "eval_at_resume" not in summary


def test_evaluator_after_a_curve_ending_elsewhere_asks_greedy(tmp_path) -> None:
    ev, asked, summary, tl = _evaluator(tmp_path, interval=2, num_steps=4)
    ev.before(0)
    ev.after(3)  # the curve's last point (step 0) is not on the final weights
    assert asked == ["curve", "after"] and tl.names == ["eval_before", "eval_after"]
    assert summary["eval_after"]["accuracy"] == 0.75


def test_evaluator_no_eval_after_on_a_stopped_run(tmp_path) -> None:
    ev, asked, summary, _ = _evaluator(tmp_path, interval=0)
    ev.before(0)
    summary["stopped_at_step"] = 2
    ev.after(2)
    assert asked == ["before"] and "eval_after" not in summary


def test_evaluator_resumed_keeps_the_first_runs_eval_before_and_records_eval_at_resume(tmp_path) -> None:
    rec = {"step": 0, "eval/greedy_accuracy": 0.125, "eval/greedy_reward": 0.25, "eval/n": 8.0,
           "eval/n_skipped": 0.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({"step": 1}) + "\n")
    ev, asked, summary, _ = _evaluator(tmp_path, interval=2, num_steps=4, resumed=True)
    ev.before(2)
    assert asked == ["curve"]
    assert summary["eval_before"]["accuracy"] == 0.125 and summary["eval_before"]["n"] == 8.0
    assert summary["eval_at_resume"] == {"accuracy": 0.25, "reward_mean": 0.25, "n": 2}


def test_evaluator_resumed_without_a_first_run_record_uses_the_resumed_point(tmp_path) -> None:
    ev, _, summary, _ = _evaluator(tmp_path, interval=2, num_steps=4, resumed=True)  # no metrics.jsonl
    ev.before(2)
    assert summary["eval_before"]["accuracy"] == 0.25 and "eval_at_resume" not in summary


def test_evaluator_fresh_run_ignores_a_metrics_file(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/greedy_accuracy": 0.9, "eval/n": 1}) + "\n")
    ev, _, summary, _ = _evaluator(tmp_path, interval=2, num_steps=4, resumed=False)
    ev.before(0)
    assert summary["eval_before"]["accuracy"] == 0.25


def _with_teacher(tmp_path: Path, interval: int, resumed: bool = False):
    asked: list[str] = []
    points = iter([0.25, 0.5, 0.75])
    summary: dict[str, Any] = {}

    def curve_point() -> dict:
        asked.append("curve")
        return _point(next(points))

    def teacher_point() -> dict:
        asked.append("teacher")
        return _point(0.875)

    ev = Evaluator(True, True, interval, 4, curve_point, lambda label: {"accuracy": 0.5, "n": 2}, summary, Phases(),
                   tmp_path, resumed, teacher_point=teacher_point)
    return ev, asked, summary


def test_evaluator_teacher_is_evaluated_once_before_the_curve_and_reported(tmp_path, capsys) -> None:
    ev, asked, summary = _with_teacher(tmp_path, interval=2)
    m0 = ev.before(0)
    for s in (1, 2, 3, 4):
        ev.at_step(s)
    ev.after(4)
    ev.report_curve()
    assert asked == ["teacher", "curve", "curve", "curve"]
    assert m0["eval_teacher/mean_at_k"] == 0.875 and m0["eval_teacher/n"] == 2.0 and m0["eval/mean_at_k"] == 0.25
    assert not any(k.startswith("eval_teacher/") and ("per_problem" in k or "greedy" == k) for k in m0)
    assert summary["eval_teacher"]["eval/mean_at_k_se"] == 0.1 and "per_problem" not in summary["eval_teacher"]
    out = capsys.readouterr().out
    # the mean and its 95% normal interval, once at the start and once under the curve's table
    assert out.count("mean@2 0.875 +- 0.100 [0.679, 1.071]") == 2 and "teacher held-out" in out


@pytest.mark.parametrize("interval,resumed", [(0, False), (2, True)])
def test_evaluator_teacher_not_evaluated_without_a_curve_or_on_resume(tmp_path, interval, resumed) -> None:
    ev, asked, summary = _with_teacher(tmp_path, interval=interval, resumed=resumed)
    assert not any(k.startswith("eval_teacher/") for k in ev.before(2 if resumed else 0))
    assert "teacher" not in asked and "eval_teacher" not in summary


def test_evaluator_a_failing_evaluation_propagates(tmp_path) -> None:
    def boom(label: str) -> dict:
        raise TimeoutError(f"held-out eval ({label}): no reply within 5 s (rollout.eval_timeout_s)")

    ev = Evaluator(True, True, 0, 4, dict, boom, {}, Phases(), tmp_path, False)
    with pytest.raises(TimeoutError, match="rollout.eval_timeout_s"):
        ev.before(0)


# ---------------------------------------------------------------- metrics collector


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _bstats(**kw: Any) -> dict[str, Any]:
    return {"drop_reasons": {"stale": 1}, "samples_dropped": 2, "buffered_groups": 1, "wait_filling_s": 1.0,
            "wait_straggler_s": 1.0, **kw}


def test_metrics_collector_baselines_rates_and_per_step_deltas() -> None:
    clock = Clock()
    mc = MetricsCollector({"run_dir": "r"}, clock)
    rm0 = {"rollout/engine_busy_s/0": 10.0, "rollout/engine_busy_s/1": 20.0, "rollout/gen_wall_seconds": 5.0,
           "rollout/reward_sum": 3.0, "rollout/samples_generated": 6.0}
    mc.start(rm0)  # eval_before's requests are not the loop's
    assert mc.t_loop0 == 100.0 and mean_engine_busy(rm0) == 15.0
    clock.t = 104.0
    mc.waited(100.0, 104.0)
    clock.t = 110.0
    m = {"train/response_tokens": 40.0, "train/samples": 4.0}
    mc.counted(m)
    rm1 = {"rollout/engine_busy_s/0": 15.0, "rollout/engine_busy_s/1": 23.0, "rollout/gen_wall_seconds": 9.0,
           "rollout/reward_sum": 7.0, "rollout/samples_generated": 10.0}
    mc.step(m, _bstats(), rm1, 100.0, 104.0, version=1, synced_version=1, extra={"engine/restarts": 0.0})
    assert m["perf/wait_seconds"] == 4.0
    assert m["perf/engine_busy_seconds"] == 4.0  # mean busy 19 - 15
    assert m["perf/gen_seconds"] == 4.0
    assert m["perf/tokens_per_s"] == 4.0 and m["perf/samples_per_s"] == 0.4  # over 10 s
    assert m["perf/trainer_idle_frac"] == 0.4
    assert m["perf/engine_idle_frac"] == pytest.approx(1 - 4.0 / 10.0)  # busy since the baseline
    assert m["perf/wait_filling_seconds"] + m["perf/wait_straggler_seconds"] == pytest.approx(4.0)
    assert m["rollout/reward_mean_generated_step"] == 1.0  # (7-3)/(10-6)
    assert m["buffer/dropped/stale"] == 1.0 and m["engine/restarts"] == 0.0
    assert list(m)[-2:] == ["engine/restarts", "rollout/reward_mean_generated_step"]
    # step 2: a held-out evaluation of 5 s in step 1 is not loop time; no new samples
    mc.evaluated({"eval/seconds": 5.0})
    clock.t = 125.0
    m2 = {"train/response_tokens": 20.0, "train/samples": 2.0}
    mc.counted(m2)
    mc.step(m2, _bstats(), {**rm1, "rollout/gen_wall_seconds": 10.0}, 110.0, 111.0, 2, 2, {})
    assert mc.elapsed == 20.0 and m2["perf/tokens_per_s"] == 3.0  # 60 tokens over 25 - 5 s
    assert m2["perf/engine_busy_seconds"] == 0.0 and m2["perf/gen_seconds"] == 1.0
    assert "rollout/reward_mean_generated_step" not in m2
    mc.loop_done(m2, {"samples_generated": 12, "samples_trained": 6}, rm1)
    assert mc.summary["perf"] == {"perf/samples_per_s": 0.3, "perf/tokens_per_s": 3.0,
                                  "perf/trainer_idle_frac": pytest.approx(4 / 20),
                                  "perf/engine_idle_frac": m2["perf/engine_idle_frac"], "loop_seconds": 20.0}
    assert mc.summary["buffer"] == {"samples_put": 12, "samples_trained": 6}
    assert mc.summary["rollout"] is rm1 and list(mc.summary)[0] == "run_dir"


def test_metrics_collector_a_loop_without_a_step_reports_zero_seconds() -> None:
    mc = MetricsCollector({}, Clock())
    mc.start({})
    mc.loop_done({}, {}, {})
    assert mc.summary["perf"] == {"perf/samples_per_s": None, "perf/tokens_per_s": None,
                                  "perf/trainer_idle_frac": None, "perf/engine_idle_frac": None, "loop_seconds": 0.0}


def test_metrics_collector_missing_generation_seconds_is_named() -> None:
    mc = MetricsCollector({}, Clock())
    mc.start({})
    m = {"train/response_tokens": 1.0, "train/samples": 1.0}
    mc.counted(m)
    with pytest.raises(KeyError, match="rollout/gen_wall_seconds"):
        mc.step(m, _bstats(), {}, 100.0, 100.5, 1, 1, {})
