"""Dynamic filtering (DAPO): all-equal-reward groups dropped, counted, capped per version."""

from __future__ import annotations

from test_rollout_manager import EOS, FakeBuffer, FakeDataset, FakeEngine, FakeOut, _manager, _run

from moe_async.rollout.config import RolloutConfig


class AlternatingEngine(FakeEngine):
    """Every other request answers wrongly, so each group of 2 has rewards [1, 0]."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    async def generate(self, input_ids, sampling_params, **kw):
        self.n += 1
        toks = [11 if self.n % 2 else 12, 13, EOS]
        return FakeOut(toks, [-0.25] * 3, "stop", 0, [0] * 3, prompt_tokens=len(input_ids))


def test_all_equal_groups_filtered_up_to_the_cap() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8,
                        dynamic_filter=True, dynamic_filter_max_per_version=2)
    buf = FakeBuffer(capacity=5, version=3)
    m = _manager(cfg, FakeDataset([10]), [FakeEngine()], buf)  # every answer right: rewards [1, 1]
    _run(m, buf, 5)
    assert buf.cancels == ["filtered_equal_rewards"] * 2  # admissions given back: regenerated
    assert len(buf.groups) == 3  # cap reached at version 3: later all-equal groups are kept
    mt = m.metrics()
    assert mt["rollout/dropped/filtered_equal_rewards"] == 2.0
    assert mt["rollout/samples_filtered"] == 4.0 and mt["rollout/tokens_filtered"] == 16.0
    assert mt["rollout/filter_cap_passed"] == 3.0
    assert mt["rollout/samples_generated"] == 10.0


def test_groups_with_signal_pass_and_filter_off_keeps_everything() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8, dynamic_filter=True)
    buf = FakeBuffer(capacity=3)
    m = _manager(cfg, FakeDataset([10]), [AlternatingEngine()], buf)
    _run(m, buf, 3)
    assert buf.cancels == [] and len(buf.groups) == 3
    assert all(sorted(s.reward for s in g.samples) == [0.0, 1.0] for g in buf.groups)
    cfg = RolloutConfig(n_samples_per_prompt=2, max_concurrent_groups=1, max_new_tokens=8)
    buf = FakeBuffer(capacity=3)
    _run(_manager(cfg, FakeDataset([10]), [FakeEngine()], buf), buf, 3)
    assert buf.cancels == [] and len(buf.groups) == 3
