"""One trainer rank's side of every sender's update group (``weight_sync.senders: all``), kept
usable across failed syncs.

:meth:`SenderGroups.connect` leaves this rank's current group (rank 0: its transport; any other
rank: its :class:`~moe_async.weight_sync.senders.SenderLink`), then forms every sender's group
again in rank order (:func:`~moe_async.weight_sync.senders.connect_senders`) under a fresh store
key and fresh names (connect ``n`` > 0: ``{base}-r{n}``, each other sender's ``-s{rank}`` after
it; every rank counts its connects alike, as all take part in each) and fresh store ports.
:meth:`SenderGroups.sync` is :func:`~moe_async.weight_sync.senders.sync_from_senders`; a sync
that failed or lost an engine (all ranks agree on which) marks the groups stale, and the next
sync re-forms them first, as the one-sender transport is connected again after a failure.

Fresh names: SGLang 0.5.23 registers each group's name in its process (torch's
``_new_process_group_helper`` refuses a name still registered), so a re-form does not depend
on an old group's ``/destroy_weights_update_group`` having been served; an engine still holding
an old group only keeps it (abandoned: its sender side is gone).

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, TypeVar, Union

from moe_async.weight_sync.outcome import SyncOutcome
from moe_async.weight_sync.senders import SenderLink, connect_senders, sync_from_senders

if TYPE_CHECKING:
    from torch.distributed import Store

    from moe_async.weight_sync.stream_export import PackedExport, ShardSource
    from moe_async.weight_sync.transport import BroadcastTransport

log = logging.getLogger(__name__)
R = TypeVar("R")
#: ``make(group_name)``: rank 0's transport with that group name, or this rank's link of it
Maker = Callable[[str], Union["BroadcastTransport", SenderLink]]


class SenderGroups:
    """This rank's update group(s) under several senders (see the module docstring).

    Args:
        rank, world: this trainer rank and the number of trainer ranks (every one a sender).
        store: shared by every trainer rank (e.g. the default process group's).
        make: ``make(group_name)`` -> rank 0's transport / this rank's link, unconnected.
        base: rank 0's group name at the first connect.
        key: store key prefix of the formation turns (``{key}/{n}`` at connect ``n``).
        timeout_s: bound on each rank's turn.
    """

    def __init__(self, rank: int, world: int, store: Store, make: Maker, *, base: str = "moe_async_weight_sync",
                 key: str = "moe_async/sender_groups", timeout_s: float = 600.0):
        self.rank, self.world, self.store, self.make = rank, world, store, make
        self.base, self.key, self.timeout_s = base, key, timeout_s
        self.connects = 0  # connects begun (every rank alike): the next one's names and key
        self.stale = True  # no group yet, or the last sync failed: connect before the next sync
        self.transport: BroadcastTransport | None = None  # rank 0
        self.link: SenderLink | None = None  # other ranks

    def name(self, n: int) -> str:
        """Rank 0's group name at connect ``n``."""
        return self.base if n == 0 else f"{self.base}-r{n}"

    def connect(self, make: Maker | None = None) -> None:
        """Leave this rank's group, then form every sender's group in rank order (collective);
        ``make``: a new maker (e.g. other engines) from now on.

        Raises: GroupFormationError naming the first group that failed, on every rank (the
        groups stay stale: the next sync forms them again)."""
        if make is not None:
            self.make = make
        self.stale = True
        self.close()
        n = self.connects
        self.connects += 1
        made = self.make(self.name(n))
        if self.rank == 0:
            self.transport = made  # type: ignore[assignment]  # rank 0's maker makes a transport
        else:
            assert isinstance(made, SenderLink), "SenderGroups: the maker of a rank > 0 makes a SenderLink"
            self.link = made
        connect_senders(self.rank, self.world, self.store, transport=self.transport, link=self.link,
                        key=f"{self.key}/{n}", timeout_s=self.timeout_s)
        self.stale = False

    def sync(self, source: ShardSource, version: int, send: Callable[[PackedExport, int], R] | None = None
             ) -> R | dict[str, float] | SyncOutcome:
        """:func:`~moe_async.weight_sync.senders.sync_from_senders` over the current groups,
        formed again first when stale (collective). ``send(export, version)`` on rank 0
        (default: the transport's ``send``); it reads :attr:`transport` when called.

        Raises: as ``sync_from_senders`` and :meth:`connect`; afterwards the groups are stale."""
        if self.stale:
            log.warning("weight sync: re-forming every sender's update group (connect %d) before this sync",
                        self.connects)
            self.connect()
        try:
            out = sync_from_senders(self.rank, source, version, transport=self.transport, link=self.link, send=send)
        except Exception:
            self.stale = True
            raise
        if isinstance(out, SyncOutcome) and not out.ok:
            self.stale = True
        return out

    def close(self) -> None:
        """Leave this rank's group (``/destroy_weights_update_group`` on every engine that answers)."""
        if self.transport is not None:
            self.transport.shutdown()
            self.transport = None
        if self.link is not None:
            self.link.close()
            self.link = None
