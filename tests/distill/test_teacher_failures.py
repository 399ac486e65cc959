"""The teacher scorer's failure rules, with teacher clients that answer the scoring call
(:meth:`moe_async.engines.client.EngineClient.score`'s contract) badly: a teacher that never
scores stops the run after one step's samples whatever ``teacher.max_consecutive_failures``
is (it used to let an all-failed run train on zero advantages and exit 0), and a reply that is
not one finite logprob <= 0 per scored token is refused, naming the teacher URL and the
sample."""

from __future__ import annotations

import asyncio
import math
import re
from types import SimpleNamespace

import pytest

from moe_async.distill.config import TeacherConfig
from moe_async.distill.teacher import TeacherFailureError, TeacherScorer
from moe_async.engines.replies import ScoreOutput
from moe_async.types import Sample


class Teacher:
    """``reply(n) -> logprobs`` for a call scoring ``n`` tokens; raises what ``reply`` raises."""

    def __init__(self, url, reply):
        self.base_url, self.reply, self.calls = url, reply, 0

    async def score(self, input_ids, logprob_start_len, top_logprobs_num=0):
        self.calls += 1
        await asyncio.sleep(0)
        return ScoreOutput(self.reply(len(input_ids) - logprob_start_len), None)


def _samples(n=2, R=3):
    return [Sample([1, 2], [3 + i for i in range(R)], [-0.5] * R, [0] * R) for _ in range(n)]


def _run(sc, groups):
    async def go():
        for g in groups:
            await sc.score_group(SimpleNamespace(index=g), _samples())

    asyncio.run(go())


def test_a_teacher_that_never_scores_stops_after_one_steps_samples():
    def down(n):
        raise ConnectionError("connection refused")

    t = Teacher("http://teacher-a:1", down)
    sc = TeacherScorer(TeacherConfig(enabled=True, max_consecutive_failures=100), [t], lambda p, ids: list(ids),
                       source="test teacher", first_limit=4)
    with pytest.raises(TeacherFailureError, match=r"test teacher\) failed to score 4 samples in a row, every sample "
                       r"of the run so far \(teacher.max_consecutive_failures=100\); last error: "
                       r"http://teacher-a:1: ConnectionError: connection refused"):
        _run(sc, range(10))
    assert t.calls == 4 and sc.metrics()["teacher/failures"] == 4


def test_after_the_first_scored_sample_the_configured_limit_applies():
    state = {"n": 0}

    def first_ok(n):
        state["n"] += 1
        if state["n"] > 1:
            raise ConnectionError("gone")
        return [-0.5] * n

    sc = TeacherScorer(TeacherConfig(enabled=True, max_consecutive_failures=9), [Teacher("http://t:2", first_ok)],
                       lambda p, ids: list(ids), first_limit=4)
    with pytest.raises(TeacherFailureError, match=r"failed to score 9 samples in a row \(teacher"):
        _run(sc, range(10))
    assert sc.metrics()["teacher/requests"] == 10  # 1 scored + 9 failed


@pytest.mark.parametrize("reply, why", [
    (lambda n: [-0.5] * (n - 1), r"2 logprobs for 3 scored tokens"),
    (lambda n: [-0.5, math.nan, -0.5], r"logprob nan of scored token 1 is not a finite number <= 0"),
    (lambda n: [-0.5, -0.5, -math.inf], r"logprob -inf of scored token 2"),
    (lambda n: [0.75, -0.5, -0.5], r"logprob 0.75 of scored token 0"),
    (lambda n: ["x"] * n, r"logprobs \['x', 'x', 'x'\] are not numbers"),
])
def test_bad_replies_are_refused_naming_url_and_sample(reply, why):
    sc = TeacherScorer(TeacherConfig(enabled=True, max_consecutive_failures=0), [Teacher("http://teacher-b:3", reply)],
                       lambda p, ids: list(ids))
    samples = _samples()
    asyncio.run(sc.score_group(SimpleNamespace(index=17), samples))
    for i, s in enumerate(samples):
        assert s.teacher_logprobs is None
        assert s.metadata["teacher_error"].startswith(f"http://teacher-b:3: bad reply for problem 17 sample {i}: ")
        assert re.search(why, s.metadata["teacher_error"])
    m = sc.metrics()
    assert m["teacher/bad_replies"] == 2 and m["teacher/failures"] == 2 and m["teacher/tokens"] == 0


def test_a_good_reply_is_kept():
    sc = TeacherScorer(TeacherConfig(enabled=True), [Teacher("http://t:4", lambda n: [-0.25] * n)],
                       lambda p, ids: list(ids))
    samples = _samples()
    asyncio.run(sc.score_group(SimpleNamespace(index=0), samples))
    assert [s.teacher_logprobs for s in samples] == [[-0.25] * 3] * 2
    assert sc.metrics()["teacher/kl_per_token"] == -0.25
