"""Streamed HF export for weight sync at world size > 1, never the whole model in memory.

Every rank builds the same export plan (tensor order, HF parts, buckets of at most
``bucket_bytes``, checked before any byte moves); the other ranks send their primary shards
point-to-point and the sending rank gathers each tensor straight into the bucket it is sent in.
Non-finite weights are refused first. Collective: every rank must exhaust the iterator.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from collections.abc import Set
from typing import Callable, Protocol, Sequence

import torch

from moe_async.weight_sync.bucket import Bucket, nbytes_of
from moe_async.weight_sync.packing import BucketStream
from moe_async.weight_sync.read_ahead import ReadAhead, timed_items

Tensor = torch.Tensor
#: ``convert(megatron_name, full_tensor) -> [(hf_name, hf_tensor), ...]`` (the family's split)
Convert = Callable[[str, Tensor], list[tuple[str, Tensor]]]


@dataclass
class _Source:
    rank: int
    index: int  # in that rank's primary pieces
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def rows(self, keep: int | None) -> int:
        """Rows of this shard inside the kept rows ``[0, keep)`` (all when ``keep`` is None)."""
        return self.shape[0] if keep is None else max(0, min(self.shape[0], keep - self.offset[0]))

    def region(self, keep: int | None) -> tuple[slice, ...]:
        """This shard's kept part in the (row-trimmed) full tensor."""
        n = self.rows(keep)
        return (slice(self.offset[0], self.offset[0] + n),
                *(slice(o, o + s) for o, s in zip(self.offset[1:], self.shape[1:])))


@dataclass
class _Part:
    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int = -1
    offset: int = 0  # byte offset in its bucket

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


@dataclass
class _Tensor:
    name: str  # 1-process Megatron name
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[_Source]
    keep_rows: int | None  # vocab rows kept (padding dropped, never sent), None: all
    parts: list[_Part] = field(default_factory=list)
    direct: bool = False  # gathered straight into its bucket's bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """The exported (row-trimmed) full shape."""
        return self.full_shape if self.keep_rows is None else (self.keep_rows, *self.full_shape[1:])

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


@dataclass
class ExportPlan:
    """What every rank agrees on before any byte moves: tensor order, HF parts, buckets."""

    tensors: list[_Tensor]
    buckets: list[list[_Part]]
    bucket_nbytes: list[int]
    bucket_bytes: int

    @property
    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)


def _check_tiling(name: str, full: tuple[int, ...], sources: Sequence[_Source]) -> None:
    """ValueError unless the sources' boxes cover ``full`` exactly once (metadata only)."""
    numel = 1
    for s in full:
        numel *= s
    covered = 0
    for i, a in enumerate(sources):
        if len(a.offset) != len(full) or any(o < 0 or o + s > f for o, s, f in zip(a.offset, a.shape, full)):
            raise ValueError(f"{name}: a shard at offset {a.offset} of shape {a.shape} lies outside {full}")
        n = 1
        for s in a.shape:
            n *= s
        covered += n
        for b in sources[:i]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape)):
                raise ValueError(f"{name}: primary shards overlap (offsets {a.offset} and {b.offset})")
    if covered != numel:
        raise ValueError(f"{name}: primary shards cover {covered} of {numel} elements")


