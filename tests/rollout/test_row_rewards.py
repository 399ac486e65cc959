"""Rewards chosen per row by data_source: the built-ins against math-verify / reasoning-gym's
own scorers, a verl reward file used unchanged, module:function, and failures named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moe_async.data.rows import Row
from moe_async.rollout.reward import RewardPool
from moe_async.rollout.rewards import RewardConfigError, RewardValueError
from moe_async.rollout.row_rewards import RowReward, check_spec, exact_match, gsm8k_score

VERL_FILE = str(Path(__file__).with_name("_verl_reward.py"))


def _row(answer: str, source: str | None, **kw) -> Row:
    return Row(prompt="q", answer=answer, data_source=source, **kw)


def test_builtins() -> None:
    r = RowReward({"mine": "math_verify", "ex": "exact_match"}, None)
    assert r(_row("\\frac{1}{2}", "mine"), "so the result is \\boxed{0.5}") == 1.0
    assert r(_row("\\frac{1}{2}", "mine"), "so the result is \\boxed{0.6}") == 0.0
    # GSM8K: the raw answer's text after ####, the response's #### answer (known data source)
    assert r(_row("48/2 = 24 apples\n#### 1,024", "openai/gsm8k"), "Steps... #### 1024") == 1.0
    assert gsm8k_score("#### 72", "The total is \\boxed{72}.") == 1.0
    assert gsm8k_score("#### 72", "#### 71") == 0.0
    assert r(_row("Paris", "ex"), "The answer is Paris.") == 1.0
    assert exact_match("12", "I think 3 then 12") == 1.0 and exact_match("12", "12 then 3") == 0.0


def test_reasoning_gym_source_matches_the_task_scorer() -> None:
    from moe_async.rollout.config import RolloutConfig
    from moe_async.rollout.tasks import TaskDataset

    td = TaskDataset(RolloutConfig(train_size=20, eval_size=0))
    r = RowReward({}, None)
    for p in td.train[:10]:
        row = _row(p.answer, "basic_arithmetic", metadata={"reasoning_gym": p.entry["metadata"]})
        for resp in (f"The answer is {p.answer}.", "The answer is 1234.", f"so {p.answer}", ""):
            assert r(row, resp) == td.score(p, resp)


def test_verl_file_used_unchanged_and_function_spec() -> None:
    r = RowReward({"openai/gsm8k": f"verl:{VERL_FILE}",
                   "tq": f"verl:{VERL_FILE}:compute_score"}, "function:tests.rollout._user_rewards:contains_answer")
    assert r(_row("72", "openai/gsm8k"), "... #### 72") == 1.0  # data.rewards before the built-in
    assert r(_row("72", "openai/gsm8k"), "\\boxed{72}") == 0.0  # verl's strict format, not math-verify
    r2 = RowReward({"const_quarter": f"verl:{VERL_FILE}", "const_three_quarters": f"verl:{VERL_FILE}"}, None)
    assert r2(_row("1", "const_quarter"), "x") == 0.25
    assert r2(_row("1", "const_three_quarters"), "x") == 0.75  # a dict result's "score"
    assert r(_row("7", "other"), "it is 7") == 1.0 and r(_row("7", "other"), "it is 8") == 0.0


def test_failures_are_named() -> None:
    r = RowReward({"raises": f"verl:{VERL_FILE}", "text": "function:tests.rollout._user_rewards:returns_text"}, None)
    with pytest.raises(RuntimeError, match="on purpose"):
        r(_row("1", "raises"), "x")
    with pytest.raises(RewardValueError, match="returns_text.*'high'|'high'.*"):
        r(_row("1", "text"), "x")
    with pytest.raises(RewardConfigError, match="no reward for data_source 'nope'"):
        r(_row("1", "nope"), "x")
    with pytest.raises(RewardConfigError, match="does not exist"):
        check_spec("verl:/no/such/file.py", "data.rewards['x']")
    with pytest.raises(RewardConfigError, match="not a reward spec"):
        check_spec("math_verfy", "data.default_reward")
    with pytest.raises(RewardConfigError, match="http"):
        check_spec("remote:localhost:80", "data.default_reward")
    with pytest.raises(RewardConfigError, match="http"):
        check_spec("remote:http://", "data.default_reward")  # a URL without a host
    # a function spec's error names the data field it came from, not rollout.reward_function
    with pytest.raises(RewardConfigError, match=r"^data\.default_reward \('function:nonexist\.mod:fn'\)=.*cannot import"):
        check_spec("function:nonexist.mod:fn", "data.default_reward")


def test_row_reward_in_worker_processes() -> None:
    """Picklable: scored in the reward pool's spawned workers, errors recorded per sample."""
    pool = RewardPool(RowReward({"const_quarter": f"verl:{VERL_FILE}", "raises": f"verl:{VERL_FILE}"},
                                "exact_match"), timeout_s=60, max_workers=1)
    try:
        async def go():
            return [await pool.score(_row("1", s), "The answer is 1.") for s in ("const_quarter", "raises", None)]
        a, b, c = asyncio.run(go())
    finally:
        pool.close()
    assert (a.reward, a.error) == (0.25, None)
    assert b.reward == 0.0 and "on purpose" in b.error
    assert (c.reward, c.error) == (1.0, None)


def test_math_verify_off_the_main_thread_scores_without_its_timeout_warning(caplog) -> None:
    """In the reward pool's threads math-verify's SIGALRM timeout is off and it warns once; the
    pool bounds the call, so that warning is not shown (it reached the console with raw colour
    codes); the score itself is unchanged."""
    import threading

    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = False
    math_verify.grader.TIMEOUT_WARNING_SHOWN = False
    r = RowReward({"m": "math_verify"}, None)
    out = []
    with caplog.at_level("WARNING"):
        t = threading.Thread(target=lambda: out.append(r(_row("\\frac{1}{2}", "m"), "\\boxed{0.5}")))
        t.start()
        t.join()
    assert out == [1.0]
    assert not [rec for rec in caplog.records if "Timeout is disabled" in rec.getMessage()]
    assert math_verify.parser.TIMEOUT_WARNING_SHOWN  # it was about to warn: the filter dropped it
