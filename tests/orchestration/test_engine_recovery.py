"""EngineRecovery (moe_async/orchestration/engine_recovery.py) against fake pool, trainer,
rollout and buffer: the order of a recovery (C19: out of routing, restart, group re-formed
with every live member and the replacement (C20), weights sent, version acknowledged, only
then back into routing), a failed acknowledgement keeps the replacement out of routing, and
C21's restart cap and healthy floor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_async.orchestration.engine_recovery import EngineRecovery
from moe_async.orchestration.supervisor import EngineFleetError
from moe_async.weight_sync.group import WeightSyncError


class _Remote:
    """``obj.method.remote(*a)`` calls ``fn(*a)`` (ray.get is patched to return it)."""

    def __init__(self, fn):
        self.remote = fn


class World:
    """The fakes share one event log and the engines' held versions."""

    def __init__(self, n: int, trainer_version: int = 5):
        self.log: list[tuple] = []
        self.urls = [f"http://e{i}" for i in range(n)]
        self.held = {u: trainer_version for u in self.urls}
        self.dead: set[int] = set()
        self.version = trainer_version
        self.group: list[str] = list(self.urls)
        self.mask = [True] * n
        self.ack_ok = True
        w = self

        class Pool:
            urls = list(w.urls)

            def dead_engines(self):
                return [f"engine {i} at {w.urls[i]} exited with code -9; log: x" for i in sorted(w.dead)]

            def restart(self, i, timeout_s):
                w.log.append(("restart", i))
                w.dead.discard(i)
                w.held[w.urls[i]] = 0  # a replacement starts from the base weights
                return w.urls[i]

        class Trainer:
            def reconnect_engines(self, urls):
                w.log.append(("reconnect", tuple(urls)))
                w.group = list(urls)

            def sync_weights(self):
                w.log.append(("sync", w.version))
                for u in w.group:
                    w.held[u] = w.version if w.ack_ok else w.version - 1
                return {"sync/seconds": 0.1}

            def version(self):
                return w.version

            def check_engines(self, urls):
                return {}

        def set_routable(i, ok):
            w.log.append(("routable", i, ok))
            w.mask[i] = ok

        self.pool, self.trainer = Pool(), Trainer()
        self.rollout = SimpleNamespace(set_routable=_Remote(set_routable), routable=_Remote(lambda: list(w.mask)))
        self.buffer = SimpleNamespace(set_engine_version=_Remote(lambda v: w.log.append(("buffer_version", v))))

        class Client:
            def __init__(self, url, timeout_s=None):
                self.url = url

            def get_weight_version(self):
                return w.held[self.url]

            def health(self, timeout=5.0):
                return True

        self.client_cls = Client


def _recovery(w: World, monkeypatch, max_restarts=2, min_healthy=1, check=False) -> EngineRecovery:
    import ray

    import moe_async.engines.client as client_mod

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(client_mod, "SyncEngineClient", w.client_cls)
    cfg = SimpleNamespace(engine=SimpleNamespace(max_restarts=max_restarts, min_healthy_engines=min_healthy,
                                                 startup_timeout_s=60.0),
                          weight_sync=SimpleNamespace(check=check, timeout_s=30.0))
    return EngineRecovery(cfg, w.pool, w.trainer, w.rollout, w.buffer)


def test_c19_c20_replacement_routed_only_after_it_acknowledged_the_version(monkeypatch) -> None:
    w = World(2, trainer_version=5)
    rec = _recovery(w, monkeypatch)
    assert rec.check() == {}  # nothing dead: nothing done
    assert w.log == []
    w.dead.add(1)
    m = rec.check()
    assert w.log == [("routable", 1, False), ("restart", 1), ("reconnect", ("http://e0", "http://e1")),
                     ("sync", 5), ("buffer_version", 5), ("routable", 1, True)]
    assert w.held == {"http://e0": 5, "http://e1": 5}
    assert m["engine/weight_version"] == 5.0 and m["engine/restarts"] == 1.0 and m["engine/restarts/1"] == 1.0
    assert m["engine/healthy"] == 2.0 and m["engine/recovery_syncs"] == 1.0
    assert rec.events[-1] == "engine 1 at http://e1 rejoined at weight_version 5"


def test_c19_failed_acknowledgement_keeps_the_replacement_out_of_routing(monkeypatch) -> None:
    w = World(2, trainer_version=5)
    rec = _recovery(w, monkeypatch)
    w.dead.add(0)
    w.ack_ok = False  # the sync "succeeds" but the engine reports another version
    with pytest.raises(WeightSyncError, match=r"engine 0 at http://e0 holds weight_version 4 after the recovery "
                                              r"sync of version 5: not put back into routing"):
        rec.check()
    assert ("routable", 0, True) not in w.log and w.mask[0] is False


