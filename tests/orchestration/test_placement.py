"""Placement of the trainer ranks and the engines on Ray's declared resources, with actors that
only report their environment (tests/orchestration/_placement_checks.py: the real placement,
TrainerGroup start-up and EnginePool, the actor classes swapped).

Each check runs in its own process with its own TMPDIR, so its Ray instance (and the
``ray_current_cluster`` file a local cluster writes) is no one else's.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from _launch import run_json

HERE = os.path.dirname(__file__)


def _run(mode: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="mray", dir="/tmp")  # short: Ray's socket paths have a length limit
    return run_json(os.path.join(HERE, "_placement_checks.py"), mode, timeout=300, TMPDIR=tmp)


@pytest.fixture(scope="module")
def gpus8():
    return _run("gpus8")


def test_trainer_and_engines_get_distinct_devices(gpus8):
    """ray.init(num_gpus=8): 4 trainer ranks of 1 GPU + 2 engines of 2 GPUs = 8 distinct devices."""
    ranks, engines = gpus8["ranks"], gpus8["engines"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(len(r["cuda"].split(",")) == 1 for r in ranks)
    assert all(len(e["cuda"].split(",")) == 2 for e in engines)
    devices = [d for r in ranks for d in r["cuda"].split(",")] + [d for e in engines for d in e["cuda"].split(",")]
    assert sorted(devices, key=int) == [str(i) for i in range(8)]


def test_rank_environment(gpus8):
    ranks = gpus8["ranks"]
    addr, port = gpus8["master"]
    for r in ranks:
        assert r["env"] == {"RANK": str(r["rank"]), "WORLD_SIZE": "4", "LOCAL_RANK": str(r["rank"]),
                            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    assert addr == ranks[0]["node_ip"]
    assert len(set(gpus8["pids"])) == 4
    assert gpus8["urls"] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]  # one node: engine.host


def test_too_few_gpus_named_and_nothing_held(gpus8):
    """C23: a job needing 16 GPUs on 8 fails after its timeout naming both numbers."""
    assert "need 16 bundles" in gpus8["too_big"] and "'GPU': 16.0} in all" in gpus8["too_big"]
    have = gpus8["too_big"].split("the cluster has ")[1]
    assert " free of " in have and have.count("'GPU': 8.0") == 2  # free, and in all
    assert gpus8["free_after"] == 8.0  # the killed group and pool gave their GPUs back


def test_two_node_cluster_ranks_in_node_order():
    """ray.cluster_utils.Cluster, 2 nodes of 2 GPUs, trainer.nodes=2: ranks 0-1 on one node,
    2-3 on the other, LOCAL_RANK per node, MASTER_ADDR = rank 0's node address; the engine
    served on its node's address (the cluster has several nodes). On one host every node has
    the host's address, so the node ids tell the nodes apart."""
    res = _run("two_nodes")
    ranks = res["ranks"]
    nodes = [r["node_id"] for r in ranks]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {ranks[0]["node_ip"]}
    assert res["master"][0] == ranks[0]["node_ip"] == res["slots"][0]["node_ip"]
    assert [s["node_id"] for s in res["slots"]] == nodes  # each actor on its slot's node
    assert len({r["env"]["MASTER_PORT"] for r in ranks}) == 1
    (eng,) = res["engines"]
    assert eng["host"] == eng["node_ip"] and res["urls"] == [f"http://{eng['node_ip']}:30000"]
