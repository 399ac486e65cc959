"""The sender's side of forming weight-update groups with engines.

:meth:`GroupMembership.form` checks the declared world, binds rank 0's store, asks every engine
to join at once and joins itself, all bounded by one deadline; an engine that refuses or times
out fails the formation naming it. Several groups are formed one after another in a fixed
order (concurrent formation in opposite orders would deadlock).

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import datetime
import gc
import logging
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Set
from typing import Sequence, TypedDict

import torch.distributed as dist

from moe_async.errors import one_line
from moe_async.protocols import WeightReceiver
from moe_async.types import JsonDict
from moe_async.weight_sync.group import (
    WeightSyncError,
    bind_master_store,
    check_world,
    create_update_group,
    destroy_update_group,
    rank_offsets,
)

log = logging.getLogger(__name__)


class _JoinBox(TypedDict, total=False):
    """What rank 0's rendezvous thread leaves: the formed group, or the error it raised."""

    group: dist.ProcessGroup
    error: BaseException


class GroupFormationError(WeightSyncError):
    """A weight-update group could not be formed; the message names the engine or the step."""


class GroupMembership:
    """The sender's membership of one weight-update group with ``clients`` (one per engine).

    Args:
        clients: engine clients with ``init_weights_update_group`` /
            ``destroy_weights_update_group`` (SGLang's HTTP calls).
        engine_sizes: ranks each engine contributes (its TP size, x DP when its replicas
            join); one int for all engines or one per engine.
        group_name: SGLang's ``group_name`` (store prefix, the engines' key for the group).
        backend: ``gloo`` | ``nccl`` (resolved).
        master_address: address the sender's store binds (engines connect to it).
        timeout_s: bound on forming the group and on its collectives.
        world_size: a declared world size to check (None: derived).
    """

    def __init__(self, clients: Sequence[WeightReceiver], *, engine_sizes: int | Sequence[int], group_name: str,
                 backend: str, master_address: str, timeout_s: float, world_size: int | None = None):
        self.clients = list(clients)
        sizes = [engine_sizes] * len(self.clients) if isinstance(engine_sizes, int) else list(engine_sizes)
        if len(sizes) != len(self.clients):
            raise ValueError(f"engine_sizes has {len(sizes)} entries for {len(self.clients)} engines")
        self.engine_sizes = sizes
        self.offsets, self.world_size = rank_offsets(sizes)
        if world_size is not None:
            check_world(world_size, 1, sum(sizes))
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None

    def form(self, pool: ThreadPoolExecutor | None = None) -> dist.ProcessGroup:
        """Form the group (``docs/design/weight_sync.md``); returns it. Raises :class:`GroupFormationError`
        naming the engine (or the sender) whose join failed, after destroying every part."""
        from torch.distributed.distributed_c10d import _world

        if self.group_name in _world.pg_names.values():
            raise GroupFormationError(f"this process already holds a weight-update group named {self.group_name!r} "
                                      f"(another transport?): leave it first, or use another group name")
        own_pool = pool is None
        pool = pool or ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        # the only reference to rank 0's store is in ``held``: dropping it closes the store
        held = [bind_master_store(self.master_address, self.world_size, self.timeout_s)]
        futs = [
            pool.submit(c.init_weights_update_group, master_address=self.master_address, master_port=held[0].port,
                        rank_offset=self.offsets[i], world_size=self.world_size, group_name=self.group_name,
                        backend=self.backend)
            for i, c in enumerate(self.clients)
        ]
        refused: set[int] = set()  # engines that answered no: they hold nothing of this group
        group, err = self._join_as_sender(held, futs, refused)
        if err is None:
            assert group is not None  # formed when no error
            self.group, self._store = group, held[0]
            if own_pool:
                pool.shutdown(wait=False)
            return group
        # tear every part down: ours, the store (a join still waiting on it fails at once), theirs
        destroy_update_group(group)
        del group
        held.clear()
        gc.collect()
        grace = time.monotonic() + 5.0  # the joins that still run end now (their store is gone)
        for i, f in enumerate(futs):
            try:
                r = f.result(timeout=max(0.0, grace - time.monotonic()))
                if isinstance(r, dict) and r.get("success") is False:
                    refused.add(i)
            except TimeoutError:  # still hung: destroy below, in case it completes
                pass
            except Exception:  # noqa: BLE001 - a failed join: nothing of the group there
                refused.add(i)
        # (never on an engine that refused: it may hold a LIVE group of this name); in the
        # background: an engine busy with a join that reached it late answers only after that
        # join's own timeout, and connect() must raise within its own
        threading.Thread(target=self._destroy_on_engines, kwargs=dict(quiet=True, skip=refused),
                         name=f"weight-sync-destroy-{self.group_name}", daemon=True).start()
        if own_pool:
            pool.shutdown(wait=False)
        raise GroupFormationError(f"weight-update group {self.group_name!r} (world {self.world_size}, "
                                  f"engine rank offsets {self.offsets}) not formed: {err}; every partial "
                                  f"group was destroyed")

    def _engine(self, i: int) -> str:
        return f"engine {i} at {getattr(self.clients[i], 'base_url', '?')}"

    def _join_as_sender(self, held: list[dist.TCPStore], futs: list[Future[JsonDict]],
                        refused: set[int]) -> tuple[dist.ProcessGroup | None, str | None]:
        """Rank 0's side of the join while the engines' joins (``futs``) run: ``(group, None)``
        once the group is formed and every engine answered yes, else ``(group or None, why)``.

        Rank 0 waits in the rendezvous through a client of ``store`` in a thread; the first
        engine that answers no (or whose call raises) ends the wait at once: the store
        (``held[0]``, its only reference) is closed, which makes rank 0's wait fail, instead of
        rank 0 waiting ``timeout_s`` for a member that will never come. Engines that answered no
        are added to ``refused``."""
        client = dist.TCPStore(self.master_address, held[0].port, self.world_size, is_master=False,
                               timeout=datetime.timedelta(seconds=self.timeout_s))
        box: _JoinBox = {}

        def sender() -> None:
            try:
                box["group"] = create_update_group(backend=self.backend, world_size=self.world_size, rank=0,
                                                   group_name=self.group_name, timeout_s=self.timeout_s,
                                                   store=client)[0]
            except Exception as e:  # noqa: BLE001 - reported by the caller
                box["error"] = e

        th = threading.Thread(target=sender, name=f"weight-sync-join-{self.group_name}", daemon=True)
        th.start()
        err = None
        deadline = time.monotonic() + self.timeout_s
        while th.is_alive() and err is None:
            th.join(0.05)
            for i, f in enumerate(futs):
                if f.done() and (why := self._join_failed(f)) is not None:
                    refused.add(i)
                    err = f"{self._engine(i)}: init_weights_update_group failed: {why}"
                    break
        if err is not None:  # rank 0 still waits for that engine: end its wait now
            held.clear()
            gc.collect()
            th.join(10.0)
            return box.get("group"), err
        if "error" in box:
            e = box["error"]
            silent = [self._engine(i) for i, f in enumerate(futs) if not f.done()]
            why = f"the sender (rank 0) could not form the group: {type(e).__name__}: {str(e)[:300]}"
            if silent:  # (an engine waiting for a missing peer is silent too)
                why += f"; no reply to init_weights_update_group yet from {', '.join(silent)}"
            return None, why
        for i, f in enumerate(futs):  # the group is formed: every join's reply (one deadline)
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return box["group"], f"{self._engine(i)}: no reply to init_weights_update_group within " \
                                     f"{self.timeout_s:.0f} s"
            except Exception:  # noqa: BLE001 - named below
                pass
            if (why := self._join_failed(f)) is not None:
                refused.add(i)
                return box["group"], f"{self._engine(i)}: init_weights_update_group failed: {why}"
        return box["group"], None

    @staticmethod
    def _join_failed(fut: Future[JsonDict]) -> str | None:
        """Why a finished join future failed (one line), or None when the engine said yes."""
        e = fut.exception()
        if e is not None:
            return one_line(f"{type(e).__name__}: {e}", 500)
        r = fut.result()
        if isinstance(r, dict) and r.get("success") is False:
            return one_line(str(r.get("message")), 500)
        return None

    def _destroy_on_engines(self, quiet: bool, skip: Set[int] = frozenset()) -> None:
        for i, c in enumerate(self.clients):
            if i in skip:
                continue
            try:
                c.destroy_weights_update_group(group_name=self.group_name)
            except Exception as e:  # noqa: BLE001 - best effort (an engine that never joined refuses)
                if not quiet:
                    log.warning("engine %d: destroy_weights_update_group failed: %s", i, e)

    def leave(self) -> None:
        """Leave the group everywhere (engines first, then ours); a later :meth:`form` may follow."""
        if self.group is not None:
            self._destroy_on_engines(quiet=False)
        destroy_update_group(self.group)
        self.group = None
        self._store = None

    def abandon(self) -> None:
        """Leave after a failed collective: this side first (the group destroyed, this object's
        references dropped and collected: a gloo group's sockets close, so an engine still
        waiting in one of its broadcasts fails at once instead of at the group's timeout; the
        caller must hold no other reference; the finished frames of an exception being handled
        are cleared), then the engines' ``/destroy_weights_update_group``, which they answer
        once that receive has ended."""
        traceback.clear_frames(sys.exc_info()[2])
        group, self.group, self._store = self.group, None, None
        if group is None:
            return
        destroy_update_group(group)
        del group
        gc.collect()
        self._destroy_on_engines(quiet=False)


