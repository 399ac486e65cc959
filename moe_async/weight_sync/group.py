"""The dedicated weight-update process group between trainer sender(s) and engine ranks.

Formed outside Megatron's default world exactly as SGLang 0.5.23's ``init_custom_process_group``
does (rendezvous, the same store keys), so a real SGLang engine joins it; the sender is group
rank 0 and engine ``e``'s rank ``r`` is ``rank_offset[e] + r`` (:func:`rank_offsets`, from each
engine's own size).

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import datetime
import logging
from typing import Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update or join; the message names the engine."""


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight_sync.backend must be auto|gloo|nccl, got {backend!r}")
    return backend


def transport_device(backend: str) -> torch.device:
    """The device the weight-update buffers live on for ``backend``: NCCL broadcasts CUDA
    tensors only (the current CUDA device), gloo here broadcasts CPU tensors. Buckets are
    packed and the send buffer allocated on this device; an engine receives into it."""
    backend = resolve_backend(backend)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.backend='nccl' needs CUDA; none is available (use 'gloo' or 'auto')")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_offsets(engine_sizes: Sequence[int], first: int = 1) -> tuple[list[int], int]:
    """Each engine's ``rank_offset`` and the group's world size, from every engine's OWN
    number of ranks (its TP size, times its DP size when its DP replicas all join).

    ``first`` is the number of sender ranks before the engines (1: one trainer sender).
    Engine ``e`` owns ranks ``offset[e] .. offset[e] + engine_sizes[e] - 1``; together they
    cover ``first .. world - 1`` once each (each engine's own size: sizes ``[1, 2]`` -> offsets ``[1, 2]``,
    world 4; sizes ``[4, 4]`` (TP2 x DP2) -> ``[1, 5]``, world 9, rank ``1 + 4e + 2d + t``).
    """
    offs, nxt = [], first
    for e, n in enumerate(engine_sizes):
        if int(n) < 1:
            raise ValueError(f"engine {e}: size {n} (ranks in the update group) must be >= 1")
        offs.append(nxt)
        nxt += int(n)
    return offs, nxt


def check_world(declared: int, senders: int, engine_ranks: int) -> None:
    """Raise at once when a declared world size differs from the ranks that will join
    (instead of every member hanging in the collective until its timeout)."""
    if declared != senders + engine_ranks:
        raise ValueError(
            f"weight-update group: declared world_size={declared} but {senders} sender rank(s) + "
            f"{engine_ranks} engine rank(s) = {senders + engine_ranks} join"
        )


def bind_master_store(master_address: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's TCPStore, bound now to a port the OS picks (``store.port``), so the port
    handed to the engines is already ours: no window in which another process can take it
    (picking a free port, releasing it and binding it later races under load). Engines reach
    it exactly as SGLang's rendezvous does (``tcp://address:port``)."""
    return dist.TCPStore(
        master_address, 0, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )


def create_update_group(
    *,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
    init_method: str | None = None,
    store: dist.Store | None = None,
) -> tuple[dist.ProcessGroup, dist.Store]:
    """Create (collectively: every member must call it) the weight-update group, with the
    same store keys as SGLang 0.5.23's ``init_custom_process_group`` (``docs/design/weight_sync.md``).

    Args:
        backend: ``gloo`` | ``nccl`` | ``auto`` (:func:`resolve_backend`).
        world_size: sender rank(s) + every engine rank.
        rank: this process's group rank (0 = the sender; engines ``rank_offset + r``).
        group_name: SGLang's ``group_name``: key prefix and the group's registered name
            (unique in a process: :func:`destroy_update_group` frees it).
        timeout_s: bound on forming the group and on every collective in it.
        init_method: ``tcp://address:port`` (the engines' side, as SGLang: rank 0 of the
            rendezvous would host the store). Exactly one of ``init_method`` / ``store``.
        store: the sender's pre-bound :func:`bind_master_store` (unprefixed).

    Returns:
        ``(group, raw_store)``: the ``ProcessGroup`` (``broadcast`` from rank 0) and the
        unprefixed store it was made from (the caller keeps it to probe the peer's liveness
        and must drop it with the group).

    Raises:
        ValueError: both or neither of ``init_method`` / ``store``; ``group_name`` already
            used by a live group of this process.
        RuntimeError / DistStoreError (torch): peers missing past ``timeout_s``.
    """
    from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

    if (store is None) == (init_method is None):
        raise ValueError("create_update_group: pass exactly one of init_method= (engines) and store= (sender)")
    if not group_name:
        raise ValueError("create_update_group: group_name must be non-empty (SGLang refuses '')")
    if group_name in _world.pg_names.values():
        raise ValueError(f"weight-update group {group_name!r} already exists in this process; "
                         f"destroy it first (destroy_update_group)")
    backend = resolve_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        assert init_method is not None  # exactly one of the two, checked above
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), prefixed,
        group_name=GroupName(group_name), backend_options=None, timeout=timeout, device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg, store


def destroy_update_group(group: dist.ProcessGroup | None) -> None:
    """Free ``group`` and its name in this process (``torch.distributed.destroy_process_group``,
    as SGLang's ``/destroy_weights_update_group``); None or an already destroyed group: no-op."""
    from torch.distributed.distributed_c10d import _world

    if group is None or group not in _world.pg_names:
        return
    try:
        dist.destroy_process_group(group)
    except Exception as e:  # noqa: BLE001 - a dead peer may make shutdown complain; the name is freed below
        log.warning("destroy_process_group: %s", e)
        for attr in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
            getattr(_world, attr, {}).pop(group, None)


def store_alive(store: dist.Store | None, timeout_s: float = 2.0) -> bool:
    """Whether the process hosting ``store`` (the group's rank 0) still answers: a stale group
    (its sender was killed) has a dead store; a live one answers within ``timeout_s``."""
    if store is None:
        return False
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        store.check(["moe_async/liveness"])
        return True
    except Exception:  # noqa: BLE001 - connection refused / reset: the host is gone
        return False


def group_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` (in place on receivers) from group rank ``src``; blocks."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
