"""Placement of the trainer group and the engines, with actors that only report their
environment (no trainer, no engine server is started).

    python _placement_checks.py gpus8     # ray.init(num_gpus=8): 4 trainer ranks + 2 engines of 2 GPUs
    python _placement_checks.py two_nodes # ray.cluster_utils.Cluster, 2 nodes of 2 GPUs: 4 ranks, nodes=2;
                                          # then transport tensor refused (the engine on the head node)
    python _placement_checks.py multinode_engines  # 3 nodes of 4 GPUs: 2 SGLang engines of 2 nodes x 2 GPUs;
                                                   # then engine 0 restarted (every node)

Runs the real placement (moe_async.orchestration.placement), the real TrainerGroup start-up
(rank 0's rendezvous, every rank's environment) and the real EnginePool, with the actor
classes swapped. Several modes in one call run one after another, each on its own Ray instance
(``python _placement_checks.py gpus8 two_nodes multinode_engines``). Prints one JSON document
(the last stdout line): ``{mode: results}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import ray  # noqa: E402

from moe_async.config import load_config  # noqa: E402
from moe_async.engines.base import SGLangEngine  # noqa: E402
from moe_async.orchestration.engine_pool import EngineHost, EnginePool  # noqa: E402
from moe_async.orchestration.placement import PlacementError, place_engines, place_trainer  # noqa: E402
from moe_async.orchestration.trainer_group import TrainerGroup  # noqa: E402

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_smoke.yaml")


def _node_ip() -> str:
    nid = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == nid)


@ray.remote(num_cpus=0)
class EnvRank:
    """The TrainerActor's start-up protocol, reporting instead of training."""

    def __init__(self, cfg, model_path, rank, world_size, fault=None):
        self.rank, self.world_size, self.env = rank, world_size, None
        self._sock = None

    def rendezvous(self, host):
        self._sock = socket.socket()
        self._sock.bind((host, 0))  # held, as the TCPStore holds it
        self._sock.listen()
        return host, self._sock.getsockname()[1]

    def setup(self, env):
        os.environ.update(env)
        self.env = env
        return os.getpid()

    def report(self):
        return {"env": self.env, "rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": _node_ip(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


@ray.remote(num_cpus=0)
class EnvEngine:
    def __init__(self, cfg, model_path, index, host=None):
        self.index, self.host = index, host

    def launch(self):
        return f"http://{self.host or '127.0.0.1'}:{30000 + self.index}"

    def dead(self):
        return None

    def shutdown(self):
        pass

    def report(self):
        return {"index": self.index, "host": self.host, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": _node_ip(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


class _RecordedSGLang(SGLangEngine):
    """The real SGLang engine (its command line, port, node rank, --dist-init-addr) whose
    process start and stop are recorded (time, command) instead of run."""

    def __init__(self, *a, events: list, **kw):
        super().__init__(*a, **kw)
        self.events = events

    def launch(self):
        self.events.append({"what": "start", "t": time.time(), "cmd": self.command()})
        return self

    def shutdown(self, grace_s: float = 10.0):
        self.events.append({"what": "stop", "t": time.time()})

    @property
    def alive(self):
        return True


class _CmdHost(EngineHost):
    """EngineActor's own code (launch, stop, restart) for a multi-node engine, its SGLang
    process recorded (:class:`_RecordedSGLang`) instead of run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list = []

    def _make_engine(self, port, dist_init_addr):
        return _RecordedSGLang(self.cfg, self.model_path, 31000 + 10 * self.index + self.node_rank,
                               node_rank=self.node_rank, dist_init_addr=dist_init_addr, events=self.events)

    def report(self):
        return {"index": self.index, "node_rank": self.node_rank, "host": self.cfg.host,
                "cmd": next((e["cmd"] for e in reversed(self.events) if e["what"] == "start"), None),
                "events": self.events, "node_id": ray.get_runtime_context().get_node_id(), "node_ip": _node_ip(),
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


CmdEngine = ray.remote(num_cpus=0)(_CmdHost)


def run(cfg) -> dict:
    tp, ep = place_trainer(cfg), place_engines(cfg)
    group = TrainerGroup(cfg, "unused", placement=tp, actor_cls=EnvRank)
    pool = EnginePool(cfg, "unused", placement=ep, actor_cls=EnvEngine)
    urls = pool.launch()
    out = {"ranks": ray.get([a.report.remote() for a in group.actors]),
           "engines": ray.get([a.report.remote() for a in pool.actors]), "urls": urls,
           "slots": [{"node_id": s.node_id, "node_ip": s.node_ip, "gpus": s.num_gpus, "cpus": s.num_cpus}
                     for s in tp.slots],
           "master": [group.master_addr, group.master_port],
           "pids": group.pids}
    group.kill()
    pool.shutdown()
    return out


def check(mode: str) -> dict:
    """One mode's checks on its own Ray instance (shut down before returning)."""
    res: dict = {}
    if mode == "gpus8":
        ray.init(address="local", num_cpus=2, num_gpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
        try:
            cfg = load_config(SMOKE, ["trainer.world_size=4", "engine.backend=sglang", "engine.num_engines=2",
                                      "engine.tensor_parallel_size=2"])
            res = run(cfg)
            # a job that needs more GPUs than declared fails, naming the need and the supply (C23)
            big = load_config(SMOKE, ["trainer.world_size=16"])
            try:
                place_trainer(big, timeout_s=3)
            except PlacementError as e:
                res["too_big"] = str(e)
            res["free_after"] = ray.available_resources().get("GPU", 0.0)
        finally:
            ray.shutdown()
    elif mode == "two_nodes":
        from ray.cluster_utils import Cluster

        # (one host: every node has the host's address; nodes differ by id)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.add_node(num_cpus=2, num_gpus=2)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        over = ["trainer.nodes=2", "trainer.devices_per_node=2", "engine.num_engines=1"]
        try:
            res = run(load_config(SMOKE, over))
            # the same placement with transport tensor: each node's 2 CPUs go to its 2 ranks' bundles
            # (1 CPU each), so the engine's 1-CPU bundle lands on the head node, not rank 0's
            from moe_async.orchestration.placement import check_tensor_transport_nodes

            cfg = load_config(SMOKE, [*over, "weight_sync.transport=tensor"])
            tp, ep = place_trainer(cfg), place_engines(cfg)
            res["tensor"] = {"trainer_node": tp.slots[0].node_id, "trainer_ip": tp.slots[0].node_ip,
                             "engine_node": ep.slots[0].node_id, "engine_ip": ep.slots[0].node_ip}
            try:
                check_tensor_transport_nodes(cfg, tp, ep)
            except PlacementError as e:
                res["tensor"]["refused"] = str(e)

            for _ in range(100):  # freed resources reach the GCS asynchronously
                res["tensor"]["free_after"] = ray.available_resources().get("CPU", 0.0)
                if res["tensor"]["free_after"] == 5.0:
                    break
                time.sleep(0.1)
        finally:
            ray.shutdown()
            cluster.shutdown()
    elif mode == "multinode_engines":
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(3):
            cluster.add_node(num_cpus=2, num_gpus=4)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        cfg = load_config(SMOKE, ["engine.backend=sglang", "engine.num_engines=2", "engine.tensor_parallel_size=4",
                                  "engine.nodes_per_engine=2"])
        try:
            ep = place_engines(cfg)
            pool = EnginePool(cfg, "/models/m", placement=ep, actor_cls=CmdEngine)
            res = {"urls": pool.launch(), "procs": ray.get([a.report.remote() for a in pool.all_actors]),
                   "leaders": ray.get([a.report.remote() for a in pool.actors]),
                   "slots": [{"node_id": s.node_id, "gpus": s.num_gpus} for s in ep.slots]}
            # engine 0 dies (its node rank 1): restart it (every node, a new group)
            res["restart_url"] = pool.restart(0, 60.0)
            res["after_restart"] = ray.get([a.report.remote() for a in pool.all_actors])
            pool.shutdown()

            for _ in range(100):  # the nodes report freed resources to the GCS asynchronously
                res["free_after"] = ray.available_resources().get("GPU", 0.0)
                if res["free_after"] == 12.0:
                    break
                time.sleep(0.1)
        finally:
            ray.shutdown()
            cluster.shutdown()
    return res


def main(modes: list[str]) -> None:
    """Each mode in turn in this process (one interpreter start-up and import for all);
    prints ``{mode: its results, or {"error": the traceback}}``."""
    import traceback

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    out: dict = {}
    for mode in modes:
        try:
            out[mode] = check(mode)
        except Exception:  # noqa: BLE001 - named in the JSON, the next mode still runs
            out[mode] = {"error": traceback.format_exc()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
