"""Packing pipeline (overlap on and off), config, check mode and transport choice, no engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.transport import (
    BroadcastTransport, DiskTransport, PackPool, WeightSyncError, check_engines, make_transport, packed_buckets,
)


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