def make_plan(all_meta: Sequence[Sequence[tuple]], convert: Convert, bucket_bytes: int, *,
              dtype: torch.dtype | None = None, order: Sequence[str] | None = None,
              direct: Callable[[str], bool] = lambda name: False,
              vocab: dict[str, int] | None = None, expected: set[str] | None = None,
              first_bucket_bytes: int | None = None, only: Set[str] | None = None,
              read_from: Set[tuple[int, int]] | None = None) -> ExportPlan:
    """The common plan from every rank's piece metadata ``all_meta[rank] = [(name, full_shape,
    offset, shape, dtype_str), ...]``. ``order``: HF names in the engines' buffer order (Megatron
    tensors follow their first HF part's position; names not in it last, sorted). ``direct(name)``:
    the tensor's split gives row blocks that, concatenated in order, are the tensor itself
    (the identity, a rename; or ``split_rows_2``, gate;up): checked on the parts' shapes,
    such a tensor's parts are placed end to end in one bucket (a bucket is closed before it
    when they would not fit) and it is gathered straight into those bytes.
    ``first_bucket_bytes`` (optional, <= ``bucket_bytes``): the first bucket's budget, each
    next one's twice the previous up to ``bucket_bytes`` (a pipeline's fill: the broadcast
    starts after a small first bucket). ``vocab``: ``{name: rows kept}`` for padded
    vocab tensors. ``expected``: every Megatron name the conversion needs (KeyError naming the
    missing ones). ``only``: plan just these tensors (one sender's share; the pieces keep
    their indices in each rank's list). ``read_from``: only these ``(rank, index)`` pieces are read
    (one of each replicated shard; the others ignored). Raises ValueError (bad tiling, bucket_bytes <= 0)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight_sync.bucket_bytes must be > 0, got {bucket_bytes}")
    vocab = vocab or {}
    by_name: dict[str, _Tensor] = {}
    for r, rank_meta in enumerate(all_meta):
        for i, (name, fs, off, shape, dts) in enumerate(rank_meta):
            if (only is not None and name not in only) or (read_from is not None and (r, i) not in read_from):
                continue
            t = by_name.get(name)
            src_dtype = getattr(torch, str(dts).split(".")[-1])
            if t is None:
                rows = vocab.get(name)
                keep = rows if rows is not None and fs[0] > rows else None
                t = by_name[name] = _Tensor(name, tuple(fs), src_dtype, [], keep)
            elif tuple(fs) != t.full_shape:
                raise ValueError(f"{name}: ranks disagree on the full shape ({tuple(fs)} vs {t.full_shape})")
            t.sources.append(_Source(r, i, tuple(off), tuple(shape)))
    if expected is not None and only is None and set(expected) - set(by_name):
        miss = sorted(set(expected) - set(by_name))
        raise KeyError(f"Megatron -> HF conversion: Megatron tensors missing {miss[:20]} (of {len(miss)})")
    for t in by_name.values():
        _check_tiling(t.name, t.full_shape, t.sources)
        for hf, p in convert(t.name, torch.empty(t.shape, dtype=t.dtype, device="meta")):
            t.parts.append(_Part(hf, tuple(p.shape), dtype or p.dtype))
        t.direct = (direct(t.name) and len(t.parts) >= 1 and all(p.dtype == t.dtype for p in t.parts)
                    and all(len(p.shape) == len(t.shape) and p.shape[1:] == t.shape[1:] for p in t.parts)
                    and sum(p.shape[0] for p in t.parts) == t.shape[0])
    names = sorted(by_name)
    if order is not None:
        pos = {n: i for i, n in enumerate(order)}
        first = {n: min((pos.get(p.hf_name, len(pos)) for p in by_name[n].parts), default=len(pos)) for n in names}
        names.sort(key=lambda n: (first[n], n))
    tensors = [by_name[n] for n in names]
    buckets: list[list[_Part]] = []
    sizes: list[int] = []
    cur: list[_Part] = []
    cur_n = 0
    budget = min(bucket_bytes, first_bucket_bytes or bucket_bytes)
    for t in tensors:
        for j, part in enumerate(t.parts):
            need = t.nbytes if t.direct else part.nbytes  # a direct tensor's parts stay together
            if cur and (not t.direct or j == 0) and cur_n + need > budget:
                buckets.append(cur)
                sizes.append(cur_n)
                cur, cur_n = [], 0
                budget = min(bucket_bytes, 2 * budget)
            part.bucket, part.offset = len(buckets), cur_n
            cur.append(part)
            cur_n += part.nbytes
    if cur:
        buckets.append(cur)
        sizes.append(cur_n)
    for t in tensors:  # a typed view of the bucket needs an aligned offset
        if t.direct and t.parts[0].offset % t.dtype.itemsize:
            t.direct = False
    return ExportPlan(tensors, buckets, sizes, bucket_bytes)


class _Buffers:
    """``slots`` reused flat buffers of ``capacity`` bytes; a bucket over ``capacity`` (a lone
    tensor over bucket_bytes) gets its own, freed as soon as the consumer drops it (the
    consumer must drop its references to a bucket before asking for the next one, as
    ``BroadcastTransport.send`` does); ``acquire`` blocks on ``sem`` until the consumer
    released a slot."""

    def __init__(self, capacity: int, slots: int, device: torch.device, sem: threading.Semaphore | None,
                 stats: dict[str, float]):
        self.capacity, self.device, self.sem, self.stats = capacity, device, sem, stats
        self.bufs: list[Tensor | None] = [None] * slots
        self.k = 0

    def _wait(self) -> None:
        if self.sem is not None:
            t0 = time.perf_counter()
            self.sem.acquire()
            self.stats["buffer_wait_seconds"] += time.perf_counter() - t0

    def token(self) -> None:
        """A bucket that needs no buffer (sent from its own tensor's bytes) still takes a turn."""
        self._wait()
        self.k += 1

    def acquire(self, nbytes: int) -> Tensor:
        self._wait()
        i = self.k % len(self.bufs)
        self.k += 1
        if nbytes > self.capacity:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf = self.bufs[i]
        if buf is None:
            buf = self.bufs[i] = _kept_buffer(i, self.capacity, self.device)
        return buf[:nbytes]


#: CPU bucket buffers kept between syncs, per slot: glibc hands blocks this large back to the
#: OS when freed, so a fresh buffer per sync pays a page fault (and the kernel's zeroing) per
#: 4 KiB page on its first write (3-4x slower writes, docs/weight_sync.md). CUDA's caching
#: allocator keeps freed blocks already. Memory: the slots' buffers (one bucket each) stay
#: allocated on rank ``dst``. One export at a time per process (the transport's); an
#: overlapped export closed before its end drops them (its thread may still write there).
_KEPT: dict[int, Tensor] = {}


def _kept_buffer(slot: int, capacity: int, device: torch.device) -> Tensor:
    if device.type != "cpu":
        return torch.empty(capacity, dtype=torch.uint8, device=device)
    buf = _KEPT.get(slot)
    if buf is None or buf.numel() != capacity:
        _KEPT.pop(slot, None)  # the old one freed before the new one exists
        buf = _KEPT[slot] = torch.empty(capacity, dtype=torch.uint8)
    return buf


def kept_bucket_bytes() -> int:
    """Bytes of the CPU bucket buffers kept between syncs in this process (rank ``dst``)."""
    return sum(b.numel() for b in _KEPT.values())


def release_kept_buffers() -> None:
    """Free the kept bucket buffers (the next sync allocates them again; a memory count of that
    sync, e.g. :class:`~moe_async.weight_sync.alive_bytes.AliveBytes`, then sees them)."""
    _KEPT.clear()


def _typed(flat: Tensor, p: _Part) -> Tensor:
    return flat[p.offset: p.offset + p.nbytes].view(p.dtype).view(p.shape)


def _whole(flat: Tensor, t: _Tensor) -> Tensor:
    """A direct tensor's view of its parts' bytes (end to end in one bucket)."""
    off = t.parts[0].offset
    return flat[off: off + t.nbytes].view(t.dtype).view(t.shape)


def _write(flat: Tensor, p: _Part, t: Tensor) -> None:
    if p.offset % p.dtype.itemsize == 0:
        _typed(flat, p).copy_(t)
    else:  # misaligned for a typed view (mixed dtypes): through the bytes
        flat[p.offset: p.offset + p.nbytes].copy_(t.to(p.dtype).contiguous().reshape(-1).view(torch.uint8))


def run_plan(plan: ExportPlan, pieces: Sequence[Shard], convert: Convert, *, device: torch.device,
             slots: int = 1, group=None, dst: int = 0, sem: threading.Semaphore | None = None,
             stats: dict[str, float] | None = None, steps: bool = False,
             errors: list[BaseException] | None = None) -> BucketStream:
    """Execute ``plan``: collective over ``group`` (every rank exhausts the iterator, in the
    same plan); rank ``dst`` yields ``(bucket, flat, is_last)``, ``flat`` valid until the next
    item is asked for (with ``sem``: until the consumer releases the semaphore once more); the
    consumer drops both before asking (the memory bound counts on it).
    ``pieces``: this rank's primary pieces (``.data`` views), indexed as in the metadata.
    ``stats`` (optional; rank ``dst``) accumulates seconds per phase: ``gather_seconds``
    (receiving the other ranks' shards), ``copy_seconds`` (this rank's own shards and
    non-contiguous received shards copied into place), ``convert_seconds`` (a fused tensor's
    split / cast and its parts' copies into the bucket), ``buffer_wait_seconds`` (waiting
    for the consumer to free a bucket buffer). ``errors`` (rank ``dst``; optional): a local
    failure (the split, a cast, a copy into the bucket) is appended there instead of raised
    and the walk goes on (every receive still runs: the other ranks never wait), the failed
    tensor's parts left unwritten: the caller must not send a bucket once ``errors`` is set."""
    import torch.distributed as dist

    st = stats if stats is not None else {}
    for k in ("gather_seconds", "copy_seconds", "convert_seconds", "buffer_wait_seconds"):
        st.setdefault(k, 0.0)
    clock = time.perf_counter
    multi = dist.is_initialized() and dist.get_world_size(group) > 1
    me = dist.get_rank(group) if multi else 0
    gdst = dst if group is None or not multi else dist.get_global_rank(group, dst)
    if me != dst:
        # in bucket order: a tensor's shards when rank dst receives them (with its first part's
        # bucket); with ``steps`` one None per bucket once its shards are sent
        by_bucket: list[list[_Tensor]] = [[] for _ in plan.buckets]
        b = 0
        for t in plan.tensors:
            b = t.parts[0].bucket if t.parts else b
            by_bucket[b].append(t)
        for ts in by_bucket:
            for t in ts:
                for s in t.sources:
                    n = s.rows(t.keep_rows)
                    if s.rank == me and n:  # padded vocab rows are not sent
                        dist.send(pieces[s.index].data[:n].contiguous(), dst=gdst, group=group)
            if steps:
                yield None
        return
    # per slot one reused buffer of the largest bucket within bucket_bytes; a lone tensor over
    # it gets its own
    cap = max((n for n in plan.bucket_nbytes if n <= plan.bucket_bytes), default=0)
    bufs = _Buffers(cap, max(1, slots), device, sem, st)
    nb = len(plan.buckets)
    cur = -1
    flat: Tensor | None = None

    def bucket_of(b: int, f: Tensor) -> Bucket:
        ps = plan.buckets[b]
        # a part at an offset its dtype cannot view (mixed dtypes) is described by a typed copy
        # of its bytes (the Bucket's dtypes/shapes are the engines' metadata; ``f`` is what is sent)
        return Bucket(names=[p.hf_name for p in ps],
                      tensors=[_typed(f, p) if p.offset % p.dtype.itemsize == 0
                               else f[p.offset: p.offset + p.nbytes].clone().view(p.dtype).view(p.shape) for p in ps],
                      nbytes=plan.bucket_nbytes[b])

    def receive(t: _Tensor, into: Tensor) -> None:
        for s in t.sources:
            n = s.rows(t.keep_rows)
            if not n:
                continue
            region = into[s.region(t.keep_rows)]
            t0 = clock()
            if s.rank == me:
                region.copy_(pieces[s.index].data[:n])
                st["copy_seconds"] += clock() - t0
            elif region.is_contiguous():
                dist.recv(region, src=_glob(s.rank, group, multi), group=group)
                st["gather_seconds"] += clock() - t0
            else:  # e.g. a dim-1 TP shard: one buffer of the shard's size
                tmp = torch.empty((n, *s.shape[1:]), dtype=t.dtype, device=device)
                dist.recv(tmp, src=_glob(s.rank, group, multi), group=group)
                t1 = clock()
                region.copy_(tmp)
                del tmp
                st["gather_seconds"] += t1 - t0
                st["copy_seconds"] += clock() - t1

    def split(t: _Tensor) -> list[Tensor | None]:
        scratch = torch.empty(t.shape, dtype=t.dtype, device=device)
        receive(t, scratch)
        t0 = clock()
        try:
            got: list[tuple[str, Tensor | None]] = list(convert(t.name, scratch))
            if [h for h, _ in got] != [p.hf_name for p in t.parts]:
                raise KeyError(f"{t.name}: the split gave {[h for h, _ in got]}, planned "
                               f"{[p.hf_name for p in t.parts]}")
        except Exception as e:
            if errors is None:
                raise
            errors.append(e)
            got = [(p.hf_name, None) for p in t.parts]  # nothing of this tensor is written
        st["convert_seconds"] += clock() - t0
        return [v for _, v in got]

    for t in plan.tensors:
        first = t.parts[0].bucket if t.parts else cur
        if t.direct:
            while cur < first:  # the tensor's bucket: hand over the ones before it
                if flat is not None:
                    yield bucket_of(cur, flat), flat, False
                    flat = None
                cur += 1
                flat = bufs.acquire(plan.bucket_nbytes[cur])
            assert flat is not None  # acquired above
            receive(t, _whole(flat, t))
            continue
        if flat is not None and cur < first:  # hand the finished bucket over before the scratch exists
            yield bucket_of(cur, flat), flat, False
            flat = None
        got = split(t)  # the scratch lives only in ``got``'s parts (views or the rule's copies)
        for i, p in enumerate(t.parts):
            v = got[i]  # None: its split failed (``errors``)
            own = (v is not None and len(plan.buckets[p.bucket]) == 1 and plan.bucket_nbytes[p.bucket] > plan.bucket_bytes
                   and v.dtype == p.dtype and v.is_contiguous())
            while cur < p.bucket:
                if flat is not None:
                    yield bucket_of(cur, flat), flat, False
                    flat = None
                cur += 1
                if own and v is not None:  # a lone part over bucket_bytes: sent from its own bytes, no buffer
                    bufs.token()
                    flat = v.reshape(-1).view(torch.uint8)
                else:
                    flat = bufs.acquire(plan.bucket_nbytes[cur])
            if not own and v is not None:
                assert flat is not None
                t0 = clock()
                try:
                    _write(flat, p, v)
                except Exception as e:
                    if errors is None:
                        raise
                    errors.append(e)
                st["convert_seconds"] += clock() - t0
            got[i] = v = None  # a part once written is dropped (the rule's copies go one by one)
        del got
    if flat is not None:
        if cur != nb - 1:  # pragma: no cover - plan invariant
            raise RuntimeError(f"weight export ended in bucket {cur} of {nb}")
        yield bucket_of(cur, flat), flat, True


def _glob(rank: int, group, multi: bool) -> int:
    import torch.distributed as dist

    return rank if group is None or not multi else dist.get_global_rank(group, rank)


def gather_plan(pieces: Sequence[Shard], convert: Convert, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                order: Sequence[str] | None = None, direct: Callable[[str], bool] = lambda n: False,
                vocab: dict[str, int] | None = None, expected: set[str] | None = None,
                group=None, dst: int = 0, first_bucket_bytes: int | None = None) -> ExportPlan:
    """Collective: exchange ``pieces``' metadata (one ``all_gather_object``) and ``dst``'s
    ``order`` and ``first_bucket_bytes`` (one ``broadcast_object_list``: the other ranks'
    are ignored), then :func:`make_plan` on every rank (kept for the next call with the same
    metadata, order, sizes and functions)."""
    import torch.distributed as dist

    meta = [(pc.name, pc.full_shape, pc.offset, tuple(pc.data.shape), str(pc.data.dtype)) for pc in pieces]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        all_meta: list = [None] * world
        dist.all_gather_object(all_meta, meta, group=group)
        box = [(list(order) if order is not None else None, first_bucket_bytes)]  # rank dst's, for all
        dist.broadcast_object_list(box, src=_glob(dst, group, True), group=group)
        order, first_bucket_bytes = box[0]
    else:
        all_meta = [meta]
    # the same metadata, order and sizes give the same plan: made once (the rules' meta splits)
    key = (repr(all_meta), None if order is None else tuple(order), bucket_bytes, dtype, first_bucket_bytes,
           convert, direct, None if vocab is None else tuple(sorted(vocab.items())),
           None if expected is None else frozenset(expected))
    hit = _PLANS.get(key)
    if hit is None:
        hit = make_plan(all_meta, convert, bucket_bytes, dtype=dtype, order=order, direct=direct, vocab=vocab,
                        expected=expected, first_bucket_bytes=first_bucket_bytes)
        _PLANS.clear()  # one plan kept (the current sync's)
        _PLANS[key] = hit
    return hit


_PLANS: dict[tuple, ExportPlan] = {}


#: with overlap, the first bucket's budget is bucket_bytes / RAMP (then doubling): the
#: pipeline's fill (the first gather, with nothing to overlap it) is that much shorter
RAMP = 8


def streamed_buckets(pieces: Sequence[Shard], convert: Convert, bucket_bytes: int, *,
                     device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                     order: Sequence[str] | None = None, direct: Callable[[str], bool] = lambda n: False,
                     vocab: dict[str, int] | None = None, expected: set[str] | None = None,
                     overlap: bool = False, stats: dict[str, float] | None = None, group=None, dst: int = 0,
                     ) -> BucketStream:
    """Plan (:func:`gather_plan`) and stream (:func:`run_plan`) the export; collective.

    Serial (``overlap=False``): one bucket buffer; each ``flat`` valid until the next item
    is asked for. ``overlap=True``: a thread runs the export (and its gather) one bucket ahead
    with two buffers, the buckets ramping up from ``bucket_bytes / RAMP`` (doubling) so the
    first broadcast starts after a small first bucket; the returned iterator's ``close()`` stops it (the other ranks' sends
    then fail: only for a sync that is failing anyway). ``stats`` gets ``pack_seconds``
    (export busy time) and ``wait_seconds`` (consumer waiting), like
    :func:`~moe_async.weight_sync.packing.packed_buckets`, plus ``plan_seconds`` (the
    collective plan) and :func:`run_plan`'s per-phase seconds."""
    stats = stats if stats is not None else {}
    stats.setdefault("pack_seconds", 0.0)
    stats.setdefault("wait_seconds", 0.0)
    device = torch.device(device)
    t0 = time.perf_counter()
    plan = gather_plan(pieces, convert, bucket_bytes, dtype=dtype, order=order, direct=direct, vocab=vocab,
                       expected=expected, group=group, dst=dst,
                       first_bucket_bytes=max(1, bucket_bytes // RAMP) if overlap else None)
    stats["plan_seconds"] = stats.get("plan_seconds", 0.0) + time.perf_counter() - t0
    if not overlap:
        return timed_items(run_plan(plan, pieces, convert, device=device, slots=1, group=group, dst=dst, stats=stats),
                      stats)
    return ReadAhead(lambda sem: run_plan(plan, pieces, convert, device=device, slots=2, group=group, dst=dst,
                                          sem=sem, stats=stats), stats, release_kept_buffers)


class Shard(Protocol):
    """One primary shard of a 1-process tensor held by this rank."""

    name: str  # the 1-process tensor's name
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]  # of the shard in the full tensor, per dim
    data: Tensor  # the shard (a view of the model's storage)


class ShardSource(Protocol):
    """What the streamed export needs of a model (e.g.
    :class:`moe_async.megatron.hf_export.HFExporter`): this rank's shards and the rule that
    turns a full tensor into its HF tensors. The same on every rank except ``shards()``."""

    #: every tensor name the conversion needs (KeyError in the plan naming the missing ones)
    expected: frozenset[str]
    #: ``{name: rows kept}`` of padded vocab tensors (rows beyond are never sent)
    vocab: dict[str, int]

    def check(self) -> None:
        """Refuse weights that must not reach an engine (e.g. non-finite), before any byte moves."""

    def shards(self) -> Sequence[Shard]:
        """This rank's primary shards, in an order fixed while the model keeps its storage."""

    def convert(self, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """``[(hf_name, hf_tensor), ...]`` of the full tensor ``t`` (also on ``meta`` tensors)."""

    def direct(self, name: str) -> bool:
        """The HF parts, concatenated along dim 0 in order, are the tensor itself."""


def source_buckets(source: ShardSource, bucket_bytes: int, *, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None, order: Sequence[str] | None = None,
                   overlap: bool = False, stats: dict[str, float] | None = None,
                   ) -> BucketStream:
    """:func:`streamed_buckets` of ``source``'s shards over the whole world, global rank 0
    yielding. ``source.check()`` first (e.g. non-finite weights refused on every rank before
    anything is sent). Collective: every rank exhausts it. ``stats`` also gets
    ``finite_seconds`` (the check) and ``pieces_seconds`` (``source.shards()``).
    KeyError if a tensor has no HF name (every rank, before anything is sent)."""
    stats = stats if stats is not None else {}
    t0 = time.perf_counter()
    source.check()
    t1 = time.perf_counter()
    pieces = source.shards()
    stats["finite_seconds"] = stats.get("finite_seconds", 0.0) + t1 - t0
    stats["pieces_seconds"] = stats.get("pieces_seconds", 0.0) + time.perf_counter() - t1
    return streamed_buckets(pieces, source.convert, bucket_bytes, device=device, dtype=dtype, order=order,
                            direct=source.direct, vocab=dict(source.vocab), expected=set(source.expected),
                            overlap=overlap, stats=stats)


class PackedExport:
    """A sync's tensors as ready buckets: ``BroadcastTransport.send`` opens it with its
    ``bucket_bytes``, device, engines' order and overlap instead of bucketing named tensors.
    ``open(bucket_bytes, *, device, order, overlap, stats)`` -> iterator of
    ``(bucket, flat, is_last)`` with ``close()``."""

    def __init__(self, open_fn: Callable[..., BucketStream]):
        self._open = open_fn

    def open(self, bucket_bytes: int, *, device: torch.device, order: Sequence[str] | None,
             overlap: bool, stats: dict[str, float]) -> BucketStream:
        return self._open(bucket_bytes, device=device, order=order, overlap=overlap, stats=stats)


def source_export(source: ShardSource, dtype: torch.dtype | None = None) -> PackedExport:
    """The streamed export of ``source`` for ``BroadcastTransport.send`` (global rank 0)."""
    return PackedExport(lambda bucket_bytes, **kw: source_buckets(source, bucket_bytes, dtype=dtype, **kw))
