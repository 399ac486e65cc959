"""Our sender against SGLang 0.5.23's own receiver code (``_sglang_engine.py``: SGLang's
``WeightUpdater`` in one process per engine rank, its ``init_custom_process_group``, its
``FlattenedTensorBucket``), over gloo on a CPU.

* C15: the group forms within seconds (a group made with other store keys than SGLang's
  waits until its timeout here), weights arrive bit-identical, and the update session SGLang
  requires is opened and closed by the transport.
* C13: engines of TP1 and TP2 in one group: world 4, offsets 1 and 2, the TP2 engine's ranks
  2 and 3 (each engine's size its own); a declared world that differs fails at once.
* C12: two senders (PP stages) into the same two engines, each engine serving one join at a
  time: joins in opposite orders at the two engines do not both form; in one fixed order
  they do; a join that never returns makes connect raise within its timeout, the partial
  group destroyed, and the next connect succeeds.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def _load_sglang():
    import _sglang_import

    _sglang_import.load_io_struct()  # an ImportError fails the test, as in the contract tests


@pytest.fixture(scope="module")
def engines():
    """Two SGLang-code engines: TP1 and TP2 (3 rank processes)."""
    _load_sglang()
    from _sglang_engine import SGLangEngine

    es = [SGLangEngine(tp=1), SGLangEngine(tp=2)]
    try:
        for e in es:
            e.wait_ready()
        yield es
    finally:
        for e in es:
            e.close()


def _cfg(timeout_s=60.0):
    from moe_async.weight_sync.config import WeightSyncConfig

    return WeightSyncConfig(backend="gloo", bucket_bytes=4096, timeout_s=timeout_s)


def _tensors(seed: int, prefix: str = "w") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"{prefix}.{i}": torch.randn(8 * (i + 1), 16, generator=g) for i in range(6)}
    out[f"{prefix}.big"] = torch.randn(64, 64, generator=g)  # 16 KiB: over the 4 KiB bucket, alone
    out[f"{prefix}.bf16"] = torch.randn(33, generator=g).to(torch.bfloat16)
    return out


def _sums(ts):
    from moe_async.models.checksum import tensor_checksum

    return {n: tensor_checksum(t) for n, t in ts.items()}


def test_group_forms_with_sglang_receivers_tp1_tp2(engines):
    """C15 + C13: our transport into SGLang's receiver code, engines of TP1 and TP2."""
    from moe_async.weight_sync.transport import BroadcastTransport

    for e in engines:
        e.joins.clear()
        e.calls.clear()
    tr = BroadcastTransport(engines, _cfg(timeout_s=30), ranks_per_engine=[1, 2], group_name="c15")
    assert tr.world_size == 4 and tr.rank_offsets == [1, 2]
    t0 = time.monotonic()
    tr.connect()
    formed_s = time.monotonic() - t0
    try:
        assert formed_s < 15, formed_s  # seconds, not the 30 s timeout of mismatched store keys
        assert [(j["rank"], j["world"]) for j in engines[0].joins] == [(1, 4)]
        assert sorted((j["rank"], j["world"]) for j in engines[1].joins) == [(2, 4), (3, 4)]
        ts = _tensors(1)
        m = tr.send(ts.items(), 3)
        assert m["sync/buckets"] >= 4
        for e in engines:
            assert e.checksums == _sums(ts)  # bit-identical on every rank of every engine
            assert e.version == "3"  # SGLang's string version, on the last bucket
            assert e.calls[1] == "begin" and e.calls[-1] == "end"  # the session SGLang requires
            assert all(c.startswith("update:") for c in e.calls[2:-1])
            assert [c.split(":")[2] for c in e.calls[2:-1]] == ["None"] * (len(e.calls) - 4) + ["3"]
    finally:
        tr.shutdown()


def test_declared_world_that_differs_fails_at_once(engines):
    """C13: a declared world of 5 for 1 sender + 3 engine ranks fails before anyone joins."""
    from moe_async.weight_sync.transport import BroadcastTransport

    with pytest.raises(ValueError, match=r"world_size=5 .*1 sender.*3 engine.* = 4"):
        BroadcastTransport(engines, _cfg(), ranks_per_engine=[1, 2], world_size=5)


