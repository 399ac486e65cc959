"""The buffer's contents in a whole-run checkpoint (moe_async/buffer/snapshot.py): buffered groups
survive a JSON round trip exactly (every sample field, routed_experts included), are put back in
FIFO order into a resumed buffer, stale ones at the resumed version are dropped with reason
``stale`` and their draws reported, and the accounting invariant holds over the restored
buffer; a resumed rollout manager passes over the restored draws."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moe_async.buffer.buffer import RolloutBuffer
from moe_async.buffer.snapshot import (groups_from_snapshot, restore, sample_from_dict, sample_to_dict, snapshot,
                                       snapshot_draws)
from moe_async.orchestration.metrics import prompt_accounting
from moe_async.orchestration.run_state import TRAINED, DrawLedger
from moe_async.rollout.config import RolloutConfig
from moe_async.types import Group, Sample
from tests.orchestration.test_run_state import SeqDataset
from tests.rollout.test_rollout_manager import FakeBuffer, FakeEngine, _manager, _run


def _group(gid: int, seq: int, versions: list[int], routes: bool = False) -> Group:
    samples = []
    for i in range(2):
        r = len(versions)
        samples.append(Sample(
            prompt_ids=[1, 2, 3], response_ids=[10 + i + k for k in range(r)],
            rollout_logprobs=[-0.1 * (k + 1) - 1e-17 * i for k in range(r)], weight_versions=list(versions),
            finish_reason="stop", reward=0.25 * i, reward_error="timeout" if i else None, answer="7",
            response_text=f"r{i}", loss_weight=1.0 - i,
            routed_experts=np.arange((2 + r) * 2 * 2, dtype=np.uint8).reshape(2 + r, 2, 2) if routes else None,
            metadata={"task": "t", "problem_index": seq, "group_id": gid, "sample_index": i, "draw_seq": seq}))
    return Group(gid, samples, start_version=min(versions))


def _same(a: Sample, b: Sample) -> bool:
    da, db = sample_to_dict(a), sample_to_dict(b)
    return da == db and (a.routed_experts is None or (a.routed_experts.dtype == b.routed_experts.dtype
                                                       and np.array_equal(a.routed_experts, b.routed_experts)))


def test_sample_round_trip_is_exact_through_json() -> None:
    s = _group(3, 11, [4, 4, 5], routes=True).samples[1]
    s.rollout_logprobs[0] = float("nan")  # a NaN logprob is kept as it was (the trainer refuses it, C28)
    back = sample_from_dict(json.loads(json.dumps(sample_to_dict(s))))
    assert back.response_ids == s.response_ids and back.weight_versions == s.weight_versions
    assert math.isnan(back.rollout_logprobs[0]) and back.rollout_logprobs[1:] == s.rollout_logprobs[1:]
    assert back.routed_experts.dtype == np.uint8 and np.array_equal(back.routed_experts, s.routed_experts)
    assert (back.reward, back.reward_error, back.loss_weight, back.metadata) == (0.25, "timeout", 0.0, s.metadata)


def test_snapshot_restore_fifo_stale_dropped_and_accounting() -> None:
    old = RolloutBuffer(groups_per_step=2, max_staleness=1, start_version=3)
    for gid, (seq, vs) in enumerate([(20, [3, 4]), (21, [4, 4]), (22, [5, 5])]):
        assert old.admit() is not None
        old.put(_group(gid, seq, vs))
    snap = json.loads(json.dumps(snapshot(old)))  # as saved in moe_async_state.json
    assert snapshot_draws(snap) == [20, 21, 22] and snap["counters"]["buffered_groups"] == 3
    saved = groups_from_snapshot(snap)
    assert all(_same(a, b) for g0, g1 in zip(old.buffered_groups(), saved) for a, b in zip(g0.samples, g1.samples))

    new = RolloutBuffer(groups_per_step=2, max_staleness=1, start_version=5)  # resumed at version 5
    assert restore(new, snap, trainer_version=5) == {"restored": 3, "dropped_stale": 1}
    assert new.stale_draws == [20]  # oldest token at 3: 5 - 3 > K=1
    assert [g.samples[0].metadata["draw_seq"] for g in new.buffered_groups()] == [21, 22]
    st = new.stats()
    assert (st["admitted"], st["retired"], st["drop_reasons"], st["samples_generated"]) == (3, 1, {"stale": 1}, 6)
    assert new.capacity - (st["admitted"] - st["retired"]) == 2  # the restored groups hold admission slots
    batch = new.get_batch(5)
    assert [g.samples[0].metadata["draw_seq"] for g in batch] == [21, 22]
    acc = prompt_accounting(new.stats())
    assert acc["balanced"] and (acc["drawn"], acc["trained"], acc["dropped"], acc["pending"]) == (3, 2, 1, 0)

    led = DrawLedger({"frontier": 20, "settled": {}, "counts": {}})  # the saved ledger: 20..22 pending
    for seq in new.stale_draws:
        led.settle(seq, "stale")
    for g in batch:
        led.settle(g.samples[0].metadata["draw_seq"], TRAINED)
    assert led.frontier == 23 and led.counts == {"stale": 1, TRAINED: 2}


def test_malformed_snapshot_named() -> None:
    with pytest.raises(ValueError, match="buffer snapshot: expected a dict with format=1"):
        groups_from_snapshot({"groups": []})
    d = sample_to_dict(_group(0, 1, [0]).samples[0])
    del d["weight_versions"]
    with pytest.raises(ValueError, match=r"missing \['weight_versions'\]"):
        sample_from_dict(d)


def test_resumed_manager_passes_over_restored_draws() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=8)
    ds = SeqDataset([4])
    buf = FakeBuffer(capacity=3, version=0)
    m = _manager(cfg, ds, [FakeEngine()], buf)
    ds.seek(2)  # frontier 2; draw 4 settled, draws 2 and 3 restored into the buffer
    m.skip_draws([4])
    m.skip_draws([2, 3], "skipped_restored")
    _run(m, buf, 3)
    assert [g.samples[0].metadata["draw_seq"] for g in buf.groups] == [5, 6, 7]
    mm = m.metrics()
    assert mm["rollout/skipped_restored"] == 2.0 and mm["rollout/skipped_settled"] == 1.0
