"""``engine.eval_num_threads``: the engines run each held-out evaluation of the policy on the
evaluation threads and are back on ``engine.num_threads`` after it (the trainer's idle time);
the teacher's evaluation and the steps in between are untouched; an unreachable engine keeps
its count without failing the evaluation; the config refuses what cannot work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from moe_async.engines.config import EngineConfig
from moe_async.orchestration.eval_threads import EvalThreads
from moe_async.orchestration.evaluator import Evaluator


class Engines:
    """Fake engines: the thread count each URL has now, and every change asked."""

    def __init__(self, urls: list[str], threads: int, down: tuple[str, ...] = ()) -> None:
        self.threads = {u: threads for u in urls}
        self.down = down
        self.asked: list[tuple[str, int]] = []

    def set(self, url: str, n: int) -> int:
        self.asked.append((url, n))
        if url in self.down:
            raise ConnectionError(f"{url} refused")
        self.threads[url] = n
        return n


class Phases:
    def phase(self, name: str, step: int | None = None, label: str | None = None) -> None:
        pass


def _point(acc: float) -> dict[str, Any]:
    return {"eval/greedy_accuracy": acc, "eval/greedy_accuracy_se": 0.1, "eval/k": 2.0, "eval/mean_at_k": acc,
            "eval/mean_at_k_se": 0.1, "eval/pass_at_k": acc, "eval/n": 2.0, "eval/seconds": 1.5,
            "per_problem": {"greedy_accuracy": [acc, acc], "mean_at_k": [acc, acc]},
            "greedy": {"accuracy": acc, "reward_mean": acc, "n": 2}}


def _run(tmp_path: Path, engines: Engines, eval_threads: int | None, interval: int) -> list[tuple[str, dict]]:
    """A 4-step run's evaluations (curve every ``interval``, or greedy before/after, and a
    teacher point): each with the engines' thread counts while it ran."""
    seen: list[tuple[str, dict]] = []

    def curve_point() -> dict:
        seen.append(("curve", dict(engines.threads)))
        return _point(0.5)

    def greedy(label: str) -> dict:
        seen.append((label, dict(engines.threads)))
        return {"accuracy": 0.5, "reward_mean": 0.5, "n": 2}

    def teacher_point() -> dict:
        seen.append(("teacher", dict(engines.threads)))
        return _point(0.75)

    threads = EvalThreads(lambda: list(engines.threads), eval_threads, 1, set_threads=engines.set)
    ev = Evaluator(True, True, interval, 4, curve_point, greedy, {}, Phases(), tmp_path, False,
                   teacher_point=teacher_point, engine_threads=threads)
    ev.before(0)
    for s in range(1, 5):
        seen.append((f"step {s}", dict(engines.threads)))
        ev.at_step(s)
    ev.after(4)
    return seen


def test_policy_evaluations_run_on_the_eval_threads_and_the_steps_on_num_threads(tmp_path) -> None:
    engines = Engines(["http://a", "http://b"], threads=1)
    seen = _run(tmp_path, engines, eval_threads=2, interval=2)
    two, one = {"http://a": 2, "http://b": 2}, {"http://a": 1, "http://b": 1}
    assert seen == [("teacher", one), ("curve", two), ("step 1", one), ("step 2", one), ("curve", two),
                    ("step 3", one), ("step 4", one), ("curve", two)]
    assert engines.threads == one and len(engines.asked) == 3 * 2 * 2  # 3 points x (set, restore) x 2 engines


def test_greedy_evaluations_without_a_curve_are_switched_too(tmp_path) -> None:
    engines = Engines(["http://a"], threads=1)
    seen = _run(tmp_path, engines, eval_threads=2, interval=0)
    assert [(k, t["http://a"]) for k, t in seen if not k.startswith("step")] == [("before", 2), ("after", 2)]
    assert engines.threads == {"http://a": 1}


@pytest.mark.parametrize("eval_threads", [None, 1])
def test_unset_or_equal_count_sends_nothing(tmp_path, eval_threads) -> None:
    engines = Engines(["http://a"], threads=1)
    _run(tmp_path, engines, eval_threads=eval_threads, interval=2)
    assert engines.asked == []


def test_an_unreachable_engine_keeps_its_count_and_the_evaluation_goes_on(tmp_path, capsys) -> None:
    engines = Engines(["http://a", "http://b"], threads=1, down=("http://b",))
    seen = _run(tmp_path, engines, eval_threads=2, interval=4)
    assert [t for k, t in seen if k == "curve"] == [{"http://a": 2, "http://b": 1}] * 2
    out = capsys.readouterr().out
    assert out.count("warning: engine http://b: could not set 2 thread(s)") == 2
    assert out.count("could not set 1 thread(s)") == 2


def test_eval_threads_with_a_list_of_live_urls_read_at_each_evaluation() -> None:
    urls = ["http://a"]
    engines = Engines(["http://a", "http://b"], threads=1)
    threads = EvalThreads(lambda: list(urls), 2, 1, set_threads=engines.set)
    with threads:
        urls.append("http://b")  # an engine restarted during the evaluation: started on num_threads
    assert engines.asked == [("http://a", 2), ("http://a", 1), ("http://b", 1)] and threads.changes == 3


@pytest.mark.parametrize("kw,match", [
    (dict(backend="sglang", eval_num_threads=2), "engine.eval_num_threads=2 with engine.backend='sglang'"),
    (dict(cpu_affinity=[1], eval_num_threads=2), r"exceeds the 1 core\(s\) of engine.cpu_affinity=\[1\]"),
    (dict(eval_num_threads=0), "eval_num_threads"),
])
def test_config_refuses_eval_threads_that_cannot_work(kw, match) -> None:
    with pytest.raises(ValidationError, match=match):
        EngineConfig(**kw)
    assert EngineConfig(eval_num_threads=2, cpu_affinity=[0, 1]).eval_num_threads == 2


def test_teacher_engine_eval_threads_refused() -> None:
    from moe_async.distill.config import TeacherConfig

    with pytest.raises(ValidationError, match="teacher.engine.eval_num_threads"):
        TeacherConfig(engine=EngineConfig(eval_num_threads=2))
