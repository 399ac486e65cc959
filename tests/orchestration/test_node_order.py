"""Trainer rank order across nodes does not depend on the scheduler (constructed placement
data; no Ray cluster is contacted).

16 nodes 10.0.0.2-10.0.0.9 and 10.0.0.66-10.0.0.73, 8 GPUs each, a trainer of 128 ranks at
TP8: 16 ``STRICT_PACK`` groups of 8 bundles, which Ray puts on the nodes in any order and
whose nodes it lists in any order. Right: nodes ordered numerically by address (.9 before
.66, which a string sort gets wrong), the same order whatever Ray reports; ranks 8k..8k+7 on
one node, LOCAL_RANK 0-7, every TP group (Megatron-Core's own RankGenerator) inside a node.
"""

from __future__ import annotations

import random

import pytest

from moe_async.orchestration.placement import Placement, node_order_key, placed_slots
from moe_async.orchestration.trainer_group import rank_envs

ADDRS = [f"10.0.0.{i}" for i in range(2, 10)] + [f"10.0.0.{i}" for i in range(66, 74)]
GPUS_PER_NODE, TP = 8, 8


def _placed(seed: int) -> Placement:
    """What Ray reports for 16 groups of 8 one-GPU bundles: group g on a node chosen by the
    scheduler (a permutation), node ids unrelated to addresses, ``ray.nodes()`` in any order."""
    rng = random.Random(seed)
    node_ids = {a: f"{rng.getrandbits(64):016x}" for a in ADDRS}
    on = ADDRS[:]
    rng.shuffle(on)  # group g lands on node on[g]
    bundles = [{"CPU": 1.0, "GPU": 1.0}] * GPUS_PER_NODE
    groups = [(f"pg{g}", bundles, {i: node_ids[on[g]] for i in range(GPUS_PER_NODE)}) for g in range(16)]
    ips = list(node_ids.items())
    rng.shuffle(ips)
    return Placement(slots=placed_slots(groups, {nid: a for a, nid in ips}, by_node=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_128_ranks_on_16_nodes_in_numeric_address_order(seed):
    from megatron.core.parallel_state import RankGenerator

    p = _placed(seed)
    ips = [s.node_ip for s in p.slots]
    assert len(ips) == 128
    # node k holds ranks 8k..8k+7; nodes in numeric order: .2 ... .9, then .66 ... .73
    assert [ips[8 * k] for k in range(16)] == ADDRS
    assert all(len(set(ips[8 * k:8 * k + 8])) == 1 for k in range(16))
    assert ips.index("10.0.0.66") == 64 and ips.index("10.0.0.9") == 56  # .9 before .66
    assert p.local_ranks() == list(range(8)) * 16
    envs = rank_envs(p, ips[0], 29500)
    assert [e["LOCAL_RANK"] for e in envs] == [str(r % 8) for r in range(128)]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"}
    tp_groups = RankGenerator(tp=TP, ep=1, dp=128 // TP, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("tp")
    assert len(tp_groups) == 16
    for g in tp_groups:
        assert len({ips[r] for r in g}) == 1, g  # every TP group inside one node


def test_the_order_is_the_same_whatever_ray_reports():
    orders = [[(s.node_ip, s.bundle_index) for s in _placed(seed).slots] for seed in range(6)]
    assert all(o == orders[0] for o in orders)


def test_node_order_key():
    assert sorted(["10.0.0.66", "10.0.0.9", "10.0.0.10"], key=lambda a: node_order_key(a, "")) == \
        ["10.0.0.9", "10.0.0.10", "10.0.0.66"]
    # one host, several nodes: the id tells them apart; a name that is no address goes last
    assert node_order_key("127.0.0.1", "a") < node_order_key("127.0.0.1", "b") < node_order_key("::1", "a") \
        < node_order_key("node-x", "a")
