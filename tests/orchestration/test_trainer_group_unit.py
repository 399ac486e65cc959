"""The trainer group's pure pieces: the test-only fault hook's parsing, LOCAL_RANK from the
placed slots' nodes, every rank's torch.distributed environment."""

from __future__ import annotations

import pytest

from moe_async.orchestration.placement import Placement, Slot
from moe_async.orchestration.trainer_group import FAULT_ENV, parse_fault, rank_envs


def test_fault_hook_parsing():
    assert parse_fault("1:train_step:2", 1) == ("train_step", 2)
    assert parse_fault("1:train_step:2", 0) is None
    assert parse_fault(None, 0) is None and parse_fault("", 0) is None
    for bad in ("train_step", "x:train_step:2", "1:train_step", "1:train_step:two"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}={bad!r}: expected RANK:METHOD:N"):
            parse_fault(bad, 0)


def _slots(nodes: list[str]) -> Placement:
    return Placement(slots=[Slot(pg=None, bundle_index=i, num_cpus=0.5, num_gpus=1.0, node_id=n,
                                 node_ip=f"10.0.0.{ord(n[-1]) - 96}") for i, n in enumerate(nodes)])


def test_local_ranks_count_per_node():
    # two node groups that landed on the same node count on across both
    assert _slots(["a", "a", "b", "b"]).local_ranks() == [0, 1, 0, 1]
    assert _slots(["a", "a", "a", "a"]).local_ranks() == [0, 1, 2, 3]
    assert _slots(["a", "b", "a"]).local_ranks() == [0, 0, 1]
    assert _slots(["a", "b"]).spans_nodes() and not _slots(["a", "a"]).spans_nodes()


def test_rank_envs():
    envs = rank_envs(_slots(["a", "a", "b", "b"]), "10.0.0.1", 29511)
    assert envs[3] == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                       "MASTER_PORT": "29511"}
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"] and {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}


class _Ref:
    """A rank's reply: ``value``, or ``error`` raised by ``ray.get``."""

    def __init__(self, rank: int, value=None, error: BaseException | None = None):
        self.rank, self.value, self.error = rank, value, error


def _fake_ray(monkeypatch, order: list[int]) -> list[object]:
    """``ray.wait`` hands the refs back one at a time in rank order ``order``; ``ray.get`` returns
    a ref's value or raises its error; ``ray.kill`` records the actor. Returns the killed list."""
    import ray

    killed: list[object] = []

    def wait(refs, num_returns=1, timeout=None):
        ready = sorted(refs, key=lambda r: order.index(r.rank))[:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda a, no_restart=True: killed.append(a))
    return killed


def _group(world: int):
    from moe_async.orchestration.trainer_group import TrainerGroup

    g = TrainerGroup.__new__(TrainerGroup)  # no actors started: the gather logic alone
    removed: list[bool] = []
    g.actors = [f"actor{r}" for r in range(world)]
    g.placement = type("P", (), {"remove": lambda self: removed.append(True)})()
    g.watch = None
    g.world_size = world
    return g, removed


def test_a_dead_rank_stops_every_rank_and_is_named_first(monkeypatch):
    """A SIGKILLed rank (Ray: RayActorError) while its peer then fails in the collective it left:
    every rank's actor is killed, the placement removed, and TrainerRankError names the dead rank
    first, the call, and that the whole group stopped (the end-to-end run:
    test_ckpt_crash_resume.py)."""
    import ray

    from moe_async.orchestration.trainer_group import TrainerRankError

    killed = _fake_ray(monkeypatch, order=[0, 1])  # rank 0's collective error arrives first
    g, removed = _group(2)
    refs = [_Ref(0, error=RuntimeError("gloo: connection closed by peer")),
            _Ref(1, error=ray.exceptions.RayActorError())]
    with pytest.raises(TrainerRankError) as ei:
        g._gather(refs, "save_checkpoint")
    assert str(ei.value) == ("trainer rank 1 died in save_checkpoint (RayActorError); trainer rank 0 failed in "
                             "save_checkpoint: RuntimeError: gloo: connection closed by peer "
                             "(all 2 trainer ranks stopped)")
    assert killed == ["actor0", "actor1"] and removed == [True] and g.actors == []
    with pytest.raises(RuntimeError, match="trainer group stopped: cannot call train_step"):
        g._call("train_step")


def test_every_reply_in_rank_order_when_no_rank_fails(monkeypatch):
    killed = _fake_ray(monkeypatch, order=[1, 0])
    g, removed = _group(2)
    assert g._gather([_Ref(0, value="r0"), _Ref(1, value="r1")], "version") == ["r0", "r1"]
    assert killed == [] and removed == []
