"""EnginePool.start / wait with fake engine actors and a fake ``ray.get`` (no Ray): start()
asks every engine to launch and returns without waiting (the driver builds the trainer ranks
meanwhile); wait() returns the URLs in engine-index order and names an engine that did not
start; dead_engines() before wait() names an engine as still starting, not ``at None``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_async.config import load_config
from moe_async.orchestration import engine_pool
from moe_async.orchestration.engine_pool import EnginePool
from tests.orchestration.test_resume import SMOKE


class _Ref:
    def __init__(self, value=None, error: Exception | None = None):
        self.value, self.error = value, error


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _FakeEngine:
    """An engine actor: ``launch`` records the call and hands back a reference to its URL."""

    log: list[str] = []

    def __init__(self, index: int, fail: bool = False, dead: str | None = None):
        self.index, self.fail = index, fail
        self.launch = _Method(self._launch)
        self.dead = _Method(lambda: _Ref(dead))

    def _launch(self):
        _FakeEngine.log.append(f"launch {self.index}")
        if self.fail:
            return _Ref(error=RuntimeError("server exited with code 1"))
        return _Ref(f"http://127.0.0.1:{9000 + self.index}")


class _FakeCls:
    """``cls.options(**slot.options()).remote(engine_cfg, model_path, index, host)``."""

    def __init__(self, fail: set[int], dead: dict[int, str]):
        self.fail, self.dead = fail, dead

    def options(self, **_):
        return SimpleNamespace(remote=lambda cfg, path, i, host: _FakeEngine(i, i in self.fail, self.dead.get(i)))


def _fake_get(ref, timeout=None):
    _FakeEngine.log.append("get")
    if isinstance(ref, list):
        return [_fake_get(r) for r in ref]
    if ref.error is not None:
        raise ref.error
    return ref.value


def _pool(monkeypatch, n: int, fail: set[int] = frozenset(), dead: dict[int, str] | None = None) -> EnginePool:
    monkeypatch.setattr(engine_pool.ray, "get", _fake_get)
    monkeypatch.setattr(engine_pool.ray, "nodes", lambda: [{"Alive": True}])
    _FakeEngine.log = []
    slots = [SimpleNamespace(options=dict, node_ip="127.0.0.1") for _ in range(n)]
    placement = SimpleNamespace(slots=slots, remove=lambda: None)
    cfg = load_config(SMOKE, [f"engine.num_engines={n}"])
    return EnginePool(cfg, "unused", placement=placement, actor_cls=_FakeCls(set(fail), dead or {}))


def test_start_launches_every_engine_without_waiting_then_wait_returns_urls_in_order(monkeypatch) -> None:
    pool = _pool(monkeypatch, 3)
    pool.start()
    assert _FakeEngine.log == ["launch 0", "launch 1", "launch 2"]  # no ray.get: the driver goes on
    assert pool.urls == [None, None, None]
    assert pool.wait() == ["http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert pool.urls == ["http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert _FakeEngine.log[3:] == ["get", "get", "get"]


def test_wait_names_the_engine_that_did_not_start(monkeypatch) -> None:
    pool = _pool(monkeypatch, 2, fail={1})
    pool.start()
    with pytest.raises(RuntimeError, match=r"^engine 1 \(node 127.0.0.1\) did not start: RuntimeError: server exited"):
        pool.wait()


def test_dead_engine_before_wait_is_named_as_still_starting(monkeypatch) -> None:
    pool = _pool(monkeypatch, 2, dead={0: "exited with code -9; log: x"})
    pool.start()
    assert pool.dead_engines() == ["engine 0 (still starting) exited with code -9; log: x"]
    pool.wait()
    assert pool.dead_engines() == ["engine 0 at http://127.0.0.1:9000 exited with code -9; log: x"]