def form_in_order(memberships: Sequence[GroupMembership]) -> list[dist.ProcessGroup]:
    """Form every group one after another, in the given (global, fixed) order; if one fails,
    the ones formed before it are left again and the error re-raised."""
    done: list[GroupMembership] = []
    groups: list[dist.ProcessGroup] = []
    try:
        for m in memberships:
            groups.append(m.form())
            done.append(m)
    except BaseException:
        for m in reversed(done):
            m.leave()
        raise
    return groups


def form_in_turn(membership: GroupMembership | None, turn: int, turns: int, store: dist.Store,
                 key: str = "moe_async/update_groups", timeout_s: float = 600.0) -> dist.ProcessGroup | None:
    """Cross-process :func:`form_in_order`: the sender whose group is number ``turn`` of
    ``turns`` waits for every earlier group to be formed (keys in ``store``, shared by all
    senders), forms its own, then marks it. A sender with no group (``membership=None``)
    passes its turn. Returns the group (None without one).

    Raises:
        GroupFormationError: an earlier sender failed (named), or this one did.
    """
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    if turn > 0:
        store.wait([f"{key}/{turn - 1}"])
        prev = store.get(f"{key}/{turn - 1}").decode()
        if prev != "ok":
            store.set(f"{key}/{turn}", prev)
            raise GroupFormationError(f"update group {turn} not formed: {prev}")
    try:
        group = membership.form() if membership is not None else None
    except GroupFormationError as e:
        store.set(f"{key}/{turn}", f"group {turn} failed: {e}")
        raise
    store.set(f"{key}/{turn}", "ok")
    return group
