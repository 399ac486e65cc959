"""Packing pipeline (overlap on and off), config, check mode and transport choice, no engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import WeightSyncError
from moe_async.weight_sync.packing import PackPool, packed_buckets
from moe_async.weight_sync.disk_transport import DiskTransport
from moe_async.weight_sync.factory import make_transport
from moe_async.weight_sync.transport import BroadcastTransport, check_engines


def _named(n=7):
    g = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(i + 3, 5, generator=g)) for i in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("limit", [1, 200, 400, 10**9])
def test_packed_buckets_order_last_and_bytes(overlap, limit):
    """A flat is valid until the next one is asked for (buffers are reused): copy as we go."""
    named = _named()
    stats: dict = {}
    pool = PackPool(3)
    got = []
    for _ in range(2):  # the pool is reused across syncs
        got = [(b, f.clone(), last) for b, f, last in packed_buckets(iter(named), limit, overlap=overlap,
                                                                      stats=stats, pool=pool)]
    if limit == 400:
        assert sum(len(b.names) > 1 for b, _, _ in got) >= 2  # several reused multi-tensor buffers
    assert [n for b, _, _ in got for n in b.names] == [n for n, _ in named]
    assert [last for _, _, last in got] == [False] * (len(got) - 1) + [True]
    flat = torch.cat([f for _, f, _ in got])
    assert torch.equal(flat, torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named]))
    assert stats["pack_seconds"] >= 0 and stats["wait_seconds"] >= 0


def test_packing_runs_ahead_of_the_consumer():
    """With overlap the producer packs bucket k+1 while the consumer holds bucket k."""
    pulled = []

    def slow():
        for i, (n, t) in enumerate(_named(4)):
            pulled.append(i)
            yield n, t

    it = packed_buckets(slow(), 1, overlap=True)
    next(it)
    time.sleep(0.3)
    assert len(pulled) >= 3  # bucket 0 consumed; 1 (lookahead) and 2 packed meanwhile
    it.close()


def test_producer_error_reraises_and_thread_ends():
    def bad():
        yield "a", torch.zeros(2)
        raise KeyError("no HF name for x")

    n0 = threading.active_count()
    with pytest.raises(KeyError, match="no HF name"):
        list(packed_buckets(bad(), 1, overlap=True))
    time.sleep(0.2)
    assert threading.active_count() <= n0


def test_config_transport_choice_and_small_bucket_warning():
    with pytest.warns(UserWarning, match="bucket_bytes=1024"):
        WeightSyncConfig(bucket_bytes=1024)
    assert isinstance(make_transport([], WeightSyncConfig()), BroadcastTransport)
    assert isinstance(make_transport([], WeightSyncConfig(transport="disk")), DiskTransport)
    with pytest.raises(ValueError):
        WeightSyncConfig(transport="nfs")


class _Fake:
    def __init__(self, version, sums):
        self.r = {"weight_version": version, "checksums": sums}

    def weights_checksum(self):
        return self.r


def test_check_engines_fails_loudly():
    sums = {"a": "1", "b": "2"}
    assert check_engines([_Fake(3, dict(sums))], sums, 3)["sync/check_tensors"] == 2
    with pytest.raises(WeightSyncError, match="serves version 2"):
        check_engines([_Fake(2, dict(sums))], sums, 3)
    with pytest.raises(WeightSyncError, match=r"engine 1 .*\['b'\]"):
        check_engines([_Fake(3, dict(sums)), _Fake(3, {"a": "1", "b": "x"})], sums, 3)


def test_contiguous_span_and_zero_copy_pack():
    from moe_async.weight_sync.bucket import make_buckets
    from moe_async.weight_sync.packing import contiguous_span

    buf = torch.arange(40, dtype=torch.float32)
    a, b, c = buf[2:10].view(2, 4), buf[10:16], buf[17:20]
    span = contiguous_span([a, b])
    assert span is not None and span.data_ptr() == a.data_ptr()
    assert torch.equal(span, buf[2:16].view(torch.uint8))
    assert contiguous_span([a, c]) is None  # a gap
    assert contiguous_span([b, a]) is None  # out of order
    assert contiguous_span([buf[0:8].view(2, 4).t(), buf[8:9]]) is None  # not contiguous
    bucket = next(make_buckets([("a", a), ("b", b)], 10**6))
    flat = PackPool(1).pack(0, bucket)
    assert flat.data_ptr() == a.data_ptr() and torch.equal(flat, bucket.flatten())


def test_in_layout_order():
    from moe_async.weight_sync.packing import in_layout_order

    pulled = []

    def src(names):
        for n in names:
            pulled.append(n)
            yield n, torch.tensor([ord(n[0])])

    order = list("abcde")
    it = in_layout_order(src("baxdce"), order)
    assert next(it)[0] == "a" and pulled == ["b", "a"]  # yielded as soon as its turn comes
    assert [n for n, _ in it] == ["b", "c", "d", "e", "x"]  # unknown names last
    # a name missing from the stream does not hold the rest forever; repeats follow last
    assert [n for n, _ in in_layout_order(src("ecab" + "a"), order)] == ["a", "b", "c", "e", "a"]


def test_destination_views_follow_the_engine_layout():
    tr = BroadcastTransport([], WeightSyncConfig(bucket_bytes=2**20))
    assert tr.destination("w", (2, 3), torch.float32) is None  # no layout: exporter clones
    tr._set_layout({"names": ["b", "a", "c"], "shapes": [[2, 3], [4], [1, 1]],
                    "dtypes": ["float32", "float32", "bfloat16"]})
    assert tr.layout == ["b", "a", "c"]
    b = tr.destination("b", (2, 3), torch.float32)
    a = tr.destination("a", (4,), torch.float32)
    c = tr.destination("c", (1, 1), torch.bfloat16)
    assert a.data_ptr() == b.data_ptr() + 24 and c.data_ptr() == a.data_ptr() + 16
    assert tr.destination("a", (4,), torch.float32) is a  # made once per layout
    assert tr.destination("a", (5,), torch.float32) is None  # other shape
    assert tr.destination("a", (4,), torch.float16) is None  # other dtype
    assert tr.destination("z", (4,), torch.float32) is None  # not the engine's
    b.copy_(torch.ones(2, 3))
    a.copy_(torch.arange(4.0))
    got = list(packed_buckets(iter([("a", a), ("b", b)]), 10**6, overlap=False))  # unordered: packed
    assert got[0][1].data_ptr() != b.data_ptr()
    from moe_async.weight_sync.packing import in_layout_order

    got = list(packed_buckets(in_layout_order(iter([("a", a), ("b", b)]), tr.layout), 10**6, overlap=False))
    assert got[0][0].names == ["b", "a"] and got[0][1].data_ptr() == b.data_ptr()  # sent in place
    assert torch.equal(got[0][1], torch.cat([torch.ones(6), torch.arange(4.0)]).view(torch.uint8))


class _Engine:
    """A fake engine client: records every call (in the order the engine would see them) and
    answers success; ``pause_gate`` (an Event) makes /pause_generation wait for it."""

    def __init__(self, log: list, i: int, pause_gate: threading.Event | None = None, fail_pause: bool = False,
                 gone: bool = False):
        self.log, self.i, self.gate, self.fail_pause, self.gone = log, i, pause_gate, fail_pause, gone

    def pause_generation(self, mode):
        if self.gate is not None:
            assert self.gate.wait(10), "the exporter did not run while the pause was in flight"
        if self.gone:
            raise ConnectionError(f"engine {self.i} is gone")
        self.log.append((self.i, "pause"))
        if self.fail_pause:
            return {"success": False, "message": "cannot pause"}
        return {"status": "ok"}

    def continue_generation(self):
        self.log.append((self.i, "continue"))
        return {"status": "ok"}

    def begin_weight_update(self, atomic=False):
        if self.gone:
            raise ConnectionError(f"engine {self.i} is gone")
        self.log.append((self.i, "begin", atomic))
        return {"success": True}

    def end_weight_update(self):
        self.log.append((self.i, "end"))
        return {"success": True}

    def update_weights_from_distributed(self, names, weight_version=None, **kw):
        self.log.append((self.i, "update", tuple(names), weight_version))
        return {"success": True}


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
@pytest.mark.parametrize("scope", ["sync", "last_bucket"])
def test_send_pauses_while_exporting_and_resumes_after_the_versioned_call(monkeypatch, scope):
    """pause_scope=sync: the pause requests are in flight while the exporter makes the first
    bucket (the fake engines answer the pause only once the exporter has run), every engine
    has answered its pause before any bucket is posted or broadcast, each engine sees
    pause -> begin (atomic session) -> buckets in order -> the versioned bucket -> end ->
    continue, and the stall covers all of it."""
    import moe_async.weight_sync.transport as T

    log: list = []
    exporting = threading.Event()
    engines = [_Engine(log, i, exporting if scope == "sync" else None) for i in range(2)]
    sent = []

    def bcast(group, flat, src=0):  # the broadcast: every engine must already have answered its pause
        paused = {e for e, *what in log if what[0] == "pause"}
        assert paused == ({0, 1} if scope == "sync" or len(sent) == 2 else set()), (len(sent), log)
        sent.append(flat.clone())

    monkeypatch.setattr(T, "group_broadcast", bcast)

    def exporter():
        exporting.set()
        yield from _named(3)

    tr = BroadcastTransport(engines, WeightSyncConfig(bucket_bytes=1, pause_scope=scope))
    tr.group = object()  # connected (the broadcast is faked above)
    m = tr.send(exporter(), 7)
    tr.shutdown()
    names = [n for n, _ in _named(3)]
    for e in range(2):
        seen = [x[1:] for x in log if x[0] == e]
        ups = [("update", (n,), "7" if k == 2 else None) for k, n in enumerate(names)]
        begin = [("begin", True)]
        assert seen == ([("pause",)] + begin + ups if scope == "sync" else begin + ups[:2] + [("pause",), ups[2]]) \
            + [("end",), ("continue",)]
    assert len(sent) == 3 and m["sync/buckets"] == 3
    assert 0 < m["sync/pause_seconds"] <= m["sync/seconds"]


def _send_after_failed_pause(monkeypatch, exc, match, **engine1) -> list:
    """One send to engine 0 (healthy) and engine 1 (``_Engine(**engine1)``, its pause fails):
    raises ``exc`` matching ``match``, no bucket is broadcast; returns the engines' call log."""
    import moe_async.weight_sync.transport as T

    log: list = []
    engines = [_Engine(log, 0), _Engine(log, 1, **engine1)]
    monkeypatch.setattr(T, "group_broadcast", lambda *a, **k: pytest.fail("broadcast after a failed pause"))
    tr = BroadcastTransport(engines, WeightSyncConfig(bucket_bytes=1))
    tr.group = object()
    with pytest.raises(exc, match=match):
        tr.send(iter(_named(3)), 1)
    tr.shutdown()
    return log


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
def test_send_refused_pause_posts_no_bucket_and_resumes(monkeypatch):
    """An engine that refuses the pause: no bucket is posted to any engine or broadcast, every
    engine's session (opened behind the pause) is closed, every engine gets its continue, and
    the error names the engine."""
    log = _send_after_failed_pause(monkeypatch, WeightSyncError, "engine 1 at .*: pause_generation failed: cannot pause",
                                   fail_pause=True)
    for e in (0, 1):
        assert [x[1:] for x in log if x[0] == e] == [("pause",), ("begin", True), ("end",), ("continue",)]


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
def test_send_pause_to_a_gone_engine_raises_its_error(monkeypatch):
    """An engine whose pause request raises (gone): its error propagates, named by engine and
    call (not masked by the continue), the others are resumed (their session closed), the gone
    one gets no further call."""
    log = _send_after_failed_pause(monkeypatch, WeightSyncError,
                                   "^engine 1 at .*: pause_generation failed: ConnectionError: engine 1 is gone$",
                                   gone=True)
    assert log == [(0, "pause"), (0, "begin", True), (0, "end"), (0, "continue")]


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
def test_engine_without_sessions_is_updated_without_one(monkeypatch):
    """An engine answering 404 to /begin_weight_update (SGLang before 0.5.23) gets the update
    without a session (no end call); the other engine gets its session as usual."""
    import moe_async.weight_sync.transport as T
    from moe_async.engines.client import EngineRequestError

    log: list = []

    class _Old(_Engine):
        def begin_weight_update(self, atomic=False):
            raise EngineRequestError("/begin_weight_update", 404, "Not Found")

    engines = [_Engine(log, 0), _Old(log, 1)]
    monkeypatch.setattr(T, "group_broadcast", lambda *a, **k: None)
    tr = BroadcastTransport(engines, WeightSyncConfig(bucket_bytes=1))
    tr.group = object()
    for v in (1, 2):
        tr.send(iter(_named(2)), v)
    tr.shutdown()
    assert [x[1] for x in log if x[0] == 1] == ["pause", "update", "update", "continue"] * 2
    assert [x[1] for x in log if x[0] == 0] == ["pause", "begin", "update", "update", "end", "continue"] * 2


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
@pytest.mark.parametrize("overlap", [False, True])
def test_send_streams_a_packed_export_in_the_engines_layout(monkeypatch, overlap):
    """A PackedExport (the multi-rank trainer's streamed export, C14) is opened with the
    transport's bucket size, device, overlap and the engines' layout as its order; its flat
    buffers are broadcast as they are (no re-packing), the last bucket carries the version."""
    import moe_async.weight_sync.transport as T
    from moe_async.weight_sync.stream_export import PackedExport, streamed_buckets

    class P:
        def __init__(self, name, data):
            self.name, self.data, self.full_shape, self.offset = name, data, tuple(data.shape), (0,) * data.dim()

    src = {n: torch.full((4,), float(k)) for k, n in enumerate("abc")}  # 16 bytes each
    opened, sent = {}, []

    def open_(bucket_bytes, **kw):
        opened.update(bucket_bytes=bucket_bytes, **kw)
        return streamed_buckets([P(n, t) for n, t in src.items()], lambda n, t: [(n, t)], bucket_bytes,
                                direct=lambda n: True, **kw)

    monkeypatch.setattr(T, "group_broadcast", lambda group, flat, src=0: sent.append(bytes(flat.numpy())))
    log: list = []
    tr = BroadcastTransport([_Engine(log, 0)], WeightSyncConfig(bucket_bytes=32, overlap=overlap))
    tr.group, tr.layout = object(), ["c", "a", "b"]
    m = tr.send(PackedExport(open_), 3)
    tr.shutdown()
    assert opened["bucket_bytes"] == 32 and opened["order"] == ["c", "a", "b"] and opened["overlap"] is overlap
    if overlap:  # the pipeline's fill: budgets ramp from 32 / RAMP (4, 8, 16 B): one tensor each
        assert [x[2:] for x in log if x[1] == "update"] == [(("c",), None), (("a",), None), (("b",), "3")]
        assert sent == [bytes(src[n].view(torch.uint8).numpy()) for n in "cab"]
    else:
        assert [x[2:] for x in log if x[1] == "update"] == [(("c", "a"), None), (("b",), "3")]
        assert sent == [bytes(torch.cat([src["c"], src["a"]]).view(torch.uint8).numpy()),
                        bytes(src["b"].view(torch.uint8).numpy())]
    assert m["sync/bytes"] == 48 and m["sync/buckets"] == (3 if overlap else 2)
