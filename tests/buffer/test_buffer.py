"""RolloutBuffer: staleness bound, admission after resume (C6), accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_async.buffer.buffer import STOPPED, RolloutBuffer
from moe_async.types import Group, Sample


def _group(gid: int, versions: list[int], n: int = 2) -> Group:
    return Group(
        gid,
        [Sample([1, 2], [5] * len(versions), [-0.1] * len(versions), list(versions)) for _ in range(n)],
        start_version=min(versions),
    )


def _admit_all(buf: RolloutBuffer) -> int:
    n = 0
    while buf.admit() is not None:
        n += 1
    return n


def test_c6_resume_admits_k_plus_one_batches_not_absolute_version():
    # max_staleness=1, batch=4 groups, restored at version 10, nothing accepted/running.
    buf = RolloutBuffer.from_state_dict({"engine_version": 10, "B": 4, "K": 1})
    assert _admit_all(buf) == 8  # not (10 + 1 + 1) * 4 = 48
    assert buf.admit() is None  # refuses more until training consumes and weights move
    for gid in range(8):
        buf.put(_group(gid, [10, 10]))
    assert len(buf.get_batch(10)) == 4
    assert buf.admit() is None  # consumption alone does not free slots: the version must move
    buf.set_engine_version(11)
    assert _admit_all(buf) == 4


def test_c6_state_dict_round_trip_after_training():
    buf = RolloutBuffer(4, 1, start_version=0)
    _admit_all(buf)
    buf.set_engine_version(10)
    restored = RolloutBuffer.from_state_dict(buf.state_dict())
    assert restored.engine_version == 10 and _admit_all(restored) == 8


def test_stale_groups_dropped_whole_and_counted():
    buf = RolloutBuffer(2, 1)
    buf.put(_group(0, [0, 3]))  # oldest token 0
    buf.put(_group(1, [2, 3]))
    buf.put(_group(2, [3, 3]))
    batch = buf.get_batch(3)  # group 0 is 3 versions old > K=1
    assert [g.group_id for g in batch] == [1, 2]
    st_ = buf.stats()
    assert st_["groups_dropped"] == 1 and st_["samples_dropped"] == 2
    assert st_["drop_reasons"] == {"stale": 1}
    assert st_["samples_generated"] == st_["samples_trained"] + st_["samples_dropped"] + st_["samples_buffered"]


def test_groups_in_flight_at_stop_are_not_drops():
    buf = RolloutBuffer(2, 0)
    for _ in range(2):
        assert buf.admit() == 0
    assert buf.admit() is None  # capacity (K+1)*B = 2 reached
    buf.cancel("prompt_too_long")
    buf.cancel(STOPPED)
    st_ = buf.stats()
    assert st_["drop_reasons"] == {"prompt_too_long": 1}  # not {"stopped": 1, ...}
    assert st_["in_flight_at_stop"] == 1 and st_["in_flight"] == 0
    assert st_["retired"] == 2 and buf.admit() == 0  # both slots given back
    assert st_["samples_dropped"] == 0


def test_get_batch_waits_for_whole_batch():
    buf = RolloutBuffer(3, 0)
    buf.put(_group(0, [0]))
    assert buf.get_batch(0) is None
    assert buf.num_buffered_groups == 1


def test_sample_length_mismatch_rejected():
    buf = RolloutBuffer(1, 0)
    bad = Group(0, [Sample([1], [2, 3], [-0.1], [0, 0])])
    with pytest.raises(ValueError, match="rollout_logprobs=1"):
        buf.put(bad)


def test_bad_args():
    with pytest.raises(ValueError):
        RolloutBuffer(0, 1)
    with pytest.raises(ValueError):
        RolloutBuffer(1, -1)
    buf = RolloutBuffer(1, 1, start_version=5)
    with pytest.raises(ValueError, match="went back"):
        buf.set_engine_version(4)


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 3),
    K=st.integers(0, 3),
    ops=st.lists(st.sampled_from(["admit", "finish", "train", "sync", "cancel"]), max_size=80),
)
def test_property_no_stale_training_no_loss_no_duplicates(B, K, ops):
    """Any interleaving of admissions, completions, training steps and weight syncs:
    no trained token is older than K versions; no sample is lost or duplicated."""
    buf = RolloutBuffer(B, K)
    trainer_v = 0
    running: list[int] = []  # start versions of admitted, unfinished groups
    next_id = 0
    trained_ids: list[int] = []
    for op in ops:
        if op == "admit":
            v = buf.admit()
            if v is not None:
                running.append(v)
        elif op == "finish" and running:
            v0 = running.pop(0)
            # tokens produced between admission and now, at the engine's versions
            buf.put(_group(next_id, [v0, buf.engine_version], n=2))
            next_id += 1
        elif op == "cancel" and running:
            running.pop(0)
            buf.cancel("test")
        elif op == "train":
            batch = buf.get_batch(trainer_v)
            if batch is not None:
                for g in batch:
                    for s in g.samples:
                        assert all(trainer_v - v <= K for v in s.weight_versions)
                    trained_ids.append(g.group_id)
                trainer_v += 1
        elif op == "sync":
            buf.set_engine_version(trainer_v)
        # admission never exceeds the bound
        assert buf.admitted - buf.retired <= buf.capacity
    st_ = buf.stats()
    assert len(trained_ids) == len(set(trained_ids))
    assert st_["samples_generated"] == 2 * next_id
    assert st_["samples_generated"] == st_["samples_trained"] + st_["samples_dropped"] + st_["samples_buffered"]


def _spin(n: int = 5):
    """Let the event loop run ``n`` rounds (no sleeping: a waiter that polls on a timer
    would not be done after these)."""
    import asyncio

    async def go():
        for _ in range(n):
            await asyncio.sleep(0)

    return go()


def test_async_buffer_waits_are_woken_by_events_not_timers():
    import asyncio

    from moe_async.buffer.buffer import AsyncRolloutBuffer

    async def main():
        ab = AsyncRolloutBuffer(groups_per_step=2, max_staleness=0)
        assert [await ab.admit_wait(0) for _ in range(3)] == [0, 0, None]  # capacity (0+0+1)*2
        getter = asyncio.create_task(ab.get_batch_wait(0, timeout_s=60))
        admitter = asyncio.create_task(ab.admit_wait(timeout_s=60))
        await _spin()
        assert not getter.done() and not admitter.done()
        await ab.put(_group(0, [0, 0]))
        await _spin()
        assert not getter.done()  # one group of B=2
        await ab.put(_group(1, [0, 0]))
        await _spin()
        assert getter.done() and [g.group_id for g in getter.result()] == [0, 1]
        assert not admitter.done()  # trained groups do not free slots; the version must move
        await ab.set_engine_version(1)
        await _spin()
        assert admitter.done() and admitter.result() == 1
        # a cancel gives a slot back and wakes an admission waiter too
        assert await ab.admit_wait(0) == 1 and await ab.admit_wait(0) is None
        admitter = asyncio.create_task(ab.admit_wait(timeout_s=60))
        await _spin()
        assert not admitter.done()
        await ab.cancel("prompt_too_long")
        await _spin()
        assert admitter.done() and admitter.result() == 1
        assert await ab.get_batch_wait(1, timeout_s=0) is None  # time-out: None
        # a stale drop at hand-out frees slots and wakes admission
        ab2 = AsyncRolloutBuffer(groups_per_step=1, max_staleness=0)
        assert await ab2.admit_wait(0) == 0 and await ab2.admit_wait(0) is None
        await ab2.put(_group(5, [0, 0]))
        await ab2.set_engine_version(1)  # capacity 2: one more admission
        assert await ab2.admit_wait(0) == 1 and await ab2.admit_wait(0) is None
        waiter = asyncio.create_task(ab2.admit_wait(timeout_s=60))
        await _spin()
        assert not waiter.done()
        assert await ab2.get_batch_wait(1, timeout_s=0) is None  # group 5 is stale: dropped
        await _spin()
        assert waiter.done() and waiter.result() == 1
        assert ab2.buf.stats()["drop_reasons"] == {"stale": 1}

    asyncio.run(main())
