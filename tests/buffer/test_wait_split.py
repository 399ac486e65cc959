"""C27: the wait for a batch split into filling and straggler seconds that add up to it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_async.buffer.buffer import RolloutBuffer
from moe_async.buffer.wait_split import WaitSplit, scale_to_wait, split_batch_wait
from moe_async.types import Group, Sample


def _group(gid: int, version: int) -> Group:
    return Group(gid, [Sample([1, 2], [5, 6], [-0.1, -0.2], [version, version])], start_version=version)


def test_c27_pure_function():
    # 4 groups, the trainer waits 0..3 s at trainer version 2: one group done at 0, two at 2,
    # the fourth (admitted at version 0: at its staleness limit for K=2) done at 3
    done, stale = [0.0, 2.0, 2.0, 3.0], [1, 0, 0, 2]
    assert split_batch_wait(0.0, 3.0, done, stale, max_staleness=2) == WaitSplit(2.0, 1.0)
    # K=0: no group can be older than the trainer, so no straggler time
    assert split_batch_wait(0.0, 3.0, done, [0, 0, 0, 0], max_staleness=0) == WaitSplit(3.0, 0.0)
    # the same completion times but the last group with staleness room: all filling
    assert split_batch_wait(0.0, 3.0, done, [1, 0, 0, 1], max_staleness=2) == WaitSplit(3.0, 0.0)


def test_c27_from_the_buffer_own_record():
    """The buffer's put times and the batch's staleness give the C27 split at hand-out."""
    now = [0.0]
    buf = RolloutBuffer(4, 2, start_version=0, clock=lambda: now[0])
    old = _group(0, 0)  # admitted at version 0: at the limit when the trainer is at version 2
    fresh = [_group(i, 2) for i in (1, 2, 3)]
    buf.put(fresh[0])
    assert buf.get_batch(2) is None  # the trainer begins waiting at t=0
    now[0] = 2.0
    buf.put(fresh[1])
    buf.put(fresh[2])
    assert buf.get_batch(2) is None
    now[0] = 3.0
    buf.put(old)
    batch = buf.get_batch(2)
    assert [g.group_id for g in batch] == [1, 2, 3, 0]
    assert (buf.stats()["wait_filling_s"], buf.stats()["wait_straggler_s"]) == (2.0, 1.0)


def test_c27_k0_buffer_has_no_straggler_time():
    now = [0.0]
    buf = RolloutBuffer(2, 0, start_version=0, clock=lambda: now[0])
    buf.put(_group(0, 0))
    assert buf.get_batch(0) is None
    now[0] = 3.0
    buf.put(_group(1, 0))
    assert buf.get_batch(0) is not None
    assert buf.last_wait == WaitSplit(3.0, 0.0)


def test_wait_starts_at_first_call_after_hand_out():
    now = [10.0]
    buf = RolloutBuffer(1, 1, start_version=0, clock=lambda: now[0])
    buf.put(_group(0, 0))
    assert buf.get_batch(0) is not None and buf.last_wait.total == 0.0  # nothing to wait for
    now[0] = 11.0
    assert buf.get_batch(1) is None  # waiting from 11 s
    now[0] = 11.5
    buf.put(_group(1, 0))  # staleness 1 = K at trainer version 1: a straggler
    assert buf.get_batch(1) is not None
    assert buf.last_wait == WaitSplit(0.0, 0.5)


def test_scale_to_driver_wait_keeps_the_sum():
    s = scale_to_wait(WaitSplit(2.0, 1.0), 3.25)
    assert s.straggler == 1.0 and s.filling == pytest.approx(2.25) and s.total == pytest.approx(3.25)
    assert scale_to_wait(WaitSplit(0.1, 5.0), 2.0) == WaitSplit(0.0, 2.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 3)), min_size=1, max_size=8),
       st.floats(0, 5), st.floats(0, 10), st.integers(0, 3))
def test_parts_always_add_up(groups, start, length, k):
    s = split_batch_wait(start, start + length, [g[0] for g in groups], [g[1] for g in groups], k)
    assert s.filling >= 0 and s.straggler >= 0
    assert s.total == pytest.approx(length)
    if k == 0:
        assert s.straggler == 0
