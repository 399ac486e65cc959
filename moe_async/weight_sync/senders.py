"""Several senders: each unique shard leaves the rank that holds it, once, over its own group.

Data path (every trainer rank; collective): this rank's shards' metadata -> one
``all_gather_object`` (+ rank 0's engine order) -> the same :class:`SenderPlan` everywhere:
each tensor's sender (:func:`assign_senders`: the one rank holding all its primary shards,
e.g. an expert's EP rank or a layer's PP stage; for a tensor split over ranks, the least
loaded holder, ties to the lowest rank, which gathers it point-to-point); each sender's
buckets (:func:`~moe_async.weight_sync.stream_export.make_plan`); one global bucket order,
round robin over the senders, walked by every rank (:func:`sender_buckets`). A bucket's
sender broadcasts it over its own update group (rank 0 of that group); global rank 0 also
posts every bucket's update call to every engine in that one order, so that two senders
never wait on each other (an engine receives one broadcast at a time).

Memory per rank: its own shards + one bucket buffer (+ the largest tensor it gathers).
Lower bound of a sync: ``max(bytes per sender) / link bandwidth`` (:meth:`SenderPlan.lower_bound_s`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, NamedTuple, Protocol, Sequence, TypeVar

import torch

from moe_async.errors import one_line
from moe_async.weight_sync.bucket import Bucket, nbytes_of
from moe_async.weight_sync.read_ahead import timed_items
from moe_async.weight_sync.stream_export import (Convert, ExportPlan, PackedExport, Shard, ShardSource, make_plan,
                                                 run_plan)

if TYPE_CHECKING:
    from moe_async.weight_sync.config import WeightSyncConfig
    from torch.distributed import ProcessGroup, Store

    from moe_async.protocols import WeightReceiver
    from moe_async.weight_sync.outcome import SyncOutcome
    from moe_async.weight_sync.transport import WeightTransport

log = logging.getLogger(__name__)
Tensor = torch.Tensor
R = TypeVar("R")
#: ``all_meta[rank] = [(name, full_shape, offset, shape, dtype_str), ...]`` (stream_export)
Meta = Sequence[Sequence[tuple]]


def assign_senders(all_meta: Meta) -> dict[str, int]:
    """``{tensor name: sending rank}`` from every rank's shard metadata (primary shards and, for
    data-parallel sharing, their replicas): the candidates of a tensor are the ranks holding
    the most of it (the fewest bytes to gather); one candidate sends it (an expert's EP rank, a
    layer's PP stage); among several (TP pieces, DP replicas) the one with the fewest bytes
    assigned so far (single-candidate tensors counted first, then the others largest first;
    ties: lowest rank). With every tensor held by all of a set of ranks (e.g. DP2 replicas),
    the bytes per sender differ by at most the largest tensor."""
    held: dict[str, dict[int, int]] = {}
    size: dict[str, int] = {}
    seen: set[tuple[str, int, tuple, tuple]] = set()
    for r, rank_meta in enumerate(all_meta):
        for name, fs, off, shape, dts in rank_meta:
            dt = getattr(torch, str(dts).split(".")[-1])
            size[name] = nbytes_of(tuple(fs), dt)
            h = held.setdefault(name, {})
            h[r] = h.get(r, 0)
            if (name, r, tuple(off), tuple(shape)) not in seen:  # a box counted once per rank
                seen.add((name, r, tuple(off), tuple(shape)))
                h[r] += nbytes_of(tuple(shape), dt)
    cands = {n: sorted(r for r, b in h.items() if b == max(h.values())) for n, h in held.items()}
    load = [0] * len(all_meta)
    owner: dict[str, int] = {}
    for name in sorted(cands):
        if len(cands[name]) == 1:
            owner[name] = cands[name][0]
            load[owner[name]] += size[name]
    for name in sorted((n for n in cands if len(cands[n]) > 1), key=lambda n: (-size[n], n)):
        r = min(cands[name], key=lambda x: (load[x], x))
        owner[name] = r
        load[r] += size[name]
    return owner


def choose_sources(all_meta: Meta, owner: dict[str, int]) -> set[tuple[int, int]]:
    """The ``(rank, index)`` pieces a sync reads: per tensor, each distinct shard box once,
    from its sender when it holds it, else from a holder in the sender's block of ``n`` ranks
    (``rank // n == sender // n``, ``n`` the tensor's number of boxes), then the nearest rank,
    then the lower: in Megatron-Core's order tp-cp-ep-dp-pp a TP group is such an aligned
    block of consecutive ranks, so a TP piece comes from the sender's own TP group."""
    boxes: dict[tuple[str, tuple, tuple], list[tuple[int, int]]] = {}
    for r, rank_meta in enumerate(all_meta):
        for i, (name, _fs, off, shape, _dt) in enumerate(rank_meta):
            boxes.setdefault((name, tuple(off), tuple(shape)), []).append((r, i))
    nbox: dict[str, int] = {}
    for name, _off, _shape in boxes:
        nbox[name] = nbox.get(name, 0) + 1
    keep: set[tuple[int, int]] = set()
    for (name, _off, _shape), hs in boxes.items():
        s, n = owner[name], nbox[name]
        keep.add(min(hs, key=lambda ri: (ri[0] // n != s // n, abs(ri[0] - s), ri[0], ri[1])))
    return keep


@dataclass
class SenderPlan:
    """What every rank agrees on before any byte moves (see the module's docstring)."""

    plans: dict[int, ExportPlan]  # sender rank -> its tensors and buckets
    order: list[tuple[int, int]]  # the global bucket order: (sender rank, its bucket index)

    @property
    def sent_bytes(self) -> dict[int, int]:
        """Bytes each sender broadcasts (to every engine)."""
        return {s: p.total_bytes for s, p in sorted(self.plans.items())}

    @property
    def total_bytes(self) -> int:
        return sum(self.sent_bytes.values())

    def lower_bound_s(self, link_bytes_per_s: float) -> float:
        """The sync's lower bound with these senders: the busiest sender's bytes over its link."""
        return max(self.sent_bytes.values(), default=0) / link_bytes_per_s


def make_sender_plan(all_meta: Meta, convert: Convert, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                     order: Sequence[str] | None = None, direct: Callable[[str], bool] = lambda n: False,
                     vocab: dict[str, int] | None = None, expected: Set[str] | None = None,
                     first_bucket_bytes: int | None = None) -> SenderPlan:
    """:class:`SenderPlan` from every rank's metadata (arguments as
    :func:`~moe_async.weight_sync.stream_export.make_plan`, whose checks each sender's plan
    runs). KeyError naming the tensors in ``expected`` that no rank holds."""
    owner = assign_senders(all_meta)
    keep = choose_sources(all_meta, owner)
    if expected is not None and set(expected) - set(owner):
        miss = sorted(set(expected) - set(owner))
        raise KeyError(f"Megatron -> HF conversion: Megatron tensors missing {miss[:20]} (of {len(miss)})")
    plans: dict[int, ExportPlan] = {}
    for s in sorted(set(owner.values())):
        plans[s] = make_plan(all_meta, convert, bucket_bytes, dtype=dtype, order=order, direct=direct, vocab=vocab,
                             first_bucket_bytes=first_bucket_bytes, only={n for n, r in owner.items() if r == s},
                             read_from=keep)
    glob = sorted((b, s) for s, p in plans.items() for b in range(len(p.buckets)))
    return SenderPlan(plans, [(s, b) for b, s in glob])


_PLANS: dict[tuple, SenderPlan] = {}


def gather_sender_plan(pieces: Sequence[Shard], convert: Convert, bucket_bytes: int, *,
                       dtype: torch.dtype | None = None, order: Sequence[str] | None = None,
                       direct: Callable[[str], bool] = lambda n: False, vocab: dict[str, int] | None = None,
                       expected: Set[str] | None = None, group=None) -> SenderPlan:
    """Collective over ``group``: every rank's ``pieces`` metadata (one ``all_gather_object``)
    and rank 0's ``order`` (one ``broadcast_object_list``), then :func:`make_sender_plan` on
    every rank (kept for the next call with the same inputs)."""
    import torch.distributed as dist

    meta = [(pc.name, tuple(pc.full_shape), tuple(pc.offset), tuple(pc.data.shape), str(pc.data.dtype))
            for pc in pieces]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_meta: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(all_meta, meta, group=group)
        box = [list(order) if order is not None else None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
        order = box[0]
    else:
        all_meta = [meta]
    key = (repr(all_meta), None if order is None else tuple(order), bucket_bytes, dtype, convert, direct,
           None if vocab is None else tuple(sorted(vocab.items())), None if expected is None else frozenset(expected))
    hit = _PLANS.get(key)
    if hit is None:
        hit = make_sender_plan(all_meta, convert, bucket_bytes, dtype=dtype, order=order, direct=direct,
                               vocab=vocab, expected=expected)
        _PLANS.clear()
        _PLANS[key] = hit
    return hit


class SenderItem(NamedTuple):
    """One bucket of the global order. ``flat`` (its bytes, valid until the next item is asked
    for) only on its sender; global rank 0 gets every item (``flat`` None for the others')."""

    sender: int
    bucket: Bucket
    flat: Tensor | None
    last: bool  # the last bucket of the sync (carries the weight version)
    error: str | None = None  # on its sender: this sender's export failed (this bucket or before)


def _meta_bucket(plan: ExportPlan, b: int) -> Bucket:
    ps = plan.buckets[b]
    return Bucket(names=[p.hf_name for p in ps],
                  tensors=[torch.empty(p.shape, dtype=p.dtype, device="meta") for p in ps],
                  nbytes=plan.bucket_nbytes[b])


def sender_buckets(plan: SenderPlan, pieces: Sequence[Shard], convert: Convert, *,
                   device: torch.device | str = "cpu", group=None, coordinator: int = 0,
                   stats: dict[str, float] | None = None) -> Iterator[SenderItem]:
    """Walk ``plan.order`` on this rank (collective over ``group``: every rank exhausts it):
    for each bucket, its holders send their pieces to its sender, which yields it; rank
    ``coordinator`` also yields the other senders' buckets (metadata only). ``stats``: the
    per-phase seconds of :func:`~moe_async.weight_sync.stream_export.run_plan` on the senders."""
    import torch.distributed as dist

    device = torch.device(device)
    me = dist.get_rank(group) if dist.is_initialized() else 0
    st = stats if stats is not None else {}
    errors: list[BaseException] = []  # this rank's own export failures: the walk goes on
    its = {s: run_plan(p, pieces, convert, device=device, slots=1, group=group, dst=s, stats=st, steps=True,
                       errors=errors if s == me else None)
           for s, p in plan.plans.items()}
    n = len(plan.order)
    for k, (s, b) in enumerate(plan.order):
        item = next(its[s])
        if s == me:
            err = f"{type(errors[0]).__name__}: {errors[0]}" if errors else None
            yield SenderItem(s, item[0], item[1], k == n - 1, err)
            del item  # the buffer is reused by this sender's next bucket
        elif me == coordinator:
            yield SenderItem(s, _meta_bucket(plan.plans[s], b), None, k == n - 1)
    for it in its.values():  # every plan ended (its generator returns)
        for _ in it:  # pragma: no cover - plan invariant
            raise RuntimeError("weight export: a sender's plan has buckets beyond the global order")


def source_sender_items(source: ShardSource, bucket_bytes: int, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, order: Sequence[str] | None = None,
                        group=None, stats: dict[str, float] | None = None) -> Iterator[SenderItem]:
    """:func:`sender_buckets` of ``source`` (checked first: e.g. non-finite weights refused on
    every rank before anything moves). A source with ``replica_shards()`` (this rank's
    data-parallel replicas of other ranks' primary shards, e.g.
    :meth:`moe_async.megatron.hf_export.HFExporter.replica_shards`) offers them too: the
    sending of replicated tensors is then spread over their replicas. Collective: every rank
    exhausts it."""
    st = stats if stats is not None else {}
    t0 = time.perf_counter()
    source.check()
    replicas = getattr(source, "replica_shards", None)
    pieces = list(source.shards()) + (list(replicas()) if replicas is not None else [])
    plan = gather_sender_plan(pieces, source.convert, bucket_bytes, dtype=dtype, order=order,
                              direct=source.direct, vocab=dict(source.vocab), expected=set(source.expected),
                              group=group)
    st["plan_seconds"] = st.get("plan_seconds", 0.0) + time.perf_counter() - t0
    return sender_buckets(plan, pieces, source.convert, device=device, group=group, stats=st)


# ---- the transport side: rank 0 posts every bucket, each sender broadcasts its own --------

def sender_group_name(base: str, sender: int) -> str:
    """Update-group name of sender ``sender`` (rank 0: the transport's own ``base``)."""
    return base if sender == 0 else f"{base}-s{sender}"


def sender_export(source: ShardSource, group_name: str, *, dtype: torch.dtype | None = None, group=None
                  ) -> SendersExport:
    """Global rank 0's several-sender export for ``BroadcastTransport.send``: every bucket of
    the global order, each named with its sender's group (:func:`sender_group_name` of the
    transport's ``group_name``); this rank's own buckets with their bytes (broadcast by the
    transport), the others' as metadata (posted to the engines only)."""
    opened: list[PostInTurn] = []

    def open_fn(bucket_bytes: int, *, device: torch.device, order: Sequence[str] | None, overlap: bool,
                stats: dict[str, float]) -> PostInTurn:
        stats.setdefault("pack_seconds", 0.0)
        stats.setdefault("wait_seconds", 0.0)
        items = source_sender_items(source, bucket_bytes, device=device, dtype=dtype, order=order, group=group,
                                    stats=stats)
        opened.append(PostInTurn(items, group_name, device=device, group=group, stats=stats))
        return opened[-1]

    return SendersExport(open_fn, opened)


class SendersExport(PackedExport):
    """:func:`sender_export`'s export; :meth:`close` runs every opened walk to its end (a
    ``send`` that raised without draining it must not leave the other ranks waiting)."""

    def __init__(self, open_fn: Callable[..., Any], opened: list[PostInTurn]):
        super().__init__(open_fn)
        self.opened = opened

    def close(self) -> None:
        for st in self.opened:
            st.close()


# ---- each bucket's turn: posted only once its sender holds its bytes, sent once posted -----

def _flag(v: int, device: torch.device) -> Tensor:
    return torch.tensor([v], dtype=torch.int32, device=device)


def _glob(rank: int, group) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


#: rank 0's answers in a bucket's turn (:func:`ask_to_send`)
SKIP, SEND, LEAVE = 0, 1, 2


def ask_to_send(ok: bool, *, device: torch.device, group=None, coordinator: int = 0) -> int:
    """A sender's side of one of its buckets' turn (point-to-point with ``coordinator``, in
    the walk's order): tell it whether the bucket can be sent (its bytes made, its group
    formed), then wait for the answer: :data:`SEND` once the bucket's update call is posted to
    every engine (broadcast it now); :data:`SKIP` when nothing was posted for it (a failure on
    some rank: do not broadcast; no engine waits for it); :data:`LEAVE` when its call may have
    been posted but the sync was abandoned (do not broadcast; abandon the group at once, so an
    engine waiting in that broadcast fails now: :meth:`SenderLink.abandon`)."""
    import torch.distributed as dist

    dist.send(_flag(int(ok), device), dst=_glob(coordinator, group), group=group)
    t = _flag(0, device)
    dist.recv(t, src=_glob(coordinator, group), group=group)
    return int(t.item())


class PostInTurn:
    """Global rank 0's walk for its transport (a :class:`~moe_async.weight_sync.packing.BucketStream`
    of ``(bucket, flat or None, last)``, each bucket named with its sender's group): another
    sender's bucket is handed over (its update call posted) only after that sender said its
    bytes are ready (:func:`ask_to_send`), and the sender is told to broadcast when the
    transport asks for the next bucket (the call is queued by then). A sender that reports a
    failure, or this rank's own export failing, makes ``__next__`` raise WeightSyncError
    (nothing more is posted: the transport ends the sessions, the engines drop what they
    staged). After :meth:`abandon` (the transport failed and drains this) or :meth:`close`,
    every later turn is answered "do not send" while the walk runs to its end, so the other
    ranks' gathers complete (a sender whose call was already posted is told :data:`LEAVE`).
    ``stats['turn_seconds']``: time waiting for the senders' answers."""

    def __init__(self, items: Iterator[SenderItem], base: str, *, device: torch.device, group=None,
                 stats: dict[str, float] | None = None):
        import torch.distributed as dist

        self.stats = stats if stats is not None else {"pack_seconds": 0.0, "wait_seconds": 0.0}
        self.stats.setdefault("turn_seconds", 0.0)
        self.items = timed_items(items, self.stats)
        self.base, self.device, self.group = base, device, group
        self.me = dist.get_rank(group) if dist.is_initialized() else 0
        self.owed: int | None = None  # the sender whose answer is still due
        self.stopped = False
        self.k = -1

    def abandon(self) -> None:
        """Post nothing more; every later turn is answered "do not send"."""
        self.stopped = True

    def __iter__(self) -> PostInTurn:
        return self

    def _answer(self, posted: bool = True) -> None:
        """Answer the owed turn: SEND, or once stopped LEAVE (its call was handed to the
        transport, which may have posted it) / SKIP (``posted`` False: nothing was)."""
        import torch.distributed as dist

        if self.owed is not None:
            code = SEND if not self.stopped else LEAVE if posted else SKIP
            dist.send(_flag(code, self.device), dst=_glob(self.owed, self.group), group=self.group)
            self.owed = None

    def __next__(self) -> tuple[Bucket, Tensor | None, bool]:
        import torch.distributed as dist

        from moe_async.weight_sync.group import WeightSyncError

        self._answer()  # the previous bucket was posted (or abandoned): its sender may go
        while True:
            it = next(self.items)  # StopIteration: the walk ended
            self.k += 1
            if it.sender == self.me:
                if self.stopped:
                    continue
                if it.error is not None:
                    self.stopped = True
                    raise WeightSyncError(f"rank {self.me}: export failed at bucket {self.k}: {it.error}")
            else:
                t0 = time.perf_counter()
                ok = _flag(0, self.device)
                dist.recv(ok, src=_glob(it.sender, self.group), group=self.group)
                self.stats["turn_seconds"] += time.perf_counter() - t0
                self.owed = it.sender
                if self.stopped:
                    self._answer(posted=False)
                    continue
                if not ok.item():
                    self.stopped = True
                    self._answer(posted=False)
                    raise WeightSyncError(f"sender {it.sender} cannot send bucket {self.k} of the sync (its export or "
                                          f"group failed); nothing more is posted")
            it.bucket.group_name = sender_group_name(self.base, it.sender)
            return it.bucket, it.flat, it.last

    def close(self) -> None:
        """Abandon and run the walk to its end (a no-op once it ended)."""
        self.stopped = True
        try:
            for _ in self:
                pass
        except Exception as e:  # noqa: BLE001 - the sync's first error is what propagates
            log.warning("weight sync: finishing the senders' walk after a failure stopped: %s", e)


class SenderLink:
    """A sender other than global rank 0: its own update group with every engine (rank 0 of
    it), formed in turn after the lower ranks' (:func:`connect_senders`); it broadcasts its
    own buckets only (rank 0 posts every bucket's update call to the engines).

    Args: as :class:`~moe_async.weight_sync.transport.BroadcastTransport` (``group_name``: the
    coordinator's; this link's group is :func:`sender_group_name` of it and ``rank``).
    """

    def __init__(self, clients: Sequence[WeightReceiver], cfg: WeightSyncConfig, *, rank: int, ranks_per_engine: int | Sequence[int] = 1,
                 master_address: str = "127.0.0.1", group_name: str = "moe_async_weight_sync"):
        from moe_async.weight_sync.group import resolve_backend, transport_device
        from moe_async.weight_sync.membership import GroupMembership

        self.cfg, self.rank = cfg, rank
        self.backend = resolve_backend(cfg.backend)
        self.device = transport_device(self.backend)
        self.group_name = sender_group_name(group_name, rank)
        self.membership = GroupMembership(clients, engine_sizes=ranks_per_engine, group_name=self.group_name,
                                          backend=self.backend, master_address=master_address,
                                          timeout_s=cfg.timeout_s)
        self.group: ProcessGroup | None = None

    def send(self, source: ShardSource, *, dtype: torch.dtype | None = None, group=None) -> dict[str, float]:
        """This rank's part of a sync (collective with every trainer rank): its pieces to their
        senders, its own buckets over its group. After a failure the walk goes on without
        broadcasting (the other ranks' gathers complete), then the error is raised. A
        broadcast that fails after its call was posted, or a turn answered :data:`LEAVE`,
        abandons the group at once (:meth:`abandon`)."""
        from moe_async.weight_sync.group import WeightSyncError, group_broadcast

        stats: dict[str, float] = {"turn_seconds": 0.0}
        err: BaseException | None = None
        nbytes, k = 0, -1
        t0 = time.perf_counter()
        for it in source_sender_items(source, self.cfg.bucket_bytes, device=self.device, dtype=dtype, group=group,
                                      stats=stats):
            if it.flat is None:  # pragma: no cover - only global rank 0 sees other senders' buckets
                continue
            k += 1
            if err is None and it.error is not None:
                err = WeightSyncError(f"sender {self.rank}: export failed: {it.error}")
            elif err is None and self.group is None:
                err = RuntimeError(f"sender {self.rank}: no update group (connect_senders() first)")
            tt = time.perf_counter()
            go = ask_to_send(err is None, device=self.device, group=group)
            stats["turn_seconds"] += time.perf_counter() - tt
            left = None
            if go == LEAVE and self.group is not None:
                left = "the sync was abandoned after its update call was posted"
            elif go == SEND and err is None:
                assert self.group is not None
                try:
                    group_broadcast(self.group, it.flat, src=0)
                    nbytes += it.flat.numel()
                except Exception as e:  # noqa: BLE001 - raised after the walk
                    left = f"its broadcast failed after its update call was posted: {type(e).__name__}: {e}"
                    traceback.clear_frames(e.__traceback__)  # no frame keeps the group alive
                except BaseException as e:  # noqa: BLE001 - raised after the walk, as itself
                    err = e
                    traceback.clear_frames(e.__traceback__)
                    left = "interrupted"
            if left is not None:
                self.abandon()
                if err is None:
                    err = WeightSyncError(f"sender {self.rank}, its bucket {k}: {one_line(left, 400)}; left its update "
                                          f"group at once (an engine waiting in that broadcast fails now)")
            del it
        if err is not None:
            raise err
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0,
                **{f"sync/export_{k}": v for k, v in stats.items()}}

    def abandon(self) -> None:
        """Leave the group at once after a failed or abandoned broadcast
        (:meth:`~moe_async.weight_sync.membership.GroupMembership.abandon`: this side first, so an
        engine waiting in the broadcast fails now on gloo); a re-form follows before the next sync."""
        self.group = None
        self.membership.abandon()

    def close(self) -> None:
        self.membership.leave()
        self.group = None


class PackedSender(Protocol):
    """Rank 0's transport as several senders use it (a
    :class:`~moe_async.weight_sync.transport.BroadcastTransport`): its update group's name and
    ``send`` of a packed export at a weight_version (the sync's metrics)."""

    @property
    def group_name(self) -> str: ...

    def send(self, named_tensors: PackedExport, weight_version: int, /) -> dict[str, float]: ...


def connect_senders(rank: int, world: int, store: Store | None, *, transport: WeightTransport | None = None, link: SenderLink | None = None,
                    key: str = "moe_async/sender_groups", timeout_s: float = 600.0) -> None:
    """Form every sender's update group in rank order (engines serve one join at a time:
    groups formed concurrently in different orders would wait on each other): rank 0 connects
    ``transport`` (its group, turn 0), every other rank its ``link`` in its turn; then every
    rank waits for the last turn. ``store``: shared by every trainer rank (e.g. the default
    process group's); ``key``: fresh per connect. Raises GroupFormationError naming the first
    group that failed, on every rank."""
    import datetime

    from moe_async.weight_sync.membership import GroupFormationError, form_in_turn

    assert store is not None, "connect_senders: no store"
    if rank == 0:
        assert transport is not None
        try:
            transport.connect()
        except GroupFormationError as e:
            store.set(f"{key}/0", f"group 0 failed: {e}")
            raise
        store.set(f"{key}/0", "ok")
    else:
        assert link is not None
        link.group = form_in_turn(link.membership, rank, world, store, key=key, timeout_s=timeout_s)
    # a later group that failed fails the connect here too (each turn bounded by timeout_s)
    store.wait([f"{key}/{world - 1}"], datetime.timedelta(seconds=timeout_s * world))
    last = store.get(f"{key}/{world - 1}").decode()
    if last != "ok":
        raise GroupFormationError(f"update groups not formed: {last}")


def sync_from_senders(rank: int, source: ShardSource, version: int, *, transport: PackedSender | None = None,
                      link: SenderLink | None = None, group=None, send: Callable[[PackedExport, int], R] | None = None
                      ) -> R | dict[str, float] | SyncOutcome:
    """One sync from every rank (collective): rank 0 ``send(export, version)`` (default
    ``transport.send``) of :func:`sender_export`
    (pause, sessions, every bucket's update call, its own broadcasts, versioned last call,
    continue), every other rank ``link.send``. Every rank agrees on the outcome: the errors of
    all ranks are exchanged, and any one fails the sync on every rank (WeightSyncError naming
    each failing rank), unless rank 0's ``send`` reported lost engines (a
    :class:`~moe_async.weight_sync.outcome.SyncOutcome` not ``ok``, e.g. from
    :func:`~moe_async.weight_sync.outcome.send_or_lost`): then every rank returns a SyncOutcome
    naming them (their failure, not the sync's: the caller restarts them and re-forms the
    groups), its ``error`` joining every rank's. Returns this rank's metrics (rank 0: what
    ``send`` returned)."""
    import torch.distributed as dist

    from moe_async.weight_sync.group import WeightSyncError
    from moe_async.weight_sync.outcome import SyncOutcome
    out: R | dict[str, float] | SyncOutcome = {}
    err: str | None = None
    try:
        if rank == 0:
            assert transport is not None
            export = sender_export(source, transport.group_name, group=group)
            try:
                out = (send or transport.send)(export, version)
            finally:
                export.close()  # the walk ends on every rank, whatever ``send`` did
        else:
            assert link is not None
            out = link.send(source, group=group)
    except Exception as e:  # noqa: BLE001 - agreed on below
        err = f"rank {rank}: {type(e).__name__}: {one_line(str(e))}"
    lost = list(out.lost) if isinstance(out, SyncOutcome) and not out.ok else []
    if isinstance(out, SyncOutcome) and out.error:
        err = f"rank {rank}: {one_line(out.error)}"
    mine = (err, lost)
    got: list = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if len(got) > 1:
        dist.all_gather_object(got, mine, group=group)
    else:
        got = [mine]
    bad = [e for e, _ in got if e]
    lost = got[0][1]
    if lost:  # as the 1-sender path (send_or_lost): reported, every rank alike
        metrics = out.metrics if isinstance(out, SyncOutcome) else {}
        return SyncOutcome(metrics, list(lost), "; ".join(bad))
    if bad:
        raise WeightSyncError("weight sync failed on " + "; ".join(bad))
    return out
