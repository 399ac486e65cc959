"""A weight sync that loses an engine (issue 19, "Sync failure"), without engines or Ray:
``send_or_lost`` names the engines whose /health fails instead of raising (and raises when
every engine still answers); a streamed export (world size > 1) is drained to its end by the
sender after a broadcast failure, so the other ranks' gathers complete; the test-only stall
hook's value and claim."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moe_async.engines.embedded import fault_hooks
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.outcome import SyncOutcome, send_or_lost
from moe_async.weight_sync.transport import BroadcastTransport
from tests.weight_sync.test_transport_unit import _Engine


class _Client:
    def __init__(self, url: str, alive: bool):
        self.base_url, self.alive = url, alive

    def health(self, timeout: float = 5.0) -> bool:
        return self.alive


class _Transport:
    def __init__(self, alive: list[bool], fail: bool):
        self.clients = [_Client(f"http://e{i}", a) for i, a in enumerate(alive)]
        self.fail = fail

    def send(self, named, version):
        if self.fail:
            raise ConnectionError("Connection closed by peer")
        return {"sync/bytes": 8.0, "sync/weight_version": float(version)}


def test_send_or_lost_names_the_dead_engines_and_raises_when_none_died():
    ok = send_or_lost(_Transport([True, True], fail=False), [], 4)
    assert ok == SyncOutcome({"sync/bytes": 8.0, "sync/weight_version": 4.0}) and ok.ok
    out = send_or_lost(_Transport([True, False], fail=True), [], 4)
    assert not out.ok and out.lost == ["http://e1"]
    assert out.error == "ConnectionError: Connection closed by peer"
    assert out.metrics == {"sync/engines_lost": 1.0, "sync/weight_version": 4.0}
    with pytest.raises(ConnectionError, match="closed by peer"):  # every engine answers: the sync's own error
        send_or_lost(_Transport([True, True], fail=True), [], 4)


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
@pytest.mark.parametrize("overlap", [False, True])
def test_a_broadcast_failure_drains_the_streamed_export_to_its_end(monkeypatch, overlap):
    """4 buckets; the broadcast of the 2nd fails (an engine gone): the send raises, only the
    first bucket went out, and every bucket was still taken from the export (its collectives
    ran on every rank); the group is left (a broken group is not reused)."""
    import moe_async.weight_sync.transport as T
    from moe_async.weight_sync.stream_export import PackedExport, streamed_buckets

    class P:
        def __init__(self, name, data):
            self.name, self.data, self.full_shape, self.offset = name, data, tuple(data.shape), (0,) * data.dim()

    src = {n: torch.full((4,), float(k)) for k, n in enumerate("abcd")}  # 16 bytes each: one bucket each
    taken, sent = [], []

    def open_(bucket_bytes, **kw):
        for item in streamed_buckets([P(n, t) for n, t in src.items()], lambda n, t: [(n, t)], bucket_bytes,
                                     direct=lambda n: True, **kw):
            taken.append(item[0].names[0])
            yield item

    def bcast(group, flat, src=0):
        if len(sent) == 1:
            raise RuntimeError("Connection closed by peer")
        sent.append(bytes(flat.numpy()))

    monkeypatch.setattr(T, "group_broadcast", bcast)
    log: list = []
    tr = BroadcastTransport([_Engine(log, 0)], WeightSyncConfig(bucket_bytes=16, overlap=overlap))
    tr.group, tr.layout = object(), list("abcd")
    monkeypatch.setattr(tr, "close", lambda: setattr(tr, "group", None))
    with pytest.raises(RuntimeError, match="closed by peer"):
        tr.send(PackedExport(open_), 3)
    tr.shutdown()
    assert taken == list("abcd") and len(sent) == 1 and tr.group is None
    assert [x[2] for x in log if x[1] == "update"] == [("a",), ("b",)]  # nothing posted after the failure


def test_stall_hook_value_and_one_claim_per_run(tmp_path, monkeypatch):
    assert fault_hooks.parse_stall(None) is None
    assert fault_hooks.parse_stall("2:3:/tmp/x:y") == (2, 3, "/tmp/x:y")
    for bad in ("2:0:/d", "2:/d", "a:1:/d", "2:1:"):
        with pytest.raises(ValueError, match="MOE_ASYNC_ENGINE_SYNC_STALL"):
            fault_hooks.parse_stall(bad)
    monkeypatch.setattr(fault_hooks, "STALL_MAX_S", 0.0)
    d = tmp_path / "stall"
    a, b = fault_hooks.SyncStall(f"2:2:{d}"), fault_hooks.SyncStall(f"2:2:{d}")
    run = asyncio.run
    assert [run(a.maybe_stall(v)) for v in (1, 2, 1)] == [False, False, False]  # version 2's 1st call
    assert run(a.maybe_stall(2)) is True  # version 2's 2nd call: this engine claims the stall
    assert (d / "stalled").read_text().strip().isdigit()
    assert [run(b.maybe_stall(2)) for _ in range(2)] == [False, False]  # already claimed by another
    assert run(fault_hooks.SyncStall("").maybe_stall(2)) is False
