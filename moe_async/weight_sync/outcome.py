"""A weight sync that lost an engine: reported, not raised (the run goes on without it).

:func:`send_or_lost` runs one ``transport.send`` on the sending rank. When it fails and at
least one engine of the update group no longer answers ``/health`` (its process died during
the sync), the failure is the lost engine's, not the sync's: a :class:`SyncOutcome` naming
those engines is returned instead of the error, so the caller (the driver's
:class:`~moe_async.orchestration.engine_recovery.EngineRecovery`) restarts or retires them and
re-syncs everyone, and the run goes on. When every engine still answers, the error is raised
as before (a refusal, a bad tensor: the run stops naming it).

What the other engines hold after such a failure (``BroadcastTransport.send``'s failure path):
an engine that received every bucket and its versioned call serves the new version; any other
dropped what it had staged (its atomic session closed) and serves the previous version; none
serves a half-applied update. Before the result is returned every rank has finished the
export: a streamed export (world size > 1, :mod:`~moe_async.weight_sync.stream_export`) is
drained to its end by the sender after the failure, so no rank is left in a collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger(__name__)


@dataclass
class SyncOutcome:
    """One weight sync's result on the sending rank.

    Attributes:
        metrics: the transport's ``sync/*`` metrics (floats); after a lost engine only
            ``sync/engines_lost`` (engines) and ``sync/weight_version`` (the version tried).
        lost: base URLs of the engines that stopped answering during the sync (empty: the
            sync went through on every engine).
        error: the sync's own error (``Type: message``), empty when ``lost`` is.
    """

    metrics: dict[str, float]
    lost: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.lost


def lost_engines(clients: Iterable[Any], timeout_s: float = 5.0) -> list[str]:
    """Base URLs of the ``clients`` (``health(timeout=)``, ``base_url``) whose ``/health`` fails."""
    return [c.base_url for c in clients if not c.health(timeout=timeout_s)]


def send_or_lost(transport: Any, named_tensors: Any, weight_version: int,
                 probe_timeout_s: float = 5.0) -> SyncOutcome:
    """``transport.send(named_tensors, weight_version)`` as a :class:`SyncOutcome` (module
    docstring). ``transport.clients`` are probed only after a failure.

    Raises: the send's own error when every engine still answers ``/health``."""
    try:
        return SyncOutcome(transport.send(named_tensors, weight_version))
    except Exception as e:  # noqa: BLE001 - re-raised below unless an engine is gone
        lost = lost_engines(transport.clients, probe_timeout_s)
        if not lost:
            raise
        why = f"{type(e).__name__}: {e}"[:500]
        log.warning("weight sync of version %d lost engine(s) %s: %s", weight_version, ", ".join(lost), why)
        return SyncOutcome({"sync/engines_lost": float(len(lost)), "sync/weight_version": float(weight_version)},
                           lost, why)
