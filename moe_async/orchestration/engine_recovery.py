"""Engine failure handled live in the driver (restart, rejoin the update group, re-sync, cap).

:meth:`EngineRecovery.check` runs between the driver's waits: a dead engine leaves request
routing at once, is restarted or retired by the restart policy, every live engine re-forms the
weight-update group, the trainer's weights are sent, and the engine is routed again only after
its ``/get_weight_version`` equals the trainer's. Too few healthy engines raises
:class:`~moe_async.orchestration.supervisor.EngineFleetError`.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from moe_async.orchestration.supervisor import RestartPolicy

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray import ObjectRef
    from moe_async.orchestration.engine_pool import EnginePool
    from moe_async.orchestration.trainer_group import TrainerGroup
    from moe_async.config import ExperimentConfig

log = logging.getLogger(__name__)


class EngineRecovery:
    """Design notes: ``docs/design/orchestration.md``.

    Args:
        cfg: the experiment config (``engine.max_restarts``, ``engine.min_healthy_engines``,
            ``engine.startup_timeout_s``, ``weight_sync.check``).
        pool: the :class:`EnginePool` (``dead_engines()``, ``restart(i, timeout_s)``, ``urls``).
        trainer: the :class:`TrainerGroup` (``reconnect_engines``, ``sync_weights``,
            ``sync_weights_outcome``, ``check_engines``, ``version``).
        rollout: the RolloutActor handle (``set_routable``, ``routable``).
        buffer: the BufferActor handle (``set_engine_version``).
        ray_timeout_s: bound on each Ray call to the rollout/buffer actors (named on expiry).
    """

    def __init__(self, cfg: ExperimentConfig, pool: EnginePool, trainer: TrainerGroup, rollout: ActorHandle,
                 buffer: ActorHandle, ray_timeout_s: float = 120.0):
        self.cfg = cfg
        self.pool = pool
        self.trainer = trainer
        self.rollout = rollout
        self.buffer = buffer
        self.ray_timeout_s = ray_timeout_s
        urls = [u for u in pool.urls if u is not None]
        if len(urls) != len(pool.urls):
            raise RuntimeError(f"engine recovery: {len(pool.urls) - len(urls)} engine(s) of the pool not launched")
        self.urls = urls
        self.policy = RestartPolicy(self.urls, cfg.engine.max_restarts, cfg.engine.min_healthy_engines)
        self.recovery_syncs = 0
        self.readmitted = 0
        self.sync_failures = 0  # step syncs that lost an engine (then recovered here)
        self.events: list[str] = []  # one line per death/restart/retire, for the summary

    # ------------------------------------------------------------------ helpers
    def _get(self, ref: ObjectRef, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.ray_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(f"engine recovery: {what}: no reply within {self.ray_timeout_s:.0f} s") from e

    def _dead(self) -> dict[int, str]:
        """Engine index -> why, for the engines the pool reports dead and the policy counts healthy."""
        out = {}
        healthy = set(self.policy.healthy())
        for line in self.pool.dead_engines():
            i = int(line.split()[1])  # "engine <i> at <url> <why>"
            if i in healthy:
                out[i] = line
        return out

    def live_urls(self) -> list[str]:
        """URLs of the healthy engines, in index order (the update group's members)."""
        return [self.urls[i] for i in self.policy.healthy()]

    # ------------------------------------------------------------------ the check
    def check(self) -> dict[str, float]:
        """One recovery pass (``docs/design/orchestration.md``). Returns the counters;
        ``engine/weight_version`` when this pass synced the engines to the trainer's version (the
        caller records it).

        Raises:
            EngineFleetError: fewer than ``engine.min_healthy_engines`` healthy engines, naming them.
            RuntimeError / WeightSyncError: a re-formed group or its sync failed (named).
        """
        dead = self._dead()
        if not dead:
            return self._readmit()
        for i in dead:  # out of routing first: no new request reaches a dead engine
            self._get(self.rollout.set_routable.remote(i, False), f"take engine {i} out of routing")
        back: list[int] = []
        for i, why in sorted(dead.items()):
            reason = why
            while True:
                decision = self.policy.on_death(i, time.monotonic(), reason=reason)  # EngineFleetError
                self.events.append(f"{reason} -> {decision}")
                print(f"[moe-async] {reason}: {decision} (restart {self.policy.engines[i].restarts} of "
                      f"engine.max_restarts={self.policy.max_restarts})", flush=True)
                if decision == "retire":
                    break
                try:
                    self.urls[i] = self.pool.restart(i, self.cfg.engine.startup_timeout_s + 60.0)
                except Exception as e:  # noqa: BLE001 - another death, counted by the policy
                    self.policy.on_restart_failed(i)
                    reason = f"engine {i} at {self.urls[i]} {e}"[:400]
                    continue
                back.append(i)
                break
        # every live member and the replacements re-form the group, then get the current weights
        m = self._resync()
        for i in back:
            self.policy.on_restarted(i)
            self._get(self.rollout.set_routable.remote(i, True), f"put engine {i} back into routing")
            self.events.append(f"engine {i} at {self.urls[i]} rejoined at weight_version {m['engine/weight_version']:.0f}")
        m.update(self.metrics())
        return m

    def _resync(self, members: list[int] | None = None) -> dict[str, float]:
        """Re-form the update group with the healthy engines (plus ``members`` about to be
        readmitted), send the trainer's weights, check each engine acknowledged the version."""
        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.group import WeightSyncError

        idx = sorted(set(self.policy.healthy()) | {e.index for e in self.policy.engines if e.down} | set(members or []))
        idx = [i for i in idx if not self.policy.engines[i].retired]
        urls = [self.urls[i] for i in idx]
        self.trainer.reconnect_engines(urls)
        m = {f"recovery/{k}": v for k, v in self.trainer.sync_weights().items()}
        version = self.trainer.version()
        for i, u in zip(idx, urls):  # the acknowledgement: each engine reports the version it holds
            held = SyncEngineClient(u, timeout_s=self.cfg.weight_sync.timeout_s).get_weight_version()
            if held != version:
                raise WeightSyncError(f"engine {i} at {u} holds weight_version {held} after the recovery sync "
                                      f"of version {version}: not put back into routing")
        if self.cfg.weight_sync.check:
            m.update({f"recovery/{k}": v for k, v in self.trainer.check_engines(urls).items()})
        self._get(self.buffer.set_engine_version.remote(version), "buffer.set_engine_version")
        self.recovery_syncs += 1
        m["engine/weight_version"] = float(version)
        return m

    def _readmit(self) -> dict[str, float]:
        """Engines the rollout manager took out of routing (a failed request) whose process is
        alive: back in after a re-sync and acknowledgement (they may have missed an update)."""
        from moe_async.engines.client import SyncEngineClient

        mask = self._get(self.rollout.routable.remote(), "rollout.routable")
        out = [i for i in self.policy.healthy() if not mask[i]]
        # only those answering /health (a process that just died is the next check's death)
        out = [i for i in out if SyncEngineClient(self.urls[i], timeout_s=5.0).health(timeout=5.0)]
        if not out:
            return {}
        m = self._resync()
        for i in out:
            self._get(self.rollout.set_routable.remote(i, True), f"put engine {i} back into routing")
            self.readmitted += 1
        m.update(self.metrics())
        return m

    # ------------------------------------------------------------------ the step's sync
    def sync(self, dead_wait_s: float = 30.0) -> dict[str, float]:
        """The step's weight sync to the live engines, then ``weight_sync.check`` and the
        buffer's engine version; ``engine/weight_version`` in the returned metrics.

        An engine lost during it (``docs/design/orchestration.md``): the engines still answering but not at
        the trainer's version leave routing, the pool is given up to ``dead_wait_s`` seconds to
        report the lost ones dead, :meth:`check` restarts/retires them and re-syncs every
        member (a re-sync is made here when it did not: a lost engine whose process is alive),
        and the engines taken out are routed again.

        Raises: as :meth:`check` (too few healthy engines, a failed re-sync or
        acknowledgement); the sync's own error when no engine was lost.
        """
        from moe_async.engines.client import SyncEngineClient

        out = self.trainer.sync_weights_outcome()
        version = self.trainer.version()
        m = dict(out.metrics)
        if out.ok:
            if self.cfg.weight_sync.check:
                m.update(self.trainer.check_engines(self.live_urls()))
            self._get(self.buffer.set_engine_version.remote(version), "buffer.set_engine_version")
            m["engine/weight_version"] = float(version)
            return m
        self.sync_failures += 1
        lost = [self.urls.index(u) for u in out.lost if u in self.urls]
        line = f"weight sync of version {version} lost engine(s) {', '.join(out.lost)}: {out.error}"[:500]
        self.events.append(line)
        print(f"[moe-async] {line}; recovering", flush=True)
        behind = []
        for i in self.policy.healthy():
            if i in lost:
                continue
            try:
                held = SyncEngineClient(self.urls[i], timeout_s=10.0).get_weight_version()
            except Exception:  # noqa: BLE001 - died too: the check below sees it
                held = None
            if held != version:
                behind.append(i)
                self._get(self.rollout.set_routable.remote(i, False), f"take engine {i} out of routing")
        t0 = time.monotonic()
        while not set(lost) <= set(self._dead()) and time.monotonic() - t0 < dead_wait_s:
            time.sleep(0.5)
        rec = self.check()
        if "engine/weight_version" not in rec:
            rec.update(self._resync())
        for i in behind:
            if not self.policy.engines[i].retired:
                self._get(self.rollout.set_routable.remote(i, True), f"put engine {i} back into routing")
        m.update(rec)
        return m

    def metrics(self) -> dict[str, float]:
        m = self.policy.metrics()
        m["engine/recovery_syncs"] = float(self.recovery_syncs)
        m["engine/readmitted"] = float(self.readmitted)
        m["engine/sync_failures"] = float(self.sync_failures)
        return m
