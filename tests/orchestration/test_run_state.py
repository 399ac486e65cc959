"""The draw ledger of a whole-run checkpoint (moe_async/orchestration/run_state.py) and the
rollout side of a resume (a rewind to the trained frontier, settled draws passed over), so a
prompt pending at the save is drawn again and none is trained twice."""

from __future__ import annotations

import json

import pytest

from moe_async.orchestration.run_state import TRAINED, DrawLedger
from moe_async.rollout.config import RolloutConfig
from tests.rollout.test_rollout_manager import FakeBuffer, FakeDataset, FakeEngine, _manager, _run


def test_frontier_advances_over_the_settled_prefix_only() -> None:
    led = DrawLedger()
    for seq, out in [(0, TRAINED), (2, TRAINED), (3, "stale"), (5, "engine_lost")]:
        led.settle(seq, out)
    assert led.frontier == 1 and led.settled == {2: TRAINED, 3: "stale", 5: "engine_lost"}
    led.settle(1, TRAINED)  # draw 1 (pending until now) trained: the frontier jumps to 4
    assert led.frontier == 4 and led.settled == {5: "engine_lost"}
    st = json.loads(json.dumps(led.state_dict(weight_version=7, step=3, max_staleness=1)))
    assert st == {"frontier": 4, "settled": {"5": "engine_lost"}, "counts": {TRAINED: 3, "stale": 1,
                                                                             "engine_lost": 1},
                  "weight_version": 7, "step": 3, "max_staleness": 1}
    again = DrawLedger(st)  # a resumed run continues the same ledger
    assert again.frontier == 4 and again.settled == {5: "engine_lost"} and again.counts[TRAINED] == 3


def test_a_draw_settled_twice_is_refused() -> None:
    led = DrawLedger()
    led.settle(0, TRAINED)
    led.settle(2, TRAINED)
    with pytest.raises(ValueError, match="draw 2 settled twice: trained then trained"):
        led.settle(2, TRAINED)
    with pytest.raises(ValueError, match="draw 0 settled twice"):
        led.settle(0, "stale")


def test_malformed_state_named() -> None:
    with pytest.raises(ValueError, match="run_state: malformed ledger .*frontier"):
        DrawLedger({"settled": {}, "counts": {}})


class SeqDataset(FakeDataset):
    """FakeDataset with draw numbers (position / seek) as TaskDataset has them."""

    def position(self) -> int:
        return self.i

    def seek(self, seq: int) -> None:
        self.i = seq


def test_resumed_manager_rewinds_and_passes_over_settled_draws() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=8)
    ds = SeqDataset([4])
    buf = FakeBuffer(capacity=4, version=0)
    m = _manager(cfg, ds, [FakeEngine()], buf)
    # a checkpoint said: frontier 2, draws 3 and 5 settled beyond it (trained / dropped)
    ds.seek(2)
    m.skip_draws([3, 5])
    _run(m, buf, 4)
    assert [g.samples[0].metadata["draw_seq"] for g in buf.groups] == [2, 4, 6, 7]
    assert [g.samples[0].metadata["problem_index"] for g in buf.groups] == [2, 4, 6, 7]
    assert m.metrics()["rollout/skipped_settled"] == 2.0


def test_dropped_draws_are_reported_with_their_reason() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=1, max_concurrent_groups=1, max_new_tokens=8)
    ds = SeqDataset([4, 5000, 4])  # draw 1's prompt is longer than the context
    buf = FakeBuffer(capacity=3, version=0)
    m = _manager(cfg, ds, [FakeEngine()], buf, ctx=100)
    _run(m, buf, 3)
    assert m.drain_settled() == [(1, "prompt_too_long")]
    assert m.drain_settled() == []
    assert [g.samples[0].metadata["draw_seq"] for g in buf.groups] == [0, 2]
