"""An engine's update call fails during a weight sync of a 2-rank trainer group (Ray actors);
what the driver sees. Prints one JSON document (the last stdout line).

    python _sync_error_checks.py

A real embedded engine (tiny Mixtral) and the real TrainerGroup (placement, rank 0's
rendezvous, its error collection), with ranks that send the engine's own checkpoint through
the real BroadcastTransport (rank 0) instead of training: the sync carries a tensor the
engine does not hold, which it refuses (HTTP 400) after the group was formed. A second group
makes one refused HTTP call raise straight out of rank 0 (EngineRequestError through Ray).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "models"))

import ray  # noqa: E402

from moe_async.config import load_config  # noqa: E402
from moe_async.orchestration.placement import place_trainer  # noqa: E402
from moe_async.orchestration.trainer_group import TrainerGroup, TrainerRankError  # noqa: E402

SMOKE = os.path.join(HERE, "..", "..", "configs", "cpu_smoke.yaml")
BAD = "model.layers.0.block_sparse_moe.experts.9.w1.weight"  # the tiny model has 4 experts


@ray.remote(num_cpus=0)
class SyncRank:
    """The TrainerActor's start-up and sync protocol; the weights are the engine's checkpoint."""

    def __init__(self, cfg, model_path, rank, world_size, fault=None):
        self.cfg, self.model_path, self.rank = cfg, model_path, rank
        self.transport, self._sock = None, None

    def rendezvous(self, host):
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        return host, self._sock.getsockname()[1]

    def setup(self, env):
        return os.getpid()

    def connect_engines(self, urls):
        if self.rank != 0:
            return
        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.factory import make_transport

        clients = [SyncEngineClient(u, timeout_s=60) for u in urls]
        self.transport = make_transport(clients, self.cfg.weight_sync, pause_mode="abort",
                                        master_address="127.0.0.1", ranks_per_engine=1)
        self.transport.connect()

    def sync_weights(self):
        if self.rank != 0:
            return {}
        import torch
        from safetensors.torch import load_file

        named = sorted(load_file(os.path.join(self.model_path, "model.safetensors")).items())
        return self.transport.send(named[:3] + [(BAD, torch.zeros(4))] + named[3:], 1)

    def refused_call(self, url):
        if self.rank != 0:
            return None
        from moe_async.engines.client import SyncEngineClient

        return SyncEngineClient(url, timeout_s=60).update_weights_from_distributed(
            names=["x"], dtypes=["float32"], shapes=[[1]], group_name="no_such_group", flush_cache=False)


def _fail(group, method, *args):
    try:
        group._call(method, *args)  # every rank, rank 0's reply (as each TrainerGroup method)
    except TrainerRankError as e:
        ray_err = e.__cause__
        return {"message": str(e), "ray_error": type(ray_err).__name__,
                "cause": type(getattr(ray_err, "cause", None)).__name__}
    return {"message": None}


def main() -> None:
    from _tiny import make_tiny_mixtral

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    model_dir = tempfile.mkdtemp(prefix="syncerr")
    make_tiny_mixtral(model_dir, tie=False)
    eng = make_engine(EngineConfig(startup_timeout_s=600, num_threads=1, max_running_requests=4), model_dir, 0)
    # the engine boots while Ray starts (launch() waits for its health): its process is
    # started first, with this thread idle, then Ray's
    launched = ThreadPoolExecutor(1).submit(eng.launch)
    while eng.proc is None and not launched.done():
        time.sleep(0.01)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    launched.result()
    res = {"url": eng.url}
    try:
        cfg = load_config(SMOKE, ["trainer.world_size=2", "weight_sync.backend=gloo", "weight_sync.timeout_s=60"])
        group = TrainerGroup(cfg, model_dir, placement=place_trainer(cfg), actor_cls=SyncRank)
        group.connect_engines([eng.url])
        res["sync"] = _fail(group, "sync_weights")
        group.kill()
        group = TrainerGroup(cfg, model_dir, placement=place_trainer(cfg), actor_cls=SyncRank)
        res["raw"] = _fail(group, "refused_call", eng.url)
        group.kill()
    finally:
        ray.shutdown()
        eng.shutdown()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
