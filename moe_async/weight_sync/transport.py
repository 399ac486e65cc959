"""Weight transports: how a versioned set of HF-named tensors reaches the engines.

:class:`BroadcastTransport` (NCCL/gloo broadcast of flattened buckets inside an update session,
as slime and SGLang's ``update_weights_from_distributed``); the colocated ``TensorTransport`` and
the fallback ``DiskTransport`` are their own modules (``factory.make_transport`` picks one). The
version is set only with the last bucket.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Set
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import torch

from moe_async.errors import one_line
from moe_async.protocols import WeightReceiver
from moe_async.weight_sync.bucket import Bucket, nbytes_of, str_to_dtype
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.flush import DeferredFlushes
from moe_async.weight_sync.group import WeightSyncError, group_broadcast, resolve_backend, transport_device
from moe_async.weight_sync.membership import GroupMembership
from moe_async.weight_sync.packing import BucketStream, PackPool, contiguous_span, in_layout_order, packed_buckets
from moe_async.weight_sync.stream_export import PackedExport

log = logging.getLogger(__name__)


class WeightTransport(abc.ABC):
    """Moves one versioned update of HF-named tensors into every engine."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Set up whatever the transport needs (process groups, directories)."""

    @abc.abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        """Send a full update; engines serve ``weight_version`` afterwards.

        Returns metrics: ``sync/bytes`` (bytes), ``sync/seconds`` (s), ``sync/gbps``
        (GB/s), ``sync/pause_seconds`` (s engines were paused), ``sync/buckets``.
        """

    #: ``destination(hf_name, shape, dtype) -> Tensor | None``: where the exporter may write a
    #: tensor so that :meth:`send` sends it without a copy (the trainer's ``export_hf_weights(out=)``);
    #: None on a transport without a send buffer (the exporter allocates every tensor).
    #: :meth:`BroadcastTransport.destination` is one.
    destination: Callable[[str, Sequence[int], torch.dtype], torch.Tensor | None] | None = None

    def reform(self, clients: Sequence[WeightReceiver], ranks_per_engine: int | Sequence[int] | None = None) -> None:
        """Leave the current engines and connect to ``clients`` instead (the live engines and
        any restarted one, after a crash). Default: keep ``self.clients`` = ``clients`` and connect()."""
        self.close()
        self.clients = list(clients)
        self.connect()

    def close(self) -> None:  # noqa: B027 - optional
        """Release per-connection resources (a later connect() may follow)."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """close() and release everything (thread pools)."""
        self.close()


def _url(client: WeightReceiver) -> str:
    """An engine client's base URL (``?`` for a receiver without one)."""
    return str(getattr(client, "base_url", "?"))


def _drain(buckets: Iterable[object]) -> None:
    """Take the rest of a streamed export without sending it (its collectives run on every rank;
    ``abandon()`` first, if it has one); an exporter error is logged (the first one propagates)."""
    getattr(buckets, "abandon", lambda: None)()
    n = 0
    try:
        for _ in buckets:
            n += 1
    except Exception as e:  # noqa: BLE001
        log.warning("weight sync: draining the export after a failure stopped: %s", e)
    if n:
        log.warning("weight sync failed midway: the remaining %d bucket(s) of the export were drained unsent", n)


