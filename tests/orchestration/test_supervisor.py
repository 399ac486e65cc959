"""C21: engine restarts capped per engine, a floor of healthy engines (orchestration/supervisor.py),
with a fake clock and fake engines (no processes)."""

from __future__ import annotations

import pytest

from moe_async.engines.config import EngineConfig
from moe_async.orchestration.supervisor import EngineFleetError, RestartPolicy, Supervisor


class Clock:
    def __init__(self) -> None:
        self.t = 0.0


class FakeEngine:
    """Alive from each (re)start until ``lifetime_s`` later (None: forever) or until killed."""

    def __init__(self, name: str, clock: Clock, lifetime_s: float | None = None, restart_fails: int = 0):
        self.name, self.clock, self.lifetime_s = name, clock, lifetime_s
        self.started = clock.t
        self.killed = False
        self.restart_calls = 0
        self.restart_fails = restart_fails

    def alive(self) -> bool:
        if self.killed:
            return False
        return self.lifetime_s is None or self.clock.t < self.started + self.lifetime_s

    def restart(self) -> None:
        self.restart_calls += 1
        if self.restart_fails:
            self.restart_fails -= 1
            raise RuntimeError("port in use")
        self.killed = False
        self.started = self.clock.t


def _fleet(clock, **kw):
    engines = [FakeEngine("http://e0", clock), FakeEngine("http://e1", clock),
               FakeEngine("http://e2", clock, lifetime_s=1.0, **kw)]
    return engines, Supervisor(engines, RestartPolicy([e.name for e in engines], max_restarts=2, min_healthy=2))


def test_c21_restarted_exactly_twice_then_retired_then_the_floor():
    """3 engines; engine 2 dies 1 s after each (re)start; max_restarts=2, min_healthy=2."""
    clock = Clock()
    engines, sup = _fleet(clock)
    events = []
    for step in range(1, 41):  # polled every 0.25 s for 10 s
        clock.t = step * 0.25
        got = sup.poll(clock.t)
        if got["restarted"] or got["retired"]:
            events.append((clock.t, got))
    assert events == [(1.0, {"restarted": [2], "retired": []}), (2.0, {"restarted": [2], "retired": []}),
                      (3.0, {"restarted": [], "retired": [2]})]
    assert engines[2].restart_calls == 2
    assert sup.policy.healthy() == [0, 1]  # training goes on on 2 engines
    assert sup.policy.metrics() == {"engine/restarts": 2.0, "engine/retired": 1.0, "engine/healthy": 2.0,
                                    "engine/restarts/0": 0.0, "engine/restarts/1": 0.0, "engine/restarts/2": 2.0}
    # a second engine dies: the run stops, naming both
    engines[0].killed = True
    clock.t = 11.0
    with pytest.raises(EngineFleetError) as ei:
        sup.poll(clock.t)
    msg = str(ei.value)
    assert msg.startswith("1 healthy engine(s) of 3, fewer than engine.min_healthy_engines=2")
    assert "engine 2 (http://e2) retired after 2 restart(s); last: not alive" in msg
    assert "engine 0 (http://e0) down (restarted 0 time(s) before); last: not alive" in msg
    assert engines[0].restart_calls == 0  # stopped, not restarted below the floor


def test_a_failing_restart_counts_as_a_restart():
    clock = Clock()
    engines, sup = _fleet(clock, restart_fails=5)
    clock.t = 1.5
    assert sup.poll(clock.t) == {"restarted": [], "retired": [2]}
    assert engines[2].restart_calls == 2
    rec = sup.policy.engines[2]
    assert rec.retired and rec.restarts == 2 and rec.last_reason == "restart failed: RuntimeError: port in use"


def test_no_restarts_retires_at_once_and_bounds_are_checked():
    p = RestartPolicy(["a", "b"], max_restarts=0, min_healthy=1)
    assert p.on_death(1, 0.0) == "retire" and p.healthy() == [0]
    with pytest.raises(ValueError, match="retired"):
        p.on_death(1, 1.0)
    with pytest.raises(EngineFleetError, match="engine 0 .a. retired after 0 restart"):
        p.on_death(0, 2.0, "exit code -9")
    with pytest.raises(ValueError, match="min_healthy_engines=3 must be in 1..2"):
        RestartPolicy(["a", "b"], 1, 3)


def test_engine_config_fields():
    c = EngineConfig()
    assert (c.max_restarts, c.min_healthy_engines) == (2, 1)
    with pytest.raises(ValueError, match="min_healthy_engines=3 is more than engine.num_engines=2"):
        EngineConfig(num_engines=2, min_healthy_engines=3)
    with pytest.raises(ValueError):
        EngineConfig(max_restarts=-1)
