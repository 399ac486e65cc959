"""RewardPool: per-sample timeout and error isolation (case C8)."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_async.rollout.reward import RewardPool
from moe_async.rollout.tasks import extract_answer

TIMEOUT_S = 2.0


def c8_scorer(gold: str, text: str) -> float:
    """Module-level (picklable) scorer with the C8 faults built in."""
    if text == "SLEEP":
        time.sleep(600)
    if text == "RAISE":
        raise ValueError("scorer exploded")
    return 1.0 if extract_answer(text) == gold else 0.0


def _c8_group() -> list[str]:
    texts = [f"The answer is {i}." for i in range(8)]
    texts[2] = "SLEEP"
    texts[5] = "RAISE"
    texts[7] = "\\boxed{" * ((1 << 20) // 7 + 1)  # ~1 MB of repeated \boxed{
    return texts


@pytest.mark.parametrize("use_processes", [True, False], ids=["processes", "threads"])
def test_c8_hang_raise_huge(use_processes: bool) -> None:
    texts = _c8_group()
    assert len(texts[7]) >= 1 << 20
    pool = RewardPool(c8_scorer, timeout_s=TIMEOUT_S, max_workers=8, use_processes=use_processes)
    try:
        async def main():
            # warm the workers (spawn start-up is not part of the step)
            await asyncio.gather(*(pool.score("0", "The answer is 0.") for _ in range(8)))
            t0 = time.monotonic()
            res = await asyncio.gather(*(pool.score(str(i), t) for i, t in enumerate(texts)))
            return res, time.monotonic() - t0

        res, dt = asyncio.run(main())
    finally:
        pool.close()
    assert dt < TIMEOUT_S + 3.0, f"step time {dt:.1f}s not bounded by the timeout"
    assert res[2].reward == 0.0 and res[2].error == "timeout"
    assert res[5].reward == 0.0 and res[5].error and "scorer exploded" in res[5].error
    assert res[7].reward == 0.0 and res[7].error is None
    for i in (0, 1, 3, 4, 6):
        assert res[i].reward == 1.0 and res[i].error is None, (i, res[i])
    assert pool.counters["timeouts"] == 1
    assert pool.counters["errors"] == 1
    m = pool.metrics()
    assert m["reward/timeouts"] == 1.0 and m["reward/errors"] == 1.0


def test_killed_worker_is_replaced() -> None:
    pool = RewardPool(c8_scorer, timeout_s=1.0, max_workers=1, use_processes=True)
    try:
        async def main():
            a = await pool.score("1", "SLEEP")
            b = await pool.score("1", "The answer is 1.")
            return a, b

        a, b = asyncio.run(main())
    finally:
        pool.close()
    assert a.error == "timeout"
    assert b.reward == 1.0 and b.error is None
    assert pool.counters["workers_killed"] == 1


def test_huge_answer_extraction_is_fast() -> None:
    t0 = time.monotonic()
    assert extract_answer("\\boxed{" * (1 << 18)) is None
    assert time.monotonic() - t0 < 0.5
