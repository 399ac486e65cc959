"""Held-out curve statistics (moe_async/rollout/evaluation.py): values, standard errors over
problems and paired gains, computed by hand; the curve's schedule."""

import asyncio
import math

import pytest

from moe_async.rollout.evaluation import EvalCurve, evaluate_heldout, mean_se, paired_gains, summarize
from moe_async.rollout.manager import greedy_summary


def test_mean_se_is_the_sample_std_over_sqrt_n():
    mu, se = mean_se([1.0, 0.0, 1.0, 1.0])
    assert mu == 0.75
    # var(ddof=1) = (3 * 0.25**2 + 0.75**2) / 3 = 0.25: std 0.5, se 0.5 / sqrt(4)
    assert se == pytest.approx(0.5 / 2)
    assert mean_se([]) == (0.0, 0.0) and mean_se([0.3]) == (0.3, 0.0)


def test_summarize_per_problem_then_over_problems():
    greedy = [1.0, 0.0, 1.0]
    sampled = [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.5, 1.0, 1.0, 1.0]]  # 0.5: partial credit
    m = summarize(greedy, sampled)
    assert m["eval/n"] == 3 and m["eval/k"] == 4
    assert m["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    # mean@k: per problem 0.5, 0.25, 0.75 (0.5 reward is not >= 1) -> 0.5
    assert m["eval/mean_at_k"] == pytest.approx(0.5)
    assert m["eval/mean_at_k_se"] == pytest.approx(math.sqrt(((0.0) ** 2 + 0.25 ** 2 + 0.25 ** 2) / 2) / math.sqrt(3))
    assert m["eval/pass_at_k"] == 1.0
    assert m["eval/sampled_reward"] == pytest.approx((0.5 + 0.25 + 0.875) / 3)
    assert m["per_problem"]["mean_at_k"] == [0.5, 0.25, 0.75] and m["per_problem"]["ids"] == [0, 1, 2]


def test_paired_gain_uses_the_per_problem_differences():
    base = summarize([0.0, 1.0, 0.0, 0.0], [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])["per_problem"]
    now = summarize([1.0, 1.0, 0.0, 1.0], [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])["per_problem"]
    g = paired_gains(now, base)
    assert g["eval/greedy_accuracy_gain"] == pytest.approx(0.5)  # diffs 1, 0, 0, 1
    assert g["eval/greedy_accuracy_gain_se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert g["eval/mean_at_k_gain"] == pytest.approx((0.5 + 0.5 + 0 + 0.5) / 4)  # diffs .5 .5 0 .5
    # paired: a constant gain on every problem has se 0 although both series vary
    same = paired_gains({"greedy_accuracy": [1, 1, 0], "mean_at_k": [0.75, 0.5, 0.25]},
                        {"greedy_accuracy": [1, 1, 0], "mean_at_k": [0.5, 0.25, 0.0]})
    assert same["eval/mean_at_k_gain"] == pytest.approx(0.25) and same["eval/mean_at_k_gain_se"] == pytest.approx(0.0)
    # a problem scored in one evaluation only is left out of the pairing (matched by id)
    a = summarize([1.0, 0.0, 1.0], [[1.0], [0.0], [1.0]], ids=[10, 11, 12])["per_problem"]
    b = summarize([0.0, 0.0], [[0.0], [1.0]], ids=[12, 10])["per_problem"]
    g = paired_gains(a, b)
    assert g["eval/greedy_accuracy_gain"] == pytest.approx(1.0)  # ids 10 and 12: 1-0 and 1-0
    assert g["eval/mean_at_k_gain"] == pytest.approx((0.0 + 1.0) / 2)  # id 10: 1-1, id 12: 1-0


def test_curve_schedule_and_gains_against_the_first_point():
    calls = []

    def ev():
        calls.append(1)
        x = float(len(calls) > 1)  # the first point scores 0, later ones 1
        return summarize([x, x], [[x], [x]])

    c = EvalCurve(interval=3, num_steps=7, evaluate=ev)
    got = {s: c.run(s) for s in range(0, 8)}
    assert [s for s, m in got.items() if m] == [0, 3, 6, 7]
    assert got[0]["eval/mean_at_k_gain"] == 0.0 and got[7]["eval/mean_at_k_gain"] == 1.0
    assert "per_problem" not in got[3]
    assert [p["step"] for p in c.points] == [0, 3, 6, 7]
    last = c.format().splitlines()[-1]
    assert "mean@k gain +1.000 +- 0.000 [+1.000, +1.000]" in last and "greedy gain +1.000" in last
    off = EvalCurve(interval=0, num_steps=7, evaluate=ev)
    assert off.run(0) == {} and not off.points


class _FakeManager:
    """The manager surface evaluate_heldout uses: greedy always answers right, a sampled
    request right every other time."""

    class cfg:
        max_concurrent_groups, n_samples_per_prompt, eval_concurrency = 2, 2, None

    class dataset:
        @staticmethod
        def build_prompt_ids(p):
            return [1, 2, 3] * p  # problem 0: empty prompt -> skipped by _check_length below

        @staticmethod
        def decode(ids):
            return "right" if ids == [7] else "wrong"

        @staticmethod
        def score(p, text):  # the task's own scorer: partial credit for a wrong answer
            return 1.0 if text == "right" else 0.25

    class reward_pool:
        @staticmethod
        async def score(p, text):
            return type("R", (), {"reward": 1.0 if text == "right" else 0.0})()

    def __init__(self):
        self.n = 0
        self.in_flight = self.peak = 0
        self.bursts: list[int] = []  # requests in flight when each request starts

    def _check_length(self, n, max_new, count=False):
        return None if n == 0 else max_new

    async def _generate_sample(self, ids, max_new, greedy=False, temperature=None):  # the manager's signature
        self.n += 1
        ok = greedy or self.n % 2 == 0
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return type("S", (), {"response_ids": [7] if ok else [8]})()


def test_evaluate_heldout_counts_greedy_and_k_samples_per_problem():
    man = _FakeManager()
    out = asyncio.run(evaluate_heldout(man, [0, 1, 2], k=4, max_new_tokens=8))
    assert out["eval/n"] == 2 and out["eval/n_skipped"] == 1
    assert man.n == 2 * 5  # per kept problem: 1 greedy + k samples
    assert out["eval/greedy_accuracy"] == 1.0
    assert 0.0 < out["eval/mean_at_k"] < 1.0
    # the greedy half as the driver's eval_before/eval_after dict (not asked a second time)
    assert out["greedy"] == {"reward_mean": 1.0, "accuracy": 1.0, "task_accuracy": 1.0, "reward_errors": 0,
                             "n": 2, "n_skipped": 1, "mean_response_len": 1.0}


@pytest.mark.parametrize("concurrency,peak", [(None, 2 * 5), (1, 5), (3, 3 * 5)])
def test_evaluate_heldout_sends_each_problems_requests_together(concurrency, peak):
    """rollout.eval_concurrency problems at once (None: max_concurrent_groups = 2), each with
    its greedy + k requests in flight together (so the engine prefills the prompt once)."""
    man = _FakeManager()
    man.cfg = type("cfg", (), dict(max_concurrent_groups=2, n_samples_per_prompt=2, eval_concurrency=concurrency))
    out = asyncio.run(evaluate_heldout(man, [1, 2, 3, 4], k=4, max_new_tokens=8))
    assert out["eval/n"] == 4 and man.n == 4 * 5
    assert man.peak == peak


def test_evaluate_heldout_sends_the_prompt_fns_ids():
    """A teacher's own prompt (prompt_fn) replaces the dataset's for every request, and the
    length check sees its length (a prompt_fn emptying problem 2's prompt skips it)."""
    man = _FakeManager()
    sent: list[list[int]] = []
    gen = man._generate_sample

    async def record(ids, max_new, greedy=False, temperature=None):
        sent.append(list(ids))
        return await gen(ids, max_new, greedy, temperature)

    man._generate_sample = record
    out = asyncio.run(evaluate_heldout(man, [1, 2], k=2, max_new_tokens=8,
                                       prompt_fn=lambda p, ids: [] if p == 2 else [9] + ids))
    assert sent == [[9, 1, 2, 3]] * 3 and out["eval/n"] == 1 and out["eval/n_skipped"] == 1


def test_greedy_summary_matches_the_manager_evaluate_keys():
    g = greedy_summary([(1.0, None, 1.0, 4), (0.0, "timeout", 0.5, 8), (0.5, None, 0.0, 6)], n_skipped=2)
    assert g == {"reward_mean": pytest.approx(0.5), "accuracy": pytest.approx(1 / 3),
                 "task_accuracy": pytest.approx(0.5), "reward_errors": 1, "n": 3, "n_skipped": 2,
                 "mean_response_len": pytest.approx(6.0)}
    assert greedy_summary([], n_skipped=1)["accuracy"] == 0.0


def test_curve_keeps_the_last_points_greedy_dict_out_of_the_metrics():
    def ev():
        out = summarize([1.0, 0.0], [[1.0], [0.0]])
        out["greedy"] = {"accuracy": 0.5, "n": 2}
        return out

    c = EvalCurve(interval=1, num_steps=1, evaluate=ev)
    m = c.run(0)
    assert "greedy" not in m and "greedy" not in c.points[0]
    assert c.last_greedy == {"accuracy": 0.5, "n": 2}


def test_named_eval_sets_each_with_own_k_temperature_and_metrics():
    """data.eval: each set evaluated with its own n_samples (k), max_new_tokens, temperature;
    the curve names its metrics eval/<name>/... with paired gains per set."""
    from moe_async.data.config import EvalSetConfig
    from moe_async.rollout.evaluation import evaluate_sets

    man = _FakeManager()
    seen = []

    async def gen(ids, max_new, greedy=False, temperature=None):
        seen.append((max_new, greedy, temperature))
        return type("S", (), {"response_ids": [7] if greedy else [8]})()

    man._generate_sample = gen
    cfgs = {"a": EvalSetConfig(path="a.jsonl", n_samples=2), "b": EvalSetConfig(path="b.jsonl", n_samples=3,
                                                                                   max_new_tokens=5, temperature=0.5)}
    rollout = type("R", (), {"eval_max_new_tokens": 9})
    calls = []

    def ev():
        calls.append(1)
        return asyncio.run(evaluate_sets(man, {"a": [1, 2], "b": [1, 2, 3, 4]}, cfgs, rollout))

    c = EvalCurve(interval=1, num_steps=1, evaluate=ev)
    m = c.run(0)
    assert sorted(seen) == sorted([(9, True, None)] * 2 + [(9, False, None)] * 4 + [(5, True, None)] * 4
                                  + [(5, False, 0.5)] * 12)
    assert (m["eval/a/n"], m["eval/a/k"], m["eval/b/n"], m["eval/b/k"]) == (2.0, 2.0, 4.0, 3.0)
    assert m["eval/a/greedy_accuracy"] == 1.0 and m["eval/b/mean_at_k"] == 0.0
    assert m["eval/a/mean_at_k_gain"] == 0.0 and "eval/greedy_accuracy" not in m
    assert c.last_greedy["n"] == 6 and c.last_greedy["accuracy"] == 1.0
    table = c.format().splitlines()
    assert any("| a: greedy 1.000" in ln for ln in table) and any("| b: greedy 1.000" in ln for ln in table)
