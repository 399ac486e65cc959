"""Placement of the trainer ranks and the engines on Ray's declared resources, with actors that
only report their environment (tests/orchestration/_placement_checks.py: the real placement,
TrainerGroup start-up and EnginePool, the actor classes swapped).

The checks the selected tests read run in one process with its own TMPDIR (one interpreter
start-up for all), each on its own Ray instance, so no Ray instance (nor the
``ray_current_cluster`` file a local cluster writes) is anyone else's.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from _launch import run_json

HERE = os.path.dirname(__file__)


#: each mode of _placement_checks.py: the fixture of this module that reads it, its time limit [s]
MODES = {"gpus8": ("gpus8", 300), "two_nodes": ("two_nodes", 300), "multinode_engines": ("multinode", 600)}


@pytest.fixture(scope="module")
def checks(request) -> dict:
    """``{mode: results}`` of the modes some selected test of this module reads, from one
    ``_placement_checks.py`` process."""
    used = {name for item in request.session.items if item.path == request.path for name in item.fixturenames}
    modes = [m for m, (fixture, _) in MODES.items() if fixture in used]
    tmp = tempfile.mkdtemp(prefix="mray", dir="/tmp")  # short: Ray's socket paths have a length limit
    return run_json(os.path.join(HERE, "_placement_checks.py"), *modes, timeout=sum(MODES[m][1] for m in modes),
                    TMPDIR=tmp)


def _mode(checks: dict, mode: str) -> dict:
    res = checks[mode]
    assert "error" not in res, res["error"]
    return res


@pytest.fixture(scope="module")
def gpus8(checks):
    return _mode(checks, "gpus8")


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


@pytest.fixture(scope="module")
def two_nodes(checks):
    return _mode(checks, "two_nodes")


def test_two_node_cluster_ranks_in_node_order(two_nodes):
    """ray.cluster_utils.Cluster, 2 nodes of 2 GPUs, trainer.nodes=2: ranks 0-1 on one node,
    2-3 on the other, LOCAL_RANK per node, MASTER_ADDR = rank 0's node address; the engine
    served on its node's address (the cluster has several nodes). On one host every node has
    the host's address, so the node ids tell the nodes apart."""
    res = two_nodes
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


@pytest.fixture(scope="module")
def multinode(checks):
    return _mode(checks, "multinode_engines")


def _sglang_args(cmd: list[str]):
    """SGLang 0.5.23's own parse of one of our command lines (after ``python -m sglang.launch_server``)."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "engines"))
    from _sglang_import import load_io_struct

    load_io_struct()  # SGLang's stubs for triton/torchvision (tests/engines/_sglang_import.py)
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(cmd[3:])


def test_multi_node_engines_one_process_per_node(multinode):
    """engine.nodes_per_engine=2 on a 3-node Cluster of 4 GPUs: 2 SGLang engines of TP4, each
    split over 2 nodes (STRICT_SPREAD, 2 GPUs per node); every process's SGLang command line
    has --nnodes 2, its --node-rank, and --dist-init-addr at node rank 0's address; only node
    rank 0 is routed to; SGLang 0.5.23's own argument parser reads every command line the same."""
    res = multinode
    procs = res["procs"]
    assert [(p["index"], p["node_rank"]) for p in procs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["gpus"] == 2.0 for s in res["slots"])
    for i in (0, 1):
        a, b = procs[2 * i], procs[2 * i + 1]
        assert a["node_id"] != b["node_id"]  # one bundle per node
        assert len(a["cuda"].split(",")) == len(b["cuda"].split(",")) == 2
    used = [(p["node_id"], d) for p in procs for d in p["cuda"].split(",")]
    assert len(set(used)) == 8  # no GPU of a node given twice
    assert res["urls"] == [f"http://{p['host']}:{31000 + 10 * p['index']}" for p in res["leaders"]]
    assert res["free_after"] == 12.0
    for p in procs:
        cmd = p["cmd"]
        assert cmd[cmd.index("--dist-init-addr") + 1].split(":")[0] == procs[2 * p["index"]]["node_ip"]
        args = _sglang_args(cmd)
        assert (args.nnodes, args.node_rank, args.tp_size) == (2, p["node_rank"], 4)
        assert args.dist_init_addr == procs[2 * p["index"] + 1]["cmd"][cmd.index("--dist-init-addr") + 1]
        assert args.enable_return_routed_experts


