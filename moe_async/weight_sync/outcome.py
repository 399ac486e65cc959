"""A weight sync that lost an engine: reported, not raised (the run goes on without it).

:func:`send_or_lost` runs one ``transport.send``; when it fails and an engine of the group no
longer answers ``/health``, a :class:`SyncOutcome` naming the lost engines is returned instead
of the error (the driver's engine recovery restarts them); otherwise the error is raised. No
engine serves a half-applied update, and no rank is left in a collective.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from moe_async.protocols import WeightReceiver
    from moe_async.weight_sync.transport import WeightTransport
    import torch

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


def lost_engines(clients: Iterable[WeightReceiver], timeout_s: float = 5.0) -> list[str]:
    """Base URLs of the ``clients`` (``health(timeout=)``, ``base_url``) whose ``/health`` fails."""
    return [c.base_url for c in clients if not c.health(timeout=timeout_s)]


def send_or_lost(transport: WeightTransport, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int,
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
