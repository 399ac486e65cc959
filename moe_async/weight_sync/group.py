"""The dedicated weight-update process group between a trainer rank and engine ranks.

It lives outside the trainer's default ``torch.distributed`` world (Megatron owns that),
as SGLang's ``init_weights_update_group`` expects: the trainer is rank 0, engine ``i``'s
TP rank ``r`` is ``rank_offset + r``. Built from a ``TCPStore`` plus a ``ProcessGroupGloo``
(CPU) or ``ProcessGroupNCCL`` (GPU): the same calls on both kinds of machine.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight_sync.backend must be auto|gloo|nccl, got {backend!r}")
    return backend


def bind_master_store(master_address: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's TCPStore, bound now to a port the OS picks (``store.port``), so the port
    handed to the engines is already ours: no window in which another process can take it
    (picking a free port, releasing it and binding it later races under load)."""
    return dist.TCPStore(
        master_address, 0, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroup:
    """Create (collectively: every member must call it) the weight-update group.

    Args:
        master_address / master_port: TCPStore address; rank 0 (the trainer) hosts it.
        rank: this process's rank in the group (0 = trainer; engines at ``rank_offset``+).
        world_size: 1 trainer + all engine ranks.
        group_name: store prefix, so several groups may share a port range.
        backend: ``gloo`` or ``nccl`` (``auto`` resolved by :func:`resolve_backend`).
        timeout_s: seconds before a collective fails instead of hanging.
        store: rank 0 may pass the store from :func:`bind_master_store` (then
            ``master_port`` is ``store.port``).

    Returns:
        A ``ProcessGroup`` whose ``broadcast`` is used by the sender and receivers.

    Raises:
        RuntimeError (from torch): the store or peers are unreachable within ``timeout_s``.
    """
    backend = resolve_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout
        )
    store = dist.PrefixStore(group_name, store)
    if backend == "nccl":  # pragma: no cover - needs CUDA
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def group_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` (in place on receivers) from group rank ``src``; blocks."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