def test_multi_node_engine_restart_restarts_every_node_with_a_new_group(multinode):
    """Engine 0 (2 nodes) restarted on the same Cluster: BOTH its processes are stopped, and only
    then both started again, with the same --nnodes/--node-rank as before and one new
    --dist-init-addr (node rank 0's address, a port other than the old group's), as SGLang's
    own parser reads them; engine 0 keeps its URL; engine 1's processes are not touched.
    (A restart of node rank 0 alone waited for a node-rank-1 peer that was dead or held the
    old group.)"""
    before, after = multinode["procs"], multinode["after_restart"]
    assert multinode["restart_url"] == multinode["urls"][0]
    e0 = [p for p in after if p["index"] == 0]
    assert [p["node_rank"] for p in e0] == [0, 1]
    for p in e0:  # (a stop of a stopped process is a no-op: consecutive stops are one)
        whats = [e["what"] for k, e in enumerate(p["events"]) if k == 0 or e["what"] != p["events"][k - 1]["what"]]
        assert whats == ["start", "stop", "start"], p["events"]
    stops = [next(e["t"] for e in p["events"] if e["what"] == "stop") for p in e0]
    starts = [p["events"][-1]["t"] for p in e0]
    assert max(stops) <= min(starts)  # every node stopped before any started
    old_addr = {_sglang_args(p["cmd"]).dist_init_addr for p in before if p["index"] == 0}
    new_args = [_sglang_args(p["events"][-1]["cmd"]) for p in e0]
    (new_addr,) = {a.dist_init_addr for a in new_args}  # one group: the same address on every node
    (old_addr,) = old_addr
    assert new_addr.split(":")[0] == old_addr.split(":")[0] == e0[0]["node_ip"]
    assert new_addr.split(":")[1] != old_addr.split(":")[1]  # a new rendezvous port
    assert [(a.nnodes, a.node_rank, a.tp_size) for a in new_args] == [(2, 0, 4), (2, 1, 4)]
    assert [a.port for a in new_args] == [_sglang_args(p["cmd"]).port for p in before if p["index"] == 0]
    for p in after:
        if p["index"] == 1:
            assert [e["what"] for e in p["events"]] == ["start"]


def test_tensor_transport_refused_when_an_engine_is_on_another_node(two_nodes):
    """weight_sync.transport=tensor on the same Cluster, the engine's bundle on the head node,
    trainer rank 0 on another: refused at placement naming the engine, both nodes and the fix
    (issue 16: only `moe-async plan` refused it); both placements removed (all 5 CPUs free)."""
    res = two_nodes["tensor"]
    assert res["trainer_node"] != res["engine_node"]
    assert res["refused"].startswith(
        f"weight_sync.transport='tensor': engine 0 was placed on node {res['engine_node']} ({res['engine_ip']}), "
        f"trainer rank 0 (the sending rank) on node {res['trainer_node']} ({res['trainer_ip']})")
    assert "use weight_sync.transport='broadcast'" in res["refused"]
    assert res["free_after"] == 5.0


def _slot(node: str):
    from moe_async.orchestration.placement import Slot

    return Slot(pg=None, bundle_index=0, num_cpus=1.0, num_gpus=0.0, node_id=node, node_ip="10.0.0." + node[-1])


@pytest.mark.parametrize("transport,engine_nodes,refused", [
    ("tensor", ["n1", "n1"], None),  # every engine beside rank 0: accepted
    ("tensor", ["n1", "n2"], "engine 1 was placed on node n2 (10.0.0.2), trainer rank 0 (the sending rank) on node "
                             "n1 (10.0.0.1)"),
    ("broadcast", ["n2", "n2"], None),  # a broadcast crosses nodes
])
def test_tensor_transport_node_check(transport, engine_nodes, refused):
    from moe_async.config import load_config
    from moe_async.orchestration.placement import Placement, PlacementError, check_tensor_transport_nodes

    cfg = load_config(os.path.join(HERE, "..", "..", "configs", "cpu_smoke.yaml"),
                      [f"weight_sync.transport={transport}", "engine.num_engines=2"])
    trainer, engines = Placement([_slot("n1"), _slot("n2")]), Placement([_slot(n) for n in engine_nodes])
    if refused is None:
        check_tensor_transport_nodes(cfg, trainer, engines)
        return
    with pytest.raises(PlacementError, match="weight_sync.transport='tensor'") as e:
        check_tensor_transport_nodes(cfg, trainer, engines)
    assert refused in str(e.value)
