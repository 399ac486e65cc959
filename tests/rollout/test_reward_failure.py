"""A reward that never returns a number stops the run after rollout.max_consecutive_reward_errors
failed samples in a row, naming the reward setting and the last error (moe_async/rollout/
reward_streak.py, RolloutManager); the per-sample error counts stay."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_rollout_manager import EOS, FakeBuffer, FakeDataset, FakeEngine, _run

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.manager import RolloutManager
from moe_async.rollout.reward import RewardPool
from moe_async.rollout.reward_streak import RewardErrorStreak, RewardFailureError
from moe_async.rollout.rewards import build_reward_fn


def test_streak_counts_only_failures_in_a_row():
    s = RewardErrorStreak(3, "rollout.reward='x'")
    s.update(["e1", None, "e2", "e3"])  # 1, reset, 1, 2
    assert s.count == 2 and s.failure is None
    with pytest.raises(RewardFailureError, match=r"rollout.reward='x'.* 3 samples in a row.*last error: e4"):
        s.update(["e4", None])
    with pytest.raises(RewardFailureError):  # stays failed
        s.update([None])


def test_streak_names_the_timeout():
    s = RewardErrorStreak(2, "rollout.reward='reasoning_gym'", timeout_s=10.0)
    with pytest.raises(RewardFailureError, match=r"last error: timeout: no result within rollout.reward_timeout_s=10 s"):
        s.update(["timeout", "timeout"])


def test_streak_off_and_interleaved_failures_never_stop():
    off = RewardErrorStreak(0, "r")
    off.update(["e"] * 1000)
    assert off.failure is None and off.count == 1000
    s = RewardErrorStreak(3, "r")
    s.update(["e", "e", None] * 50)
    assert s.failure is None


def test_reward_that_never_scored_stops_within_one_step_of_samples():
    """A short run's reward that fails on every sample stops before its first step trains on
    zeros (one step's samples, first_limit), naming the first and the last error; once a sample
    has scored, the configured limit applies."""
    s = RewardErrorStreak(100, "rollout.reward_function='m:f'", first_limit=8)
    s.update(["ValueError: first"] + ["RewardValueError: returned 'high'"] * 6)
    assert s.failure is None
    with pytest.raises(RewardFailureError, match=r"failed on 8 samples in a row, every sample of the run so far.*"
                       r"last error: RewardValueError: returned 'high'; first error: ValueError: first"):
        s.update(["RewardValueError: returned 'high'"])
    slow = RewardErrorStreak(100, "r", timeout_s=2.0, first_limit=8)
    slow.update(["timeout"] * 7)
    assert slow.failure is None
    with pytest.raises(RewardFailureError, match=r"failed on 8 samples in a row, every sample of the run so far "
                       r"\(zero successes over the first step's 8 samples\): 8 timed out \(no result within "
                       r"rollout.reward_timeout_s=2 s"):
        slow.update(["timeout"])  # timeouts count: zero successes over the first step
    mixed = RewardErrorStreak(100, "r", first_limit=6)
    with pytest.raises(RewardFailureError, match=r": 3 timed out, 2 raised, 1 returned a non-number;"):
        mixed.update(["timeout", "ValueError: x", "timeout", "RewardValueError: returned 'a'", "timeout", "KeyError: k"])
    ok = RewardErrorStreak(100, "r", first_limit=8)
    ok.update([None] + ["e"] * 50)  # scored once: only the configured 100 in a row stop it
    assert ok.failure is None


def _manager(cfg, reward_fn, buf):
    ds = FakeDataset([10])
    pool = RewardPool(reward_fn, timeout_s=5.0, max_workers=1, use_processes=False)
    return RolloutManager(cfg, ds, [FakeEngine(version=3)], buf, pool, eos_token_ids=[EOS])


@pytest.mark.parametrize("user_fn, err", [("returns_text", "returned 'high'"), ("returns_none", "returned None"),
                                          ("returns_nan", "returned nan")])
def test_run_stops_naming_the_function(user_fn, err):
    """G=4, one group at a time, limit 8: the first group (4 errors) is put, the second reaches 8
    and is dropped (reward_failure); run() raises; rollout/reward_errors counts all 8."""
    cfg = RolloutConfig(n_samples_per_prompt=4, max_concurrent_groups=1, max_new_tokens=8,
                        max_consecutive_reward_errors=8, reward="function",
                        reward_function=f"tests.rollout._user_rewards:{user_fn}")
    buf = FakeBuffer(capacity=100)
    m = _manager(cfg, build_reward_fn(cfg, None), buf)
    with pytest.raises(RewardFailureError) as ei:
        _run(m, buf, 100)
    msg = str(ei.value)
    assert f"rollout.reward_function='tests.rollout._user_rewards:{user_fn}'" in msg
    assert "8 samples in a row" in msg and err in msg
    assert len(buf.groups) == 1 and buf.cancels == ["reward_failure"]
    met = m.metrics()
    assert met["rollout/reward_errors"] == 8 and met["reward/errors"] == 8
    assert met["rollout/dropped/reward_failure"] == 1


def test_run_goes_on_when_the_reward_works_sometimes():
    calls = {"n": 0}

    def flaky(problem, text):
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            return 1.0
        raise RuntimeError("flaky")

    cfg = RolloutConfig(n_samples_per_prompt=4, max_concurrent_groups=1, max_new_tokens=8,
                        max_consecutive_reward_errors=4)
    buf = FakeBuffer(capacity=6)
    m = _manager(cfg, flaky, buf)
    _run(m, buf, 6)
    assert len(buf.groups) == 6 and m.metrics()["rollout/reward_errors"] == 18


def test_reward_that_always_times_out_stops_before_the_first_step():
    """A reward that sleeps past rollout.reward_timeout_s on every sample: zero successes over
    the first step's samples (prompts_per_step 2 x G 4 = 8, below the configured 100) stop the
    run naming the reward, the failure kind and the timeout; rollout/reward_errors counts 8."""
    cfg = RolloutConfig(prompts_per_step=2, n_samples_per_prompt=4, max_concurrent_groups=1, max_new_tokens=8,
                        reward="function", reward_function="tests.rollout._user_rewards:sleeps_past_timeout",
                        reward_timeout_s=0.5)
    buf = FakeBuffer(capacity=100)
    pool = RewardPool(build_reward_fn(cfg, None), timeout_s=cfg.reward_timeout_s, max_workers=4,
                      use_processes=False)
    m = RolloutManager(cfg, FakeDataset([10]), [FakeEngine(version=3)], buf, pool, eos_token_ids=[EOS])
    with pytest.raises(RewardFailureError) as ei:
        _run(m, buf, 100, timeout=60.0)
    msg = str(ei.value)
    assert "rollout.reward_function='tests.rollout._user_rewards:sleeps_past_timeout'" in msg, msg
    assert "failed on 8 samples in a row, every sample of the run so far (zero successes over the first " \
        "step's 8 samples): 8 timed out (no result within rollout.reward_timeout_s=0.5 s" in msg, msg
    assert len(buf.groups) == 1 and buf.cancels == ["reward_failure"]
    met = m.metrics()
    assert met["rollout/reward_errors"] == 8 and met["reward/timeouts"] == 8 and met["reward/ok"] == 0


def test_run_with_some_timeouts_goes_on():
    """Every second reward call sleeps past the timeout; the others score: the run is healthy
    (it scored in its first step), so it keeps going under the configured limit of 100."""
    release, lock, calls = threading.Event(), threading.Lock(), {"n": 0}

    def every_second_hangs(problem, text):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n % 2 == 0:
            release.wait(60)
        return 1.0

    cfg = RolloutConfig(prompts_per_step=2, n_samples_per_prompt=4, max_concurrent_groups=1, max_new_tokens=8,
                        reward_timeout_s=0.5)
    buf = FakeBuffer(capacity=6)
    pool = RewardPool(every_second_hangs, timeout_s=cfg.reward_timeout_s, max_workers=4, use_processes=False)
    m = RolloutManager(cfg, FakeDataset([10]), [FakeEngine(version=3)], buf, pool, eos_token_ids=[EOS])
    try:
        _run(m, buf, 6, timeout=60.0)
    finally:
        release.set()
    met = m.metrics()
    assert len(buf.groups) == 6 and m.reward_streak.failure is None
    assert met["reward/calls"] == 24 and met["reward/timeouts"] >= 12  # a loaded machine may add some
    assert met["reward/ok"] + met["reward/timeouts"] == 24 and met["rollout/reward_errors"] == met["reward/timeouts"]


def test_evaluate_raises_before_training():
    def boom(problem, text):
        raise RuntimeError("scorer down")

    cfg = RolloutConfig(max_new_tokens=8, max_consecutive_reward_errors=3)
    m = _manager(cfg, boom, FakeBuffer(0))
    probs = [m.dataset.next_train() for _ in range(3)]
    with pytest.raises(RewardFailureError, match="rollout.reward='reasoning_gym'.*scorer down"):
        asyncio.run(m.evaluate(probs, 5))


def test_config_field():
    assert RolloutConfig().max_consecutive_reward_errors == 100
    with pytest.raises(ValueError, match="max_consecutive_reward_errors"):
        RolloutConfig(max_consecutive_reward_errors=-1)


def test_engine_timeout_names_the_engine(caplog):
    """A /generate that times out (httpx) drops its group as error:EngineTimeoutError, the log
    naming the engine, its URL and engine.request_timeout_s (timeouts name themselves)."""
    import logging

    import httpx

    class SlowEngine(FakeEngine):
        base_url, timeout_s = "http://127.0.0.1:9", 600.0

        async def generate(self, *a, **kw):
            raise httpx.ReadTimeout("timed out")

    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    buf = FakeBuffer(capacity=1)
    pool = RewardPool(lambda p, t: 1.0, timeout_s=5.0, max_workers=1, use_processes=False)
    m = RolloutManager(cfg, FakeDataset([10]), [SlowEngine()], buf, pool, eos_token_ids=[EOS])
    with caplog.at_level(logging.ERROR, logger="moe_async.rollout.manager"):
        _run(m, buf, 1)
    assert buf.cancels == ["error"] and m.metrics()["rollout/dropped/error:EngineTimeoutError"] == 1
    assert "engine 0 (http://127.0.0.1:9) /generate: no reply within 600.0 s (engine.request_timeout_s)" in caplog.text


def test_remote_reward_transport_errors_name_the_url():
    """A reward server that accepts but never answers, and one that is not there."""
    import socket

    from moe_async.rollout.rewards import RemoteReward
    from moe_async.rollout.tasks import Problem

    p = Problem("q", "1", {}, 0)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/score"
        with pytest.raises(TimeoutError, match=rf"rollout.reward_url='{url}': no reply within 0.5 s \(rollout.reward_timeout_s"):
            RemoteReward(url, timeout_s=0.5)(p, "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/score"  # bound, not listening: refused
        with pytest.raises(ConnectionError, match=rf"rollout.reward_url='{dead}': ConnectError"):
            RemoteReward(dead, timeout_s=0.5)(p, "1")
