"""``pause_mode: in_place`` against SGLang 0.5.23's own scheduler code (``_sglang_scheduler``).

SGLang refuses a cache flush while a request paused in place still holds KV, and an update
call with ``flush_cache: true`` then fails after applying its weights. The transport's
in_place sequence (no flush with the calls; SGLang's deferred flush after the continue) must
pass two syncs with requests in flight, record the version of every token, and leave no
prefix-cache KV of older weights for requests admitted once the engine went idle; the
previous sequence (``flush_cache: true`` on the versioned call) fails the first sync.
"""

from __future__ import annotations

import time

import pytest
import torch

from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.group import WeightSyncError
from moe_async.weight_sync.transport import BroadcastTransport

NAMES = [f"model.layers.{i}.mlp.weight" for i in range(6)]


@pytest.fixture(scope="module")
def sg():
    from _sglang_scheduler import load_sglang

    try:
        return load_sglang()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture
def shell(sg, monkeypatch):
    from _sglang_scheduler import SGLangShell

    # SGLang's begin/end barrier on the engine's TP group: one rank here
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    sh = SGLangShell(sg)
    yield sh
    sh.close()


def _transport(shell) -> BroadcastTransport:
    cfg = WeightSyncConfig(bucket_bytes=2048, backend="gloo", timeout_s=30)
    tr = BroadcastTransport([shell], cfg, pause_mode="in_place", group_name="in_place_test")
    tr.connect()
    return tr


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(16, 16, generator=g)) for n in NAMES]  # 1 KiB each: 3 buckets


def _wait_tokens(reqs, n: int) -> None:
    end = time.monotonic() + 30
    while min(len(r.out_versions) for r in reqs) < n and time.monotonic() < end:
        time.sleep(0.01)


def test_in_place_syncs_with_requests_in_flight(shell):
    tr = _transport(shell)
    try:
        reqs = [shell.submit([7, 8, 9 + i], max_new=400) for i in range(3)]
        _wait_tokens(reqs, 5)
        m1 = tr.send(_weights(1), 1)
        _wait_tokens(reqs, len(reqs[0].out_versions) + 5)
        m2 = tr.send(_weights(2), 2)
        assert m1["sync/buckets"] == m2["sync/buckets"] == 3
        assert shell.versions_seen == ["1", "2"] and shell.version == "2"
        assert all(shell.received[n] == 2 for n in NAMES)
        assert not any(r.done.is_set() for r in reqs)  # both syncs ran with the requests in flight
        for r in reqs:
            r.done.wait(30)
            v = r.out_versions
            a, b = v.index("1"), v.index("2")  # each token tagged with the weights that made it
            assert 0 < a < b < len(v) and v == ["0"] * a + ["1"] * (b - a) + ["2"] * (len(v) - b)
        # SGLang's deferred flush ran once the paused requests had finished ...
        end = time.monotonic() + 30
        while shell.flushes < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert shell.flushes >= 1 and not shell.tree_cache.kv
        assert tr._flushes.report() == []
        # ... so a request admitted now recomputes its prefix under the new weights
        again = shell.submit([7, 8, 9], max_new=3)
        again.done.wait(30)
        assert again.reused == [] and again.kv_versions == ["2"] * 3 and again.out_versions == ["2"] * 3
    finally:
        tr.shutdown()


def test_flush_with_the_versioned_call_fails_under_in_place(shell, monkeypatch):
    """The previous sequence: ``flush_cache: true`` on the last bucket. SGLang applies the
    update, then refuses the flush (paused requests hold KV) and fails the call."""
    monkeypatch.setattr(BroadcastTransport, "flush_with_update", property(lambda self: True))
    tr = _transport(shell)
    try:
        r = shell.submit([1, 2, 3], max_new=400)
        _wait_tokens([r], 3)
        with pytest.raises(WeightSyncError, match="Weights were updated, but the cache was not flushed"):
            tr.send(_weights(1), 1)
        assert shell.version == "1"  # applied all the same, as SGLang does
    finally:
        tr.shutdown()
