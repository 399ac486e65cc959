"""Engine restart policy (no endless restarts): restarts capped per engine, a floor of healthy engines.

:class:`RestartPolicy` (pure bookkeeping, the caller passes the time) answers ``"restart"`` or
``"retire"`` for a dead engine and raises :class:`EngineFleetError` naming every engine down
when fewer than ``engine.min_healthy_engines`` remain healthy; :class:`Supervisor` applies it
to :class:`SupervisedEngine` objects one poll at a time.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

Decision = Literal["restart", "retire"]


class EngineFleetError(RuntimeError):
    """Fewer healthy engines than ``engine.min_healthy_engines``; the message names each
    engine that is down."""


@dataclass
class EngineRecord:
    """One engine's history: ``restarts`` so far, ``deaths`` (times), whether it is ``down``
    (dead, not yet restarted) or ``retired``, and the last reason it died."""

    index: int
    name: str
    restarts: int = 0
    deaths: list[float] = field(default_factory=list)
    down: bool = False
    retired: bool = False
    last_reason: str = ""

    def describe(self) -> str:
        state = (f"retired after {self.restarts} restart(s)" if self.retired
                 else f"down (restarted {self.restarts} time(s) before)")
        why = f"; last: {self.last_reason}" if self.last_reason else ""
        return f"engine {self.index} ({self.name}) {state}{why}"


class RestartPolicy:
    """Design notes: ``docs/design/orchestration.md``.

    Args:
        names: one name per engine (e.g. its URL), in index order.
        max_restarts: restarts allowed per engine (``engine.max_restarts``, >= 0).
        min_healthy: the floor (``engine.min_healthy_engines``, 1 .. len(names)).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, names: Sequence[str], max_restarts: int, min_healthy: int):
        if max_restarts < 0:
            raise ValueError(f"engine.max_restarts must be >= 0, got {max_restarts}")
        if not 1 <= min_healthy <= len(names):
            raise ValueError(f"engine.min_healthy_engines={min_healthy} must be in 1..{len(names)} "
                             f"(engine.num_engines={len(names)})")
        self.max_restarts = int(max_restarts)
        self.min_healthy = int(min_healthy)
        self.engines = [EngineRecord(i, str(n)) for i, n in enumerate(names)]

    def healthy(self) -> list[int]:
        """Indices of the engines that are neither down nor retired (the routable ones)."""
        return [e.index for e in self.engines if not (e.down or e.retired)]

    def on_death(self, i: int, now: float, reason: str = "") -> Decision:
        """Engine ``i`` died at ``now``: ``"restart"`` (its restart count is taken now; call
        :meth:`on_restarted` once it is serving) or ``"retire"``.

        Raises:
            EngineFleetError: fewer than ``min_healthy`` engines are healthy after this death
                (checked before the decision: a restart takes time).
            ValueError: ``i`` is retired, or already down.
        """
        e = self.engines[i]
        if e.retired or e.down:
            raise ValueError(f"engine {i} is {'retired' if e.retired else 'already down'}")
        e.deaths.append(float(now))
        e.last_reason = reason
        e.down = True
        decision: Decision = "restart" if e.restarts < self.max_restarts else "retire"
        if decision == "retire":
            e.retired, e.down = True, False
        if len(self.healthy()) < self.min_healthy:
            down = [x.describe() for x in self.engines if x.down or x.retired]
            raise EngineFleetError(
                f"{len(self.healthy())} healthy engine(s) of {len(self.engines)}, fewer than "
                f"engine.min_healthy_engines={self.min_healthy} (engine.max_restarts={self.max_restarts}); "
                f"down: {'; '.join(down)}")
        if decision == "restart":
            e.restarts += 1
        return decision

    def on_restarted(self, i: int) -> None:
        """Engine ``i``'s restart finished: it is healthy again."""
        self.engines[i].down = False

    def on_restart_failed(self, i: int) -> None:
        """Engine ``i``'s restart did not bring it back: call :meth:`on_death` for it again
        (the failed restart counted as one of its restarts)."""
        self.engines[i].down = False

    def metrics(self) -> dict[str, float]:
        """``engine/restarts`` (total), ``engine/retired``, ``engine/healthy`` and
        ``engine/restarts/<i>`` per engine."""
        m = {"engine/restarts": float(sum(e.restarts for e in self.engines)),
             "engine/retired": float(sum(e.retired for e in self.engines)),
             "engine/healthy": float(len(self.healthy()))}
        m.update({f"engine/restarts/{e.index}": float(e.restarts) for e in self.engines})
        return m


class SupervisedEngine(Protocol):
    """What :class:`Supervisor` needs of an engine."""

    name: str

    def alive(self) -> bool:
        """Whether the engine process is running and answers."""

    def restart(self) -> None:
        """Start it again (blocking until it serves, or raising)."""


class Supervisor:
    """Polls ``engines`` and applies ``policy`` (design notes: ``docs/design/orchestration.md``)."""

    def __init__(self, engines: Sequence[SupervisedEngine], policy: RestartPolicy):
        if len(engines) != len(policy.engines):
            raise ValueError(f"{len(engines)} engines for a policy of {len(policy.engines)}")
        self.engines = list(engines)
        self.policy = policy

    def poll(self, now: float) -> dict[str, list[int]]:
        """Check every healthy engine once: a dead one is restarted (then healthy again) or
        retired. Returns ``{"restarted": [...], "retired": [...]}`` (indices) of this poll.

        Raises:
            EngineFleetError: from the policy (too few healthy engines), naming them.
        """
        out: dict[str, list[int]] = {"restarted": [], "retired": []}
        for i in self.policy.healthy():
            eng = self.engines[i]
            if eng.alive():
                continue
            reason = "not alive"
            while True:  # a restart that fails is another death (until the restarts run out)
                if self.policy.on_death(i, now, reason=reason) == "retire":
                    out["retired"].append(i)
                    break
                try:
                    eng.restart()
                except Exception as exc:  # noqa: BLE001 - any failure to come back
                    self.policy.on_restart_failed(i)
                    reason = f"restart failed: {type(exc).__name__}: {exc}"[:300]
                    continue
                self.policy.on_restarted(i)
                out["restarted"].append(i)
                break
        return out
