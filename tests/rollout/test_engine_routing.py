"""RolloutManager routing under engine failure (C19 rollout side): a request to a dead
engine is retried on another and that engine leaves routing; an engine out of routing gets
no request; with none routable the request waits, then the group is dropped as
``engine_lost``."""

from __future__ import annotations

import asyncio

import httpx

from moe_async.rollout.config import RolloutConfig
from tests.rollout.test_rollout_manager import FakeBuffer, FakeDataset, FakeEngine, _manager, _run


class DeadEngine(FakeEngine):
    """Refuses every connection, as a killed engine's port does."""

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False):
        self.calls.append((list(input_ids), dict(sampling_params)))
        await asyncio.sleep(0)
        raise httpx.ConnectError("[Errno 111] Connection refused")


def test_dead_engine_request_retried_on_the_other_and_taken_out_of_routing() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    dead, live = DeadEngine(version=3), FakeEngine(version=3)
    buf = FakeBuffer(capacity=3, version=3)
    m = _manager(cfg, FakeDataset([4]), [dead, live], buf)
    _run(m, buf, 3)
    assert len(buf.groups) == 3 and buf.cancels == []  # nothing lost: 6 samples, all from engine 1
    assert len(dead.calls) == 1  # only the first request reached it; then out of routing
    assert len(live.calls) == 6
    assert m.routable == [False, True]
    assert m.metrics()["rollout/engine_request_retries"] == 1.0
    assert all(s.weight_versions == [3] * len(s.response_ids) for g in buf.groups for s in g.samples)


def test_engine_out_of_routing_gets_no_request_until_put_back() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    e0, e1 = FakeEngine(version=5), FakeEngine(version=5)
    buf = FakeBuffer(capacity=2, version=5)
    m = _manager(cfg, FakeDataset([4]), [e0, e1], buf)
    m.set_routable(1, False)  # the driver: engine 1 restarting, not yet at version 5
    _run(m, buf, 2)
    assert len(e0.calls) == 4 and e1.calls == []
    m.set_routable(1, True)
    buf.capacity = 4
    _run(m, buf, 4)
    assert len(e1.calls) == 2 and len(e0.calls) == 6  # round-robin again over both


def test_no_routable_engine_waits_then_drops_engine_lost() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=8)
    dead = DeadEngine()
    buf = FakeBuffer(capacity=1, version=0)
    m = _manager(cfg, FakeDataset([4]), [dead], buf)
    m.router.no_engine_wait_s = 0.3
    _run(m, buf, 1)
    assert buf.groups == [] and buf.cancels == ["engine_lost"]
    assert m.metrics()["rollout/dropped/engine_lost"] == 1.0
    assert len(dead.calls) == 1


def test_no_routable_engine_waits_for_one_put_back() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=8)
    e0 = FakeEngine(version=7)
    buf = FakeBuffer(capacity=1, version=7)
    m = _manager(cfg, FakeDataset([4]), [e0], buf)
    m.set_routable(0, False)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(m.run(stop))
        await asyncio.sleep(0.5)
        assert e0.calls == [] and buf.settled == 0  # waiting, not dropping
        m.set_routable(0, True)  # the restarted engine acknowledged the version
        while buf.settled < 1:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert len(buf.groups) == 1 and buf.cancels == [] and len(e0.calls) == 1