class BroadcastTransport(WeightTransport):
    """Bucketed broadcast from the trainer (group rank 0) into engines (ranks 1..N).

    Args:
        clients: synchronous engine clients (one per engine), each exposing
            ``init_weights_update_group``, ``update_weights_from_distributed``,
            ``pause_generation``, ``continue_generation``.
        cfg: bucket size, backend, timeout.
        pause_mode: SGLang ``pause_generation`` mode (``abort``, ``retract``, ``in_place``).
        ranks_per_engine: ranks each engine contributes to the group (its TP size, x DP
            when its replicas join): one int for all, or one per engine (offsets from
            every engine's own size, never a fixed one).
        master_address: address the trainer's TCPStore binds (loopback on CPU).
        group_name: SGLang's weight-update ``group_name``.
        world_size: a declared group world size, checked against 1 + the engines' ranks.

    Raises:
        WeightSyncError: an engine answered ``success: false`` or an HTTP error.
    """

    #: the engines' per-bucket update call (named in errors)
    update_call = "update_weights_from_distributed"

    def __init__(
        self,
        clients: Sequence[WeightReceiver], cfg: WeightSyncConfig, *,
        pause_mode: str = "abort",
        ranks_per_engine: int | Sequence[int] = 1,
        master_address: str = "127.0.0.1",
        group_name: str = "moe_async_weight_sync",
        world_size: int | None = None,
    ):
        self.clients = list(clients)
        self.cfg = cfg
        self.pause_mode = pause_mode
        self.master_address = master_address
        self.group_name = group_name
        self.backend = resolve_backend(cfg.backend)
        self._ranks_per_engine = ranks_per_engine
        self._world_size = world_size
        self.membership = GroupMembership(self.clients, engine_sizes=ranks_per_engine, group_name=group_name,
                                          backend=self.backend, master_address=master_address,
                                          timeout_s=cfg.timeout_s, world_size=world_size)
        self.group: torch.distributed.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        # one thread per engine posts its bucket metadata in order (the engine pairs the i-th
        # call with the i-th broadcast), without the sender waiting for each reply
        self._posters = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weight-sync-post{i}")
                         for i in range(len(self.clients))]
        self._warned: set[str] = set()
        self._sessionless: set[int] = set()  # engines without /begin_weight_update (404)
        self._flushes = DeferredFlushes()  # after in_place syncs
        self._pack_pool = PackPool(3)  # reused flat buffers: up to 3 x bucket_bytes
        #: the engines' common ``/weights_layout`` names (their buffer order), read at connect
        self.layout: list[str] | None = None
        self._slots: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {}  # name -> (offset, shape, dtype, bytes)
        self._send_nbytes = 0
        self._send_buf: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}  # name -> its view of _send_buf (made once)
        #: optional ``callback(bucket, is_last)`` after each bucket is broadcast (tests, logging)
        self.on_bucket = None

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def rank_offsets(self) -> list[int]:
        """Each engine's ``rank_offset`` in the group (from every engine's own size)."""
        return list(self.membership.offsets)

    @property
    def device(self) -> torch.device:
        """Where buckets and the send buffer live (:func:`~moe_async.weight_sync.group.transport_device`)."""
        return transport_device(self.backend)

    def connect(self) -> None:
        """Create the weight-update group with every engine (collective with them; SGLang's
        way, :mod:`~moe_async.weight_sync.membership`); an existing group is left first, so
        connect() also re-joins restarted engines. Several transports into the same engines:
        connect them with :func:`~moe_async.weight_sync.membership.form_in_order`'s order.

        Raises:
            WeightSyncError (GroupFormationError): naming the engine whose join failed, after
                every partial group was destroyed (a later connect() starts clean).
        """
        if self.group is not None:
            self.close()
        self.group = self.membership.form(self._pool)
        self._set_layout(self._common_layout())

    def _set_layout(self, layout: dict | None) -> None:
        self.layout = None if layout is None else list(layout["names"])
        slots, off = {}, 0
        if layout is not None:
            for n, s, d in zip(layout["names"], layout["shapes"], layout["dtypes"]):
                dt = str_to_dtype(d)
                nb = nbytes_of(s, dt)
                slots[n] = (off, tuple(s), dt, nb)
                off += nb
        # the send buffer is kept only for the same layout: an exporter may keep its tensors
        # in it (MegatronTrainer.relayout_params), so its bytes are never handed out under
        # other names; a new layout gets a new buffer (the old one lives on in the exporter)
        if slots != self._slots:
            self._send_buf = None
            self._views = {}
        self._slots = slots
        self._send_nbytes = off

    def destination(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Where an exporter may write tensor ``name`` so that it is sent without packing.

        A view of this transport's send buffer (on the backend's device: CUDA for NCCL, else
        CPU; reused by every sync), laid out in the engines' ``/weights_layout`` order, so a
        bucket of consecutive names is one span (:func:`contiguous_span`). None when the
        engines publish no layout (SGLang) or ``name``/``shape``/``dtype`` differ from it: the
        exporter then makes its own copy and the bucket is packed. Memory: one copy of the
        model, allocated on first use, never moved; the same tensor per name until the layout
        changes (callers must not resize it or change its ``.data``).
        Use: ``send(trainer.export_hf_weights(out=transport.destination), v)``.

        Only the exporter of this transport may write into these views: a 1-process
        ``MegatronTrainer`` moves its parameters into them (``relayout_params``) and then
        yields them without a copy (the buffer is its weights; it survives a re-connect with
        the same layout; a different layout gets a new buffer).
        """
        slot = self._slots.get(name)
        if slot is None or tuple(shape) != slot[1] or dtype != slot[2]:
            return None
        v = self._views.get(name)  # an exporter asks several times per sync (plan, order, copy)
        if v is not None:
            return v
        if self._send_buf is None:
            self._send_buf = self._new_send_buf(self._send_nbytes)
            self._views = {}
        off, shp, dt, nb = slot
        return self._views.setdefault(name, self._send_buf[off: off + nb].view(dt).view(shp))

    def _new_send_buf(self, nbytes: int) -> torch.Tensor:
        """:meth:`destination`'s buffer: ``nbytes`` of ``uint8`` on :attr:`device`."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _common_layout(self) -> dict | None:
        """The engines' send order when all publish the same one (embedded engines), else None
        (SGLang has no ``/weights_layout``: the exporter's order is kept)."""
        layouts = []
        for c in self.clients:
            try:
                layouts.append(c.weights_layout())
            except Exception as e:  # noqa: BLE001 - an optional extension: fall back to export order
                log.info("weights_layout unavailable (%s); sending in export order", e)
                return None
        if not layouts or layouts[0] is None or any(x != layouts[0] for x in layouts):
            return None
        return layouts[0]

    def _on_posters(self, call_engine: Callable[[WeightReceiver], object],
                    skip: Set[int] = frozenset()) -> list[tuple[int, Future]]:
        """Queue ``call_engine(client)`` on every engine's poster thread (but those in
        ``skip``), after what is already queued there (so it reaches each engine in order
        with the bucket calls); each future gives ``(reply, perf_counter() at the reply)``."""
        def call(c: WeightReceiver) -> tuple[object, float]:
            r = call_engine(c)
            return r, time.perf_counter()

        return [(i, self._posters[i].submit(call, c)) for i, c in enumerate(self.clients) if i not in skip]

    def _begin_on_posters(self) -> list[tuple[int, Future]]:
        """Queue ``/begin_weight_update {atomic: true}`` on every poster. A session left open
        (a sender that died mid-update) is closed first and opened again, logged. An engine
        without the endpoint (HTTP 404: SGLang before 0.5.23 has no sessions) is updated
        without one."""
        def begin(i: int, c: WeightReceiver) -> tuple[dict, float]:
            try:
                r = c.begin_weight_update(atomic=True)
            except Exception as e:  # noqa: BLE001 - an HTTP 400 of a session left open, or a 404
                if getattr(e, "status_code", None) == 404:
                    if i not in self._sessionless:
                        log.warning("engine %d has no /begin_weight_update (SGLang < 0.5.23?): updating it "
                                    "without a session", i)
                    self._sessionless.add(i)
                    return {"success": True}, time.perf_counter()
                if "already open" not in str(e):
                    raise
                r = {"success": False, "message": str(e)}
            if isinstance(r, dict) and r.get("success") is False and "already open" in str(r.get("message")):
                log.warning("weight sync: a weight-update session was left open on %s; closing it first",
                            c.base_url)
                c.end_weight_update()
                r = c.begin_weight_update(atomic=True)
            return r, time.perf_counter()

        return [(i, self._posters[i].submit(begin, i, c)) for i, c in enumerate(self.clients)]

    def _end_on_posters(self, skip: Set[int] = frozenset()) -> list[tuple[int, Future]]:
        """Queue ``/end_weight_update`` on every poster (but ``skip`` and sessionless engines)."""
        def end(c: WeightReceiver) -> tuple[dict, float]:
            return c.end_weight_update(), time.perf_counter()

        return [(i, self._posters[i].submit(end, c)) for i, c in enumerate(self.clients)
                if i not in skip and i not in self._sessionless]

    def _replies(self, futs: list[tuple[int, Future]], what: str) -> float:
        """Wait for ``futs`` of :meth:`_on_posters` (one ``timeout_s`` for all); raise on the
        first failure (naming the engine); return when the last reply arrived."""
        deadline = time.monotonic() + self.cfg.timeout_s
        last = 0.0
        for i, f in futs:
            r, t = self._reply(i, f, deadline, what)
            last = max(last, t)
        return last

    def _reply(self, i: int, fut: Future[tuple[object, float]], deadline: float, what: str) -> tuple[object, float]:
        """Engine ``i``'s reply to ``what`` from ``fut`` by ``deadline`` (``time.monotonic``).

        Raises:
            WeightSyncError: one line ``engine <i> at <url>: <what> failed: <Type>: <message>``
                for a refusal (``success: false``), an HTTP error, a connection error or no reply
                by the deadline; the original exception is its ``__cause__``.
        """
        try:
            r = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - named: which engine, which call
            why = f"no reply within {self.cfg.timeout_s:.0f} s" if isinstance(e, TimeoutError) and not str(e) \
                else f"{type(e).__name__}: {e}"
            raise WeightSyncError(one_line(f"engine {i} at {_url(self.clients[i])}: {what} failed: {why}")) from e
        self._check(i, r[0] if isinstance(r, tuple) else r, what, _url(self.clients[i]))
        return r

    @staticmethod
    def _check(i: int, resp: object, what: str, url: str | None = None) -> None:
        if isinstance(resp, dict) and resp.get("success") is False:
            at = f" at {url}" if url else ""
            raise WeightSyncError(one_line(f"engine {i}{at}: {what} failed: {resp.get('message')}"))

    def _connected(self) -> bool:
        return self.group is not None

    @property
    def flush_with_update(self) -> bool:
        """Whether the versioned call carries ``flush_cache: true`` (not under ``in_place``:
        SGLang refuses a flush while paused requests hold KV, failing the call)."""
        return self.pause_mode != "in_place"

    def _post_bucket(self, bucket: Bucket, flat: torch.Tensor | None,
                     weight_version: int | None) -> list[tuple[int, Future]]:
        """Queue one bucket's update call on every engine's poster (``weight_version`` on the
        last bucket only, as a string: SGLang's ``Optional[str]``); returns the futures."""
        last = weight_version is not None
        return [
            (i, self._posters[i].submit(
                c.update_weights_from_distributed,
                names=bucket.names,
                dtypes=bucket.dtypes,
                shapes=bucket.shapes,
                group_name=bucket.group_name or self.group_name,
                weight_version=str(weight_version) if last else None,
                flush_cache=last and self.flush_with_update,
                load_format="flattened_bucket",
            ))
            for i, c in enumerate(self.clients)
        ]

    def _transfer(self, flat: torch.Tensor, posted: list[tuple[int, Future]]) -> None:
        """Move one bucket's bytes while its calls are in flight: rank 0's broadcast."""
        assert self.group is not None, "connect() first"
        group_broadcast(self.group, flat, src=0)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | PackedExport,
             weight_version: int) -> dict[str, float]:
        """Send one full update (data path: ``docs/design/weight_sync.md``).

        Tensors are re-ordered to the engines' ``/weights_layout`` when they publish one
        (:func:`in_layout_order`). ``named_tensors`` may instead be a
        :class:`~moe_async.weight_sync.stream_export.PackedExport` (a multi-rank trainer's
        streamed export, bounded memory): opened with this transport's ``bucket_bytes``, device, the
        engines' layout as its order and ``overlap``, its buckets are sent as they come. Each bucket's metadata POST is queued on the engine's
        poster thread and the buffer broadcast at once; replies are read after the last
        bucket (the engine refuses every later bucket of an update once one failed, and
        then fails the versioned call: nothing is applied).

        Per-sync fixed costs are kept off the critical path where that is safe: with
        ``pause_scope: sync`` the pause requests go out on the poster threads while the
        first bucket is being exported (with ``overlap``), and every engine has answered
        its pause before any bucket's POST is sent (a failed pause sends none); the
        continue request is queued behind the versioned call, so each poster sends it as
        soon as its engine has applied the update. ``sync/pause_seconds`` (the stall) runs
        from the first pause request to the last continue reply (an upper bound of the
        time any engine was paused).

        A failure (an engine refused or died, a broadcast failed) while a streamed export is
        still running drains that export to its end before raising (nothing more is sent): the
        other trainer ranks finish their part of it instead of waiting in a collective.

        Raises:
            WeightSyncError: before connect(), or naming the engine that answered
                ``success: false`` (first failure).
        """
        if not self._connected():
            raise WeightSyncError(f"{type(self).__name__}.send before connect()")
        self._flushes.report()
        t0 = time.perf_counter()
        stats: dict[str, float] = {}
        streamed = isinstance(named_tensors, PackedExport)  # ready buckets (streamed export: world size > 1)
        if self.layout is not None and not isinstance(named_tensors, PackedExport):
            named_tensors = in_layout_order(named_tensors, self.layout)
        whole = self.cfg.pause_scope == "sync"
        pauses: list[tuple[int, Future]] = []
        resumes: list[tuple[int, Future]] = []
        paused_ok = False
        t_paused = t_resumed = t0
        nbytes, nbuckets, bcast_s, oversize, ack_s = 0, 0, 0.0, 0, 0.0
        first_s = hand_s = resume_s = 0.0
        pending: list[tuple[int, Future]] = []
        begins: list[tuple[int, Future]] = []
        ends: list[tuple[int, Future]] = []
        last_posted = False
        buckets: BucketStream | None = None
        exported = False  # every bucket taken from the exporter
        failed = False
        broadcasting = False
        try:
            if whole:  # in flight while the exporter makes the first bucket (below)
                t_paused = time.perf_counter()
                pauses = self._on_posters(lambda c: c.pause_generation(mode=self.pause_mode))
            begins = self._begin_on_posters()  # SGLang 0.5.23 refuses updates outside a session
            if isinstance(named_tensors, PackedExport):  # gathered tensor by tensor into the bucket that is sent
                buckets = named_tensors.open(self.cfg.bucket_bytes, device=self.device, order=self.layout,
                                             overlap=self.cfg.overlap, stats=stats)
            else:
                buckets = packed_buckets(named_tensors, self.cfg.bucket_bytes, overlap=self.cfg.overlap, stats=stats,
                                         pool=self._pack_pool, device=self.device)
            sessions_ok = False
            bucket: Bucket | None
            flat: torch.Tensor | None
            for bucket, flat, last in buckets:
                if last and not pauses:  # pause_scope=last_bucket: engines stage until here
                    t_paused = time.perf_counter()
                    pauses = self._on_posters(lambda c: c.pause_generation(mode=self.pause_mode))
                th = time.perf_counter()
                if nbuckets == 0:
                    first_s = th - t0
                if pauses and not paused_ok:  # every engine paused before this bucket's POST
                    self._replies(pauses, "pause_generation")
                    paused_ok = True
                if not sessions_ok:  # every session open before the first bucket's POST
                    self._replies(begins, "begin_weight_update")
                    sessions_ok = True
                hand_s += time.perf_counter() - th
                if bucket.nbytes > self.cfg.bucket_bytes:
                    oversize += 1
                    if bucket.names[0] not in self._warned:
                        self._warned.add(bucket.names[0])
                        log.warning("weight sync: %s (%d bytes) exceeds bucket_bytes=%d; sent alone in a "
                                    "grown bucket", bucket.names[0], bucket.nbytes, self.cfg.bucket_bytes)
                posted = self._post_bucket(bucket, flat, weight_version if last else None)
                pending += posted
                last_posted = last
                if last:  # each poster sends them right after its engine's versioned reply
                    ends = self._end_on_posters()
                    if pauses:
                        resumes = self._on_posters(lambda c: c.continue_generation())
                tb = time.perf_counter()
                if flat is not None:
                    broadcasting = True
                    self._transfer(flat, posted)
                    broadcasting = False
                # else another sender's bucket (its metadata posted here, its bytes broadcast by it)
                bcast_s += time.perf_counter() - tb
                nbytes += bucket.nbytes
                nbuckets += 1
                if self.on_bucket is not None:
                    self.on_bucket(bucket, last)
                bucket = flat = None  # a streamed export frees or reuses its buffer
            exported = True
            ta = time.perf_counter()
            deadline = time.monotonic() + self.cfg.timeout_s
            for i, f in pending:
                self._reply(i, f, deadline, self.update_call)
            self._replies(ends, "end_weight_update")
            ack_s = time.perf_counter() - ta
        except BaseException:
            failed = True
            if broadcasting:  # the group failed (a peer gone): abandoned before any reply is awaited, so an
                log.warning("weight sync: a broadcast failed; abandoning the update group (connect() again)")
                self.group = None  # engine waiting in that broadcast fails now (gloo), not at its timeout
                self.membership.abandon()
            if streamed and buckets is not None and not exported:
                _drain(buckets)  # the other ranks' gathers complete: no rank left in a collective
            deadline = time.monotonic() + self.cfg.timeout_s  # one bound for all replies
            for _, f in pending + ends:
                try:
                    f.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - the original error is what propagates
                    pass
            if begins and not ends:
                # abandoned before its last bucket (e.g. the exporter raised, an engine died):
                # closing the sessions makes the engines drop what they staged (embedded
                # engine's atomic session), so the next update starts clean
                for _, f in begins:  # each answered (or failed) before it is judged gone
                    try:
                        f.result(timeout=max(0.0, deadline - time.monotonic()))
                    except Exception:  # noqa: BLE001 - judged below
                        pass
                gone = {i for i, f in begins if f.done() and not f.cancelled() and f.exception() is not None}
                for i, f in self._end_on_posters(skip=gone):
                    try:
                        f.result(timeout=max(0.0, deadline - time.monotonic()))
                    except Exception as e:  # noqa: BLE001
                        log.warning("engine %d: end_weight_update after an abandoned update failed: %s", i, e)
            raise
        finally:
            if buckets is not None:
                buckets.close()
            if pauses:  # also after a failure: a paused engine must not stay paused
                if not resumes:  # (not to an engine whose pause request itself raised: gone)
                    gone = {i for i, f in pauses if f.done() and not f.cancelled() and f.exception() is not None}
                    resumes = self._on_posters(lambda c: c.continue_generation(), skip=gone)
                try:
                    tr = time.perf_counter()
                    t_resumed = self._replies(resumes, "continue_generation")
                    resume_s = time.perf_counter() - tr
                except Exception as e:  # noqa: BLE001
                    if not failed:
                        raise
                    log.warning("weight sync: continue_generation after a failed sync failed too: %s", e)
        if pauses and not self.flush_with_update:
            self._flushes.start(self.clients, weight_version, self.cfg.timeout_s)
        t1 = time.perf_counter()
        secs = t1 - t0
        return {
            "sync/bytes": float(nbytes),
            "sync/seconds": secs,
            "sync/gbps": nbytes / secs / 1e9 if secs > 0 else 0.0,
            "sync/pause_seconds": t_resumed - t_paused if pauses else 0.0,
            "sync/buckets": float(nbuckets),
            "sync/broadcast_seconds": bcast_s,
            "sync/ack_wait_seconds": ack_s,
            "sync/pack_seconds": stats["pack_seconds"],
            "sync/pack_wait_seconds": stats["wait_seconds"],
            "sync/oversize_buckets": float(oversize),
            "sync/weight_version": float(weight_version),
            "sync/first_bucket_seconds": first_s,
            "sync/handshake_wait_seconds": hand_s,
            "sync/resume_wait_seconds": resume_s,
            # a streamed export's phases (stream_export.run_plan): export_gather_seconds, ...
            **{f"sync/export_{k}": v for k, v in stats.items() if k not in ("pack_seconds", "wait_seconds")},
        }

    def reform(self, clients: Sequence[WeightReceiver], ranks_per_engine: int | Sequence[int] | None = None) -> None:
        """Re-form the update group with ``clients`` (after an engine crash): every current member leaves first
        (the engines' ``/destroy_weights_update_group``, then this side's group: a dead
        engine's refusal is logged), then a new group is formed with ``clients`` (same group
        name, a new store port) and their layout read again; the send buffer is kept when the
        layout is the same. ``ranks_per_engine``: one int, or one per client (default: the
        constructor's when it was one int).

        Raises:
            ValueError: per-engine sizes needed (the constructor had a list) but not given.
            GroupFormationError: as :meth:`connect` (every partial group destroyed).
        """
        sizes = ranks_per_engine if ranks_per_engine is not None else self._ranks_per_engine
        if not isinstance(sizes, int) and len(list(sizes)) != len(clients):
            raise ValueError(f"reform: ranks_per_engine has {len(list(sizes))} entries for {len(clients)} engines")
        if self.group is not None:
            self.close()
        for p in self._posters:
            p.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.clients = list(clients)
        self.membership = GroupMembership(self.clients, engine_sizes=sizes, group_name=self.group_name,
                                          backend=self.backend, master_address=self.master_address,
                                          timeout_s=self.cfg.timeout_s, world_size=None)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        self._posters = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weight-sync-post{i}")
                         for i in range(len(self.clients))]
        self._sessionless = set()
        self.connect()

    def close(self) -> None:
        """Leave the weight-update group on every engine (``/destroy_weights_update_group``)
        so a later :meth:`connect` (this transport or a new one) can re-create it."""
        self.membership.leave()
        self.group = None

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self._posters:
            p.shutdown(wait=False, cancel_futures=True)


def check_engines(clients: Sequence[WeightReceiver], trainer_checksums: dict[str, str], weight_version: int) -> dict[str, float]:
    """Check mode: every engine serves ``weight_version`` and its per-tensor checksums equal
    the trainer's, bit for bit.

    Returns ``sync/check_seconds`` and ``sync/check_tensors``.
    Raises: WeightSyncError naming the engine, the version and the first differing tensors.
    """
    t0 = time.perf_counter()
    for i, c in enumerate(clients):
        theirs = c.weights_checksum()
        if int(theirs["weight_version"]) != int(weight_version):
            raise WeightSyncError(f"engine {i} serves version {theirs['weight_version']}, trainer is at {weight_version}")
        sums = theirs["checksums"]
        bad = sorted(k for k in set(trainer_checksums) | set(sums) if trainer_checksums.get(k) != sums.get(k))
        if bad:
            raise WeightSyncError(f"engine {i} weights differ from the trainer's at version {weight_version}: "
                                  f"{bad[:5]} ({len(bad)} of {len(trainer_checksums)} tensors)")
    return {"sync/check_seconds": time.perf_counter() - t0, "sync/check_tensors": float(len(trainer_checksums))}