def test_c21_restarted_twice_then_retired_then_two_down_stops_naming_both(monkeypatch) -> None:
    w = World(3, trainer_version=2)
    rec = _recovery(w, monkeypatch, max_restarts=2, min_healthy=2)
    for _ in range(2):  # engine 2 dies after each restart
        w.dead.add(2)
        rec.check()
    assert [e for e in w.log if e[0] == "restart"] == [("restart", 2), ("restart", 2)]
    w.dead.add(2)
    w.log.clear()
    m = rec.check()  # third death: retired, the group re-formed without it, training goes on on 2
    assert ("restart", 2) not in w.log and ("reconnect", ("http://e0", "http://e1")) in w.log
    assert m["engine/retired"] == 1.0 and m["engine/healthy"] == 2.0 and m["engine/restarts/2"] == 2.0
    assert rec.live_urls() == ["http://e0", "http://e1"]
    assert w.mask == [True, True, False]
    w.dead.add(0)  # a second engine down: below min_healthy=2
    with pytest.raises(EngineFleetError) as ei:
        rec.check()
    msg = str(ei.value)
    assert "fewer than engine.min_healthy_engines=2" in msg
    assert "engine 2 (http://e2) retired after 2 restart(s)" in msg and "engine 0 (http://e0) down" in msg


def test_only_engine_dead_without_restarts_stops_the_run_naming_it(monkeypatch) -> None:
    """The default run's engine death with ``engine.max_restarts=0`` (cpu_smoke: one engine):
    retired at once, no restart tried, and the pass raises EngineFleetError naming the engine,
    its URL, the exit code, the floor and the cap (the restart path end to end:
    test_engine_recovery_e2e.py; this fault end to end, slow: test_engine_death.py)."""
    w = World(1, trainer_version=2)
    rec = _recovery(w, monkeypatch, max_restarts=0, min_healthy=1)
    w.dead.add(0)
    with pytest.raises(EngineFleetError) as ei:
        rec.check()
    assert str(ei.value) == ("0 healthy engine(s) of 1, fewer than engine.min_healthy_engines=1 "
                             "(engine.max_restarts=0); down: engine 0 (http://e0) retired after 0 restart(s); "
                             "last: engine 0 at http://e0 exited with code -9; log: x")
    assert w.log == [("routable", 0, False)] and w.mask == [False]  # out of routing, never restarted


def test_engine_taken_out_by_a_failed_request_readmitted_after_a_resync(monkeypatch) -> None:
    w = World(2, trainer_version=3)
    rec = _recovery(w, monkeypatch)
    w.mask[1] = False  # the rollout manager took it out (a 5xx), the process is alive
    m = rec.check()
    assert w.log == [("reconnect", ("http://e0", "http://e1")), ("sync", 3), ("buffer_version", 3),
                     ("routable", 1, True)]
    assert m["engine/readmitted"] == 1.0 and m["engine/restarts"] == 0.0


def _lost_in_sync(w: World, lost: list[int]):
    """The trainer's step sync loses ``lost`` (their processes die during it)."""
    from moe_async.weight_sync.outcome import SyncOutcome

    def sync_weights_outcome():
        w.log.append(("step_sync", w.version))
        w.dead.update(lost)
        return SyncOutcome({"sync/engines_lost": float(len(lost))}, [w.urls[i] for i in lost], "RuntimeError: x")

    w.trainer.sync_weights_outcome = sync_weights_outcome


@pytest.mark.parametrize("live_advanced", [False, True])
def test_engine_lost_during_the_step_sync_recovered_without_failing(monkeypatch, live_advanced) -> None:
    """Issue 19 (sync failure): the live engine, when it stayed on the previous version, leaves
    routing; the lost one is restarted; every member re-forms the group and gets the current
    weights; then the live one is routed again. Counted in engine/sync_failures."""
    w = World(2, trainer_version=5)
    w.held = {"http://e0": 5 if live_advanced else 4, "http://e1": 4}
    rec = _recovery(w, monkeypatch)
    _lost_in_sync(w, [1])
    m = rec.sync()
    out0 = [("routable", 0, False)] if not live_advanced else []
    back0 = [("routable", 0, True)] if not live_advanced else []
    assert w.log == [("step_sync", 5), *out0, ("routable", 1, False), ("restart", 1),
                     ("reconnect", ("http://e0", "http://e1")), ("sync", 5), ("buffer_version", 5),
                     ("routable", 1, True), *back0]
    assert w.held == {"http://e0": 5, "http://e1": 5} and w.mask == [True, True]
    assert m["engine/weight_version"] == 5.0 and m["engine/sync_failures"] == 1.0 and m["engine/restarts"] == 1.0
    assert m["sync/engines_lost"] == 1.0
    assert rec.events[0] == "weight sync of version 5 lost engine(s) http://e1: RuntimeError: x"


def test_step_sync_without_loss_sets_the_buffer_version(monkeypatch) -> None:
    from moe_async.weight_sync.outcome import SyncOutcome

    w = World(2, trainer_version=3)
    rec = _recovery(w, monkeypatch)
    w.trainer.sync_weights_outcome = lambda: SyncOutcome({"sync/seconds": 0.1})
    m = rec.sync()
    assert w.log == [("buffer_version", 3)]
    assert m == {"sync/seconds": 0.1, "engine/weight_version": 3.0}
    assert rec.metrics()["engine/sync_failures"] == 0.0
