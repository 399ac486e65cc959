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
