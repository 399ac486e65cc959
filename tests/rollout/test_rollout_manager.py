"""RolloutManager with fake in-process engines and buffer: C5 (partial rollouts and
per-token versions), C7 (length checks), abort cap, 0-token completions, evaluate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.manager import RolloutManager
from moe_async.rollout.reward import RewardPool
from moe_async.rollout.tasks import Problem, extract_answer
from moe_async.types import Group

EOS = 2


@dataclass
class FakeOut:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    weight_version: int
    output_token_weight_versions: list[int]
    routed_experts: Any = None
    prompt_tokens: int = 0


class FakeEngine:
    """Scripted engine: each call pops ``(n_tokens, finish_reason, version)`` from the
    script; without a script it answers ``answer_ids + [EOS]`` at ``version``."""

    base_url, timeout_s = "fake://engine", 600.0

    def __init__(self, script: list[tuple[int, str, int]] | None = None, version: int = 0,
                 answer_ids: list[int] | None = None, empty_for_prompt_len: int | None = None,
                 context_len: int | None = None):
        self.script = list(script or [])
        self.version = version
        self.answer_ids = answer_ids or [11, 12, 13]
        self.empty_for_prompt_len = empty_for_prompt_len
        self.context_len = context_len
        self.calls: list[tuple[list[int], dict]] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False):
        self.calls.append((list(input_ids), dict(sampling_params)))
        max_new = sampling_params["max_new_tokens"]
        assert max_new >= 1
        if self.context_len is not None:  # a real engine would fail/truncate here
            assert len(input_ids) + max_new <= self.context_len, "request exceeds the context"
        await asyncio.sleep(0)
        if self.script:
            n, reason, v = self.script.pop(0)
            n = min(n, max_new)
            toks = [100 + len(input_ids) + k for k in range(n)]  # position-dependent ids
            return FakeOut(toks, [-0.5] * n, reason, v, [v] * n, prompt_tokens=len(input_ids))
        if self.empty_for_prompt_len is not None and len(input_ids) == self.empty_for_prompt_len:
            return FakeOut([], [], "stop", self.version, [], prompt_tokens=len(input_ids))
        toks = (self.answer_ids + [EOS])[:max_new]
        reason = "stop" if toks and toks[-1] == EOS else "length"
        n = len(toks)
        return FakeOut(toks, [-0.25] * n, reason, self.version, [self.version] * n,
                       prompt_tokens=len(input_ids))


class FakeBuffer:
    """Admits ``capacity`` groups at ``version``, then refuses."""

    admit_waits = False

    def __init__(self, capacity: int, version: int = 3):
        self.capacity = capacity
        self.version = version
        self.admitted = 0
        self.groups: list[Group] = []
        self.cancels: list[str] = []

    async def admit(self) -> int | None:
        if self.admitted >= self.capacity:
            return None
        self.admitted += 1
        return self.version

    async def put(self, group: Group) -> None:
        self.groups.append(group)

    async def cancel(self, reason: str = "cancelled") -> None:
        self.cancels.append(reason)

    @property
    def settled(self) -> int:
        return len(self.groups) + len(self.cancels)


class FakeDataset:
    """Problems whose prompts have the given token lengths (cycled); gold answer '7'."""

    def __init__(self, prompt_lens: list[int]):
        self.prompt_lens = prompt_lens
        self.i = 0

    def next_train(self) -> Problem:
        L = self.prompt_lens[self.i % len(self.prompt_lens)]
        p = Problem(f"q{self.i}", "7", {"answer": "7", "len": L}, self.i)
        self.i += 1
        return p

    def build_prompt_ids(self, p: Problem) -> list[int]:
        return [5] * p.entry["len"]

    def decode(self, ids: list[int]) -> str:
        return "The answer is 7." if ids and ids[0] == 11 else "I do not know."

    def score(self, p: Problem, text: str) -> float:
        return 1.0 if extract_answer(text) == p.answer else 0.0


def _run(manager: RolloutManager, buffer: FakeBuffer, n_settled: int, timeout: float = 10.0) -> None:
    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(manager.run(stop))
        while buffer.settled < n_settled:
            if task.done():
                task.result()
                break
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(task, timeout)

    asyncio.run(asyncio.wait_for(main(), timeout))


def _manager(cfg, ds, engines, buf, ctx=4096):
    pool = RewardPool(ds.score, timeout_s=5.0, max_workers=2, use_processes=False)
    return RolloutManager(cfg, ds, engines, buf, pool, eos_token_ids=[EOS], max_context_len=ctx)


C5_SCRIPT = [(2, "abort", 2), (2, "abort", 4), (8, "stop", 6)]


def test_c5_partial_rollout_per_token_versions() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=16,
                        partial_rollout=True)
    eng = FakeEngine(script=C5_SCRIPT)
    buf = FakeBuffer(capacity=1, version=2)
    m = _manager(cfg, FakeDataset([10]), [eng], buf)
    _run(m, buf, 1)
    (g,) = buf.groups
    (s,) = g.samples
    assert s.weight_versions == [2, 2, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6]
    assert len(s.response_ids) == 12 and len(s.rollout_logprobs) == 12
    assert s.oldest_version == 2 and g.oldest_version == 2 and g.start_version == 2
    assert s.finish_reason == "stop" and s.metadata["aborts"] == 2
    # continuations: prompt + tokens so far, with the remaining budget
    assert [len(c[0]) for c in eng.calls] == [10, 12, 14]
    assert [c[1]["max_new_tokens"] for c in eng.calls] == [16, 14, 12]
    assert eng.calls[2][0][10:] == s.response_ids[:4]
    assert s.prompt_ids == [5] * 10
    assert m.metrics()["rollout/aborts"] == 2.0


def test_c5_restart_without_partial_rollout() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=16,
                        partial_rollout=False)
    eng = FakeEngine(script=C5_SCRIPT)
    buf = FakeBuffer(capacity=1, version=2)
    m = _manager(cfg, FakeDataset([10]), [eng], buf)
    _run(m, buf, 1)
    (s,) = buf.groups[0].samples
    assert s.weight_versions == [6] * 8 and len(s.response_ids) == 8
    assert s.oldest_version == 6
    assert all(len(c[0]) == 10 and c[1]["max_new_tokens"] == 16 for c in eng.calls)


def test_abort_cap_drops_group_and_cancels() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=16,
                        max_abort_retries=3)
    eng = FakeEngine(script=[(0, "abort", 1)] * 100)
    buf = FakeBuffer(capacity=1)
    m = _manager(cfg, FakeDataset([10]), [eng], buf)
    _run(m, buf, 1)
    assert buf.groups == [] and buf.cancels == ["abort_retries"]
    assert m.metrics()["rollout/dropped/abort_retries"] == 1.0


def test_c7_length_checks_before_sending() -> None:
    """Context 64; prompts of 64, 63 and 57 tokens; max_new_tokens=16."""
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=16)
    eng = FakeEngine(context_len=64, empty_for_prompt_len=63)
    buf = FakeBuffer(capacity=3)
    m = _manager(cfg, FakeDataset([64, 63, 57]), [eng], buf, ctx=64)
    _run(m, buf, 3)
    assert buf.cancels == ["prompt_too_long"]
    assert m.metrics()["rollout/dropped/prompt_too_long"] == 1.0
    by_len = {len(g.samples[0].prompt_ids): g for g in buf.groups}
    assert set(by_len) == {63, 57}  # prompts never cut
    sent = {len(ids): sp["max_new_tokens"] for ids, sp in eng.calls}
    assert sent == {63: 1, 57: 7}
    for s in by_len[63].samples:  # 0-token completion
        assert s.response_ids == [] and s.finish_reason == "length" and s.loss_weight == 0.0
        assert s.reward == 0.0
    for s in by_len[57].samples:
        assert len(s.prompt_ids) + len(s.response_ids) <= 64 and s.loss_weight == 1.0
    assert m.metrics()["rollout/max_new_tokens_clamped"] == 2.0


def test_groups_rewards_round_robin_and_metrics() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=4, max_concurrent_groups=2, max_new_tokens=8)
    engines = [FakeEngine(version=3), FakeEngine(version=3, answer_ids=[21, 22])]
    buf = FakeBuffer(capacity=4)
    m = _manager(cfg, FakeDataset([10]), engines, buf)
    _run(m, buf, 4)
    assert len(buf.groups) == 4 and buf.cancels == []
    assert sorted(g.group_id for g in buf.groups) == [0, 1, 2, 3]
    assert len(engines[0].calls) == len(engines[1].calls) == 8
    for g in buf.groups:
        assert len(g.samples) == 4 and g.start_version == 3
        for s in g.samples:
            s.validate()
            assert s.reward == (1.0 if s.response_ids[0] == 11 else 0.0)
            assert s.reward_error is None and s.answer == "7"
            assert s.finish_reason == "stop" and s.response_ids[-1] == EOS
            assert s.weight_versions == [3] * len(s.response_ids)
    mt = m.metrics()
    assert mt["rollout/groups_produced"] == 4 and mt["rollout/samples_generated"] == 16
    assert mt["rollout/tokens_generated"] == sum(g.num_tokens for g in buf.groups)
    assert mt["rollout/request_seconds_sum"] >= mt["rollout/gen_wall_seconds"] > 0 and "rollout/engine_busy_s/1" in mt
    assert "rollout/gen_seconds" not in mt  # replaced: it was the per-request sum under a wall-time name
    assert engines[0].calls[0][1]["stop_token_ids"] == [EOS]


def test_gen_wall_seconds_counts_overlapping_requests_once(monkeypatch) -> None:
    """On a scripted clock: A on engine 0 over [0, 3], B on engine 1 over [0, 5], C on engine
    0 over [10, 12]. Wall-clock span of generation = 5 + 2 = 7 s (overlap counted once); the
    per-request sum is 3 + 5 + 2 = 10 s (the old rollout/gen_seconds)."""
    import types

    import moe_async.rollout.engine_router as router_mod  # the busy clocks live with the request routing

    clock = [0.0]
    monkeypatch.setattr(router_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    class Gated:
        def __init__(self):
            self.gate = asyncio.Event()

        async def generate(self, *a, **k):
            await self.gate.wait()
            self.gate.clear()

    engines = [Gated(), Gated()]
    m = _manager(RolloutConfig(n_samples_per_prompt=1), FakeDataset([10]), engines, FakeBuffer(capacity=1))
    sp = {"max_new_tokens": 4}

    async def main() -> list[dict]:
        seen = []
        ta = asyncio.create_task(m._call_engine([5, 6], sp))  # round robin: engine 0
        tb = asyncio.create_task(m._call_engine([5, 6], sp))  # engine 1
        await asyncio.sleep(0)
        clock[0] = 3.0
        engines[0].gate.set()
        await ta
        seen.append(m.metrics())  # B still outstanding
        clock[0] = 5.0
        engines[1].gate.set()
        await tb
        clock[0] = 10.0
        seen.append(m.metrics())  # idle 5..10
        tc = asyncio.create_task(m._call_engine([5, 6], sp))  # engine 0
        await asyncio.sleep(0)
        clock[0] = 12.0
        engines[0].gate.set()
        await tc
        seen.append(m.metrics())
        return seen

    at3, at10, at12 = asyncio.run(main())
    keys = ("rollout/gen_wall_seconds", "rollout/request_seconds_sum", "rollout/engine_busy_s/0",
            "rollout/engine_busy_s/1")
    assert [at3[k] for k in keys] == [3.0, 3.0, 3.0, 3.0]
    assert [at10[k] for k in keys] == [5.0, 8.0, 3.0, 5.0]
    assert [at12[k] for k in keys] == [7.0, 10.0, 5.0, 5.0]
    assert at12["rollout/requests"] == 3.0


class Hanging(FakeEngine):
    """An engine whose requests never finish (in flight until cancelled)."""

    async def generate(self, *a, **k):
        await asyncio.sleep(3600)


def test_stop_cancels_in_flight_groups() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=2)
    buf = FakeBuffer(capacity=10)
    m = _manager(cfg, FakeDataset([10]), [Hanging()], buf)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(m.run(stop))
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert buf.admitted == 2 and buf.cancels == ["stopped", "stopped"] and buf.groups == []
    mt = m.metrics()  # in flight when the run ended: counted as such, not as dropped samples
    assert mt["rollout/in_flight_at_stop"] == 2.0 and mt["rollout/dropped_total"] == 0.0
    assert not any(k.startswith("rollout/dropped/") for k in mt)


def test_stop_during_admit_settles_the_admission() -> None:
    """stop is set while buffer.admit() is awaited: the group task is created and cancelled
    before its first step (its coroutine never runs, so its own except-path cannot return the
    slot). The run still settles that admission as stopped: admitted == put + cancelled."""
    class StopOnAdmit(FakeBuffer):
        stop: asyncio.Event | None = None

        async def admit(self):
            v = await super().admit()
            if v is not None and self.admitted == 2:
                self.stop.set()  # the run ends while this admission is being granted
            return v

    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=4)
    buf = StopOnAdmit(capacity=10)
    m = _manager(cfg, FakeDataset([10]), [Hanging()], buf)

    async def main():
        buf.stop = asyncio.Event()
        await asyncio.wait_for(m.run(buf.stop), 5)

    asyncio.run(main())
    assert buf.admitted == 2 and buf.groups == []
    assert buf.cancels == ["stopped", "stopped"]
    assert m.metrics()["rollout/in_flight_at_stop"] == 2.0


def test_evaluate_greedy() -> None:
    cfg = RolloutConfig(max_new_tokens=8)
    eng = FakeEngine()
    m = _manager(cfg, FakeDataset([10]), [eng], FakeBuffer(0))
    ds = m.dataset
    probs = [ds.next_train() for _ in range(3)]
    res = asyncio.run(m.evaluate(probs, 5))
    assert res["accuracy"] == 1.0 and res["n"] == 3 and res["mean_response_len"] == 4.0
    assert res["task_accuracy"] == 1.0 and res["reward_mean"] == 1.0
    assert all(sp["temperature"] == 0.0 and sp["max_new_tokens"] == 5 for _, sp in eng.calls)


def test_evaluate_scores_with_the_configured_reward() -> None:
    """Eval uses the training reward (the pool), not the task's exact-match scorer; the
    latter is reported beside it as task_accuracy."""
    cfg = RolloutConfig(max_new_tokens=8)
    ds = FakeDataset([10])
    half = RewardPool(lambda p, text: 0.5 if "7" in text else 0.0, timeout_s=5.0, max_workers=1,
                      use_processes=False)
    m = RolloutManager(cfg, ds, [FakeEngine()], FakeBuffer(0), half, eos_token_ids=[EOS])
    probs = [ds.next_train() for _ in range(3)]
    res = asyncio.run(m.evaluate(probs, 5))
    assert res["reward_mean"] == 0.5 and res["accuracy"] == 0.0  # configured reward: 0.5 each
    assert res["task_accuracy"] == 1.0 and res["n"] == 3 and res["reward_errors"] == 0

    def boom(p, text):
        raise RuntimeError("scorer failed")

    m = RolloutManager(cfg, ds, [FakeEngine()], FakeBuffer(0),
                       RewardPool(boom, timeout_s=5.0, max_workers=1, use_processes=False), eos_token_ids=[EOS])
    res = asyncio.run(m.evaluate(probs, 5))
    assert res["reward_errors"] == 3 and res["reward_mean"] == 0.0 and res["task_accuracy"] == 1.0


def test_reward_errors_are_reported_naming_the_setting(caplog) -> None:
    """A reward function that raises on every sample scores 0 (C8) but its message must be
    visible once, naming rollout.reward_function, not only counted."""
    import logging

    class RaisingDataset(FakeDataset):
        def score(self, p: Problem, text: str) -> float:
            raise RuntimeError("boom from user reward")

    cfg = RolloutConfig(n_samples_per_prompt=4, max_concurrent_groups=2, max_new_tokens=8,
                        reward="function", reward_function="tests.rollout._user_rewards:returns_text")
    buf = FakeBuffer(capacity=3)
    m = _manager(cfg, RaisingDataset([10]), [FakeEngine(version=3)], buf)
    with caplog.at_level(logging.WARNING, logger="moe_async.rollout.manager"):
        _run(m, buf, 3)
    assert m.metrics()["rollout/reward_errors"] == 12
    msgs = [r.getMessage() for r in caplog.records if "reward error" in r.getMessage()]
    assert len(msgs) == 1, msgs  # each distinct message once, not once per sample
    assert "boom from user reward" in msgs[0] and "rollout.reward_function=" in msgs[0]


def test_a_whole_epoch_of_prompts_too_long_stops_the_loop_instead_of_drawing_forever() -> None:
    """Every train prompt fills the context: after one epoch of drops the loop raises, naming the
    counts and the context, instead of drawing and dropping forever with no step and no error."""
    from moe_async.rollout.failures import PromptsAllDroppedError

    class ThreeRows(FakeDataset):
        n = 3  # train rows an epoch

    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    eng = FakeEngine()
    buf = FakeBuffer(capacity=4, version=0)
    m = _manager(cfg, ThreeRows([70, 80, 90]), [eng], buf, ctx=64)
    with pytest.raises(PromptsAllDroppedError, match=r"last 3 train prompts \(3 rows an epoch\).*context of 64 tokens: 3"):
        _run(m, buf, 1)
    assert eng.calls == [] and buf.groups == []


def test_prompts_over_data_max_prompt_length_are_skipped_before_generation_and_counted() -> None:
    """data.max_prompt_length (FileDataset.max_prompt_length): a longer prompt never reaches an
    engine and is counted as rollout/dropped/prompt_over_max_length; one at the cap is generated."""
    class Capped(FakeDataset):
        max_prompt_length = 15

    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    eng = FakeEngine()
    buf = FakeBuffer(capacity=4, version=0)
    m = _manager(cfg, Capped([10, 20, 15, 16]), [eng], buf)
    _run(m, buf, 4)
    assert sorted({len(ids) for ids, _ in eng.calls}) == [10, 15] and len(eng.calls) == 4
    assert len(buf.groups) == 2 and buf.cancels == ["prompt_over_max_length"] * 2
    assert m.metrics()["rollout/dropped/prompt_over_max_length"] == 2.0


def test_groups_failing_one_after_another_stop_the_loop_naming_the_error() -> None:
    """A fault every group hits (an environment or tool setting, a bad row format) used to be
    logged group after group forever with no step trained; after MAX_GROUP_ERRORS_IN_A_ROW the
    loop raises, naming the last error."""
    from moe_async.rollout.failures import MAX_GROUP_ERRORS_IN_A_ROW, GroupsFailingError

    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    eng = FakeEngine()
    buf = FakeBuffer(capacity=10_000, version=0)
    m = _manager(cfg, FakeDataset([5, 6, 7]), [eng], buf)

    async def broken(*a, **kw):
        raise ValueError("no environment for this row")

    m._generate_sample = broken
    with pytest.raises(GroupsFailingError, match=rf"{MAX_GROUP_ERRORS_IN_A_ROW} groups in a row failed with an error, "
                                                 r"the last: ValueError: no environment for this row"):
        _run(m, buf, 10_000)
    assert buf.groups == [] and m.dropped["error:ValueError"] >= MAX_GROUP_ERRORS_IN_A_ROW
