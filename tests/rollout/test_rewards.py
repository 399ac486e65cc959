"""Built-in rewards selected by rollout.reward: math-verify, user function, remote HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _launch import free_port

from moe_async.config import ConfigError, load_config
from moe_async.rollout.reward import RewardPool
from moe_async.rollout.rewards import (
    FunctionReward,
    MathVerifyReward,
    RemoteReward,
    RewardValueError,
    build_reward_fn,
    check_reward_value,
)

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "configs"


@pytest.fixture(autouse=True)
def _user_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def P(answer, question="q"):
    return SimpleNamespace(answer=answer, question=question)


def test_math_verify_boxed():
    mv = MathVerifyReward()
    assert mv(P("12"), "3 * 4 = 12, so the answer is \\boxed{12}.") == 1.0
    assert mv(P("12"), "the answer is \\boxed{13}") == 0.0
    assert mv(P("1/2"), "\\boxed{\\frac{1}{2}}") == 1.0
    assert mv(P("0.5"), "\\boxed{\\frac{1}{2}}") == 1.0
    assert mv(P("12"), "no idea") == 0.0
    # C8's 1 MB of repeated \boxed{ costs one bounded parse of the tail, not a hang
    t0 = time.monotonic()
    assert mv(P("12"), "\\boxed{" * ((1 << 20) // 7 + 1)) == 0.0
    assert time.monotonic() - t0 < 30


def test_function_reward_by_import_path():
    fn = FunctionReward("_user_rewards:contains_answer")
    assert fn(P("7"), "The answer is 7.") == 1.0 and fn(P("7"), "8") == 0.0
    import pickle

    fn2 = pickle.loads(pickle.dumps(fn))  # what the process pool does
    assert fn2(P("7"), "7") == 1.0


@pytest.mark.parametrize(
    "path, needle",
    [
        ("no_colon_here", "must be an import path"),
        ("_no_such_module_xyz:f", "cannot import module '_no_such_module_xyz'"),
        ("_user_rewards:missing", "has no attribute 'missing'"),
        ("_user_rewards:NOT_CALLABLE", "not callable"),
    ],
)
def test_bad_import_path_rejected_at_load(path, needle):
    with pytest.raises(ConfigError, match="rollout.reward_function") as ei:
        load_config(CONFIGS / "cpu_smoke.yaml", ["rollout.reward=function", f"rollout.reward_function={path}"])
    assert needle in str(ei.value)
    with pytest.raises(ConfigError, match="rollout.reward_function"):
        load_config(CONFIGS / "cpu_smoke.yaml", ["rollout.reward=function"])  # missing


def test_good_function_config_loads_and_builds():
    cfg = load_config(CONFIGS / "cpu_smoke.yaml",
                      ["rollout.reward=function", "rollout.reward_function=_user_rewards:contains_answer"])
    assert build_reward_fn(cfg.rollout, None)(P("5"), "5") == 1.0
    with pytest.raises(ConfigError, match="rollout.reward_url"):
        load_config(CONFIGS / "cpu_smoke.yaml", ["rollout.reward=remote"])


@pytest.mark.parametrize("value", ["high", None, float("nan"), float("inf"), [1.0]])
def test_bad_return_values_name_the_field(value):
    with pytest.raises(RewardValueError, match="rollout.reward_function.*expected a finite number"):
        check_reward_value(value, "rollout.reward_function 'm:f'")
    assert check_reward_value(True, "x") == 1.0 and check_reward_value(3, "x") == 3.0


def test_bad_return_value_is_a_recorded_sample_error():
    pool = RewardPool(FunctionReward("_user_rewards:returns_text"), timeout_s=5, use_processes=False)
    try:
        r = asyncio.run(pool.score(P("1"), "x"))
    finally:
        pool.close()
    assert r.reward == 0.0 and "rollout.reward_function '_user_rewards:returns_text' returned 'high'" in r.error
    assert pool.counters["errors"] == 1


# ------------------------------------------------------------------ remote reward model
@pytest.fixture(scope="module")
def reward_server():
    import uvicorn
    from fastapi import FastAPI, HTTPException

    app = FastAPI()

    @app.post("/score")
    def score(body: dict):
        return {"reward": 1.0 if body["answer"] in body["response"] else 0.0, "q": body["question"]}

    @app.post("/broken")
    def broken(body: dict):
        raise HTTPException(500, "model crashed")

    @app.post("/nokey")
    def nokey(body: dict):
        return {"score": 1}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(timeout=10)


def test_remote_reward_model(reward_server):
    rm = RemoteReward(reward_server + "/score", timeout_s=5)
    assert rm(P("42"), "it is 42") == 1.0 and rm(P("42"), "it is 41") == 0.0
    with pytest.raises(RewardValueError, match=r"rollout.reward_url=.*HTTP 500"):
        RemoteReward(reward_server + "/broken")(P("1"), "1")
    with pytest.raises(RewardValueError, match="rollout.reward_url=.*no 'reward' key"):
        RemoteReward(reward_server + "/nokey")(P("1"), "1")
    cfg = load_config(CONFIGS / "cpu_smoke.yaml", ["rollout.reward=remote", f"rollout.reward_url={reward_server}/score"])
    pool = RewardPool(build_reward_fn(cfg.rollout, None), timeout_s=5, use_processes=False)
    try:
        async def main():
            return await asyncio.gather(pool.score(P("3"), "3"), pool.score(P("3"), "4"))

        res = asyncio.run(main())
    finally:
        pool.close()
    assert [r.reward for r in res] == [1.0, 0.0] and all(r.error is None for r in res)
