"""The configured weight transport: :func:`make_transport` picks
:class:`~moe_async.weight_sync.transport.BroadcastTransport`,
:class:`~moe_async.weight_sync.tensor_transport.TensorTransport` or
:class:`~moe_async.weight_sync.disk_transport.DiskTransport` by ``weight_sync.transport``."""

from __future__ import annotations

from typing import Any, Sequence

from moe_async.protocols import WeightReceiver
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.disk_transport import DiskTransport
from moe_async.weight_sync.tensor_transport import TensorTransport
from moe_async.weight_sync.transport import BroadcastTransport, WeightTransport


def make_transport(clients: Sequence[WeightReceiver], cfg: WeightSyncConfig, *, pause_mode: str = "abort",
                   **kw: Any) -> WeightTransport:
    """The transport ``cfg.transport`` names (``broadcast`` | ``tensor`` | ``disk``), not yet connected."""
    if cfg.transport == "disk":
        return DiskTransport(clients, cfg, pause_mode=pause_mode)
    if cfg.transport == "tensor":
        return TensorTransport(clients, cfg, pause_mode=pause_mode, **kw)
    return BroadcastTransport(clients, cfg, pause_mode=pause_mode, **kw)