def _delay_opposite(engines, delay_s: float, late_join_timeout_s: float | None = None) -> None:
    """Engine 0 gets stage 0's join first, engine 1 stage 1's (C12's arrival orders); a
    delayed join's ranks give up after ``late_join_timeout_s`` (None: the engines' default)."""
    def later(name_late):
        def hook(g):
            if g == name_late:
                time.sleep(delay_s)
                return late_join_timeout_s
            return None
        return hook

    engines[0].before_join = later("pp1")
    engines[1].before_join = later("pp0")


def test_pp_senders_fixed_order_vs_opposite_joins(engines):
    """C12: concurrent groups whose joins reach the engines in opposite orders do not both
    form (each engine serves one join at a time); connect raises within its timeout; the
    groups formed one after another in a fixed order all form, and both stages' weights
    arrive bit-identical."""
    from moe_async.weight_sync.membership import GroupFormationError, form_in_order
    from moe_async.weight_sync.transport import BroadcastTransport

    timeout = 6.0
    trs = [BroadcastTransport(engines, _cfg(timeout_s=timeout), ranks_per_engine=[1, 2], group_name=f"pp{k}")
           for k in range(2)]
    try:
        # the late joins reach the engines after their senders gave up: their ranks' connects
        # to the closed stores are retried until the join timeout, 3 s here (not the 20 s default)
        _delay_opposite(engines, 1.0, late_join_timeout_s=3.0)
        errs: dict[int, BaseException] = {}
        took: dict[int, float] = {}

        def naive(k):
            t0 = time.monotonic()
            try:
                trs[k].connect()
            except BaseException as e:  # noqa: BLE001
                errs[k] = e
            took[k] = time.monotonic() - t0

        ths = [threading.Thread(target=naive, args=(k,)) for k in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert errs, "opposite join orders formed both groups: the engines did not serialize joins"
        for k, e in errs.items():
            assert isinstance(e, GroupFormationError) and "every partial group was destroyed" in str(e)
            assert took[k] < timeout + 10, took
        # the fixed order: pp0 wholly formed before pp1's joins go out (delays still on, the
        # default join timeout: these joins must form)
        _delay_opposite(engines, 1.0)
        for t in trs:
            t.close()
        for e in engines:  # joins that reached an engine after their sender gave up end first
            e.wait_idle()
        t0 = time.monotonic()
        form_in_order([t.membership for t in trs])
        for t in trs:
            t.group = t.membership.group
        assert time.monotonic() - t0 < 2 * timeout
        stage = [_tensors(10, "stage0"), _tensors(11, "stage1")]
        for e in engines:
            e.checksums.clear()
        trs[0].send(stage[0].items(), 5)
        trs[1].send(stage[1].items(), 5)
        for e in engines:
            assert e.checksums == {**_sums(stage[0]), **_sums(stage[1])}
    finally:
        for e in engines:
            e.before_join = None
        for t in trs:
            t.shutdown()


def test_join_that_never_returns(engines):
    """C12: engine 1's join hangs: connect raises within its timeout naming it, engine 0's
    partial join is ended (the sender's store is gone), and the next connect succeeds."""
    from moe_async.weight_sync.membership import GroupFormationError
    from moe_async.weight_sync.transport import BroadcastTransport

    release = threading.Event()

    def hang(group_name):
        release.wait(120)
        raise RuntimeError("this join was abandoned")

    engines[1].before_join = hang
    tr = BroadcastTransport(engines, _cfg(timeout_s=5), ranks_per_engine=[1, 2], group_name="hang")
    try:
        t0 = time.monotonic()
        with pytest.raises(GroupFormationError, match="sender .* could not form"):
            tr.connect()
        assert time.monotonic() - t0 < 5 + 12  # its timeout, + 5 s for the joins still out to end
        assert engines[0].joins[-1]["success"] is False  # its half-made join ended, nothing held
        release.set()
        engines[1].before_join = None
        for e in engines:
            e.wait_idle()
        tr.connect()
        ts = _tensors(3)
        tr.send(ts.items(), 9)
        assert all(e.checksums.items() >= _sums(ts).items() for e in engines)
    finally:
        release.set()
        engines[1].before_join = None
        tr.shutdown()


def test_a_second_senders_group_into_sglang_receivers(engines):
    """Several senders: rank 0's transport posts a bucket of another sender's group (its own
    name, joined by SGLang's ``init_custom_process_group`` on every engine rank, formed after
    rank 0's in the fixed order); that sender broadcasts it as rank 0 of its group (a thread
    here, a trainer rank in a run); every engine rank receives both senders' tensors
    bit-identical, the version on the last bucket, inside one session."""
    from moe_async.weight_sync.bucket import Bucket
    from moe_async.weight_sync.group import group_broadcast
    from moe_async.weight_sync.membership import form_in_order
    from moe_async.weight_sync.senders import SenderLink
    from moe_async.weight_sync.stream_export import PackedExport
    from moe_async.weight_sync.transport import BroadcastTransport

    for e in engines:
        e.joins.clear()
        e.calls.clear()
        e.checksums.clear()
    tr = BroadcastTransport(engines, _cfg(timeout_s=30), ranks_per_engine=[1, 2], group_name="multi")
    link = SenderLink(engines, _cfg(timeout_s=30), rank=1, ranks_per_engine=[1, 2], group_name="multi")
    try:
        form_in_order([tr.membership, link.membership])
        tr.group, link.group = tr.membership.group, link.membership.group
        assert [(j["rank"], j["world"]) for j in engines[0].joins] == [(1, 4), (1, 4)]  # a group per sender
        assert link.group_name == "multi-s1"
        own, other = _tensors(20, "s0"), _tensors(21, "s1")
        b0 = Bucket(names=list(own), tensors=list(own.values()), nbytes=sum(t.nbytes for t in own.values()))
        b1 = Bucket(names=list(other), tensors=list(other.values()), nbytes=sum(t.nbytes for t in other.values()),
                    group_name=link.group_name)
        flat1 = b1.flatten()
        th = threading.Thread(target=group_broadcast, args=(link.group, flat1, 0))

        def items(bucket_bytes, *, stats, **kw):
            stats.update(pack_seconds=0.0, wait_seconds=0.0)  # what an export reports (nothing packed here)
            yield b0, b0.flatten(), False
            th.start()  # the other sender broadcasts its bucket over its own group
            yield b1, None, True

        m = tr.send(PackedExport(items), 9)
        th.join(30)
        assert m["sync/buckets"] == 2 and m["sync/bytes"] == b0.nbytes + b1.nbytes
        for e in engines:
            assert e.checksums == {**_sums(own), **_sums(other)}  # every rank of every engine
            assert e.version == "9"
            calls = [c for c in e.calls if not c.startswith("init")]  # one session, both senders' buckets
            assert calls == ["begin", f"update:{len(own)}:None", f"update:{len(other)}:9", "end"]
    finally:
        tr.shutdown()
        link.close()


def test_a_senders_group_abandoned_mid_broadcast_ends_sglangs_receive_at_once(engines):
    """Another sender's bucket is posted and SGLang's ``receive_weights_from_distributed`` waits
    in its broadcast (the TP1 engine: a direct child of the sender in gloo's broadcast tree);
    that sender abandons its group instead of broadcasting (its broadcast failed): the update
    call fails within seconds naming the closed connection (the group's timeout: 20 s here),
    and the engine does not take the version."""
    from moe_async.weight_sync.bucket import Bucket
    from moe_async.weight_sync.group import WeightSyncError
    from moe_async.weight_sync.membership import form_in_order
    from moe_async.weight_sync.senders import SenderLink
    from moe_async.weight_sync.stream_export import PackedExport
    from moe_async.weight_sync.transport import BroadcastTransport

    eng = engines[0]
    eng.wait_idle()
    version = eng.version
    tr = BroadcastTransport([eng], _cfg(timeout_s=60), group_name="gone")
    link = SenderLink([eng], _cfg(timeout_s=60), rank=1, group_name="gone")
    try:
        form_in_order([tr.membership, link.membership])
        tr.group, link.group = tr.membership.group, link.membership.group
        own, other = _tensors(30, "s0"), _tensors(31, "s1")
        b0 = Bucket(names=list(own), tensors=list(own.values()), nbytes=sum(t.nbytes for t in own.values()))
        b1 = Bucket(names=list(other), tensors=list(other.values()), nbytes=sum(t.nbytes for t in other.values()),
                    group_name=link.group_name)
        gone = threading.Timer(1.0, link.abandon)  # once the engine waits in that broadcast

        def items(bucket_bytes, *, stats, **kw):
            stats.update(pack_seconds=0.0, wait_seconds=0.0)
            yield b0, b0.flatten(), False
            gone.start()
            yield b1, None, True

        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="update_weights_from_distributed failed: .*Connection closed by peer"):
            tr.send(PackedExport(items), 9)
        gone.join(30)
        assert time.monotonic() - t0 < 8, time.monotonic() - t0
        assert eng.version == version
    finally:
        tr.shutdown()
        link.close()
