"""Case C23 on a local multi-node Ray cluster (ray.cluster_utils: several raylets on this host):
``python -m moe_async.orchestration.cluster`` waits for the GPUs the config needs, goes on when
a second node brings them, gives up after its timeout naming need and have, and does not count
GPUs that a leftover actor holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_async.config import load_config
from moe_async.orchestration.cluster import required_resources

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "cpu_smoke.yaml")
NEED_4 = ["engine.num_engines=3"]  # 1 trainer rank + 3 one-device engines = 4 GPUs


def test_required_resources_count_trainer_ranks_and_engine_devices() -> None:
    cfg = load_config(SMOKE, NEED_4)
    assert required_resources(cfg, nodes=1, gpus_per_node=2) == {"nodes": 1.0, "GPU": 4.0}
    assert required_resources(cfg, nodes=1) == {"nodes": 1.0}  # CPU nodes: only the nodes count
    cfg = load_config(SMOKE, ["trainer.nodes=2", "engine.backend=sglang", "engine.tensor_parallel_size=2",
                                  "engine.num_engines=2"])
    assert required_resources(cfg, nodes=1, gpus_per_node=8) == {"nodes": 2.0, "GPU": 2.0 + 2 * 2}


def _wait_cmd(address: str, timeout: float) -> list[str]:
    return [sys.executable, "-m", "moe_async.orchestration.cluster", "--address", address, "--gpus-per-node", "2",
            "--timeout", str(timeout), SMOKE, *NEED_4]


@pytest.fixture
def ray_env(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file written into the home directory
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return dict(os.environ)


def test_wait_goes_on_when_a_node_joins_and_times_out_naming_need_and_have(ray_env) -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    try:
        # no second node: gives up after its timeout with what it needs and has
        t0 = time.monotonic()
        p = subprocess.run(_wait_cmd(cluster.address, 1), env=ray_env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1, (p.stdout, p.stderr[-3000:])
        assert "need 1 node, 4 GPU; have 1 node, 2 GPU" in p.stderr and "missing: GPU (2 of 4)" in p.stderr, p.stderr
        assert time.monotonic() - t0 >= 1

        # a second node with 2 GPUs joins once the wait has polled and found too few: it goes on then
        waiter = subprocess.Popen(_wait_cmd(cluster.address, 120), env=ray_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert waiter.stdout is not None and waiter.stderr is not None
        before = []  # up to the wait's "waiting ..." line: it has polled a cluster short of GPUs
        while (line := waiter.stdout.readline()) and "waiting for" not in line:
            before.append(line)
        assert f"waiting for the Ray cluster at {cluster.address}: need 1 node, 4 GPU; have 1 node, 2 GPU" in line, \
            (line, before, waiter.stderr.read()[-3000:] if line == "" else "")
        t0 = time.monotonic()
        cluster.add_node(num_cpus=1, num_gpus=2)
        t_join = time.monotonic() - t0
        out, err = waiter.communicate(timeout=120)
        elapsed = time.monotonic() - t0
        assert waiter.returncode == 0, (out, err[-3000:])
        assert "ready after" in out and "have 2 nodes, 4 GPU" in out, out
        assert t_join <= elapsed < t_join + 30  # polled: within a few polls of the join

        # a leftover actor of another job holds 2 GPUs: only 2 are available
        ray.init(address=cluster.address)

        @ray.remote
        class Holder:
            def ping(self) -> int:
                return 1

        holder = Holder.options(num_gpus=2, num_cpus=0).remote()
        assert ray.get(holder.ping.remote()) == 1
        p = subprocess.run(_wait_cmd(cluster.address, 1), env=ray_env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "need 1 node, 4 GPU; have 2 nodes, 2 GPU" in p.stderr, (p.stdout, p.stderr[-3000:])
        ray.kill(holder)
        p = subprocess.run(_wait_cmd(cluster.address, 60), env=ray_env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (p.stdout, p.stderr[-3000:])
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_wait_fails_at_once_when_the_head_process_exits(ray_env) -> None:
    """``--watch-pid``: the launcher's head step exited (a taken port): exit 3 at once, not after the timeout."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.monotonic()
    p = subprocess.run([*_wait_cmd("127.0.0.1:9", 60), "--watch-pid", str(dead.pid)], env=ray_env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and f"the Ray head process {dead.pid} exited" in p.stderr, p.stderr[-3000:]
    assert time.monotonic() - t0 < 30


def test_wait_fails_at_once_when_a_worker_step_exits(ray_env) -> None:
    """``--watch-worker-pid``: a worker node's step exited during the wait (the head still runs):
    exit 3 at once naming that step, not after the timeout."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.monotonic()
    p = subprocess.run([*_wait_cmd("127.0.0.1:9", 600), "--watch-pid", str(os.getpid()), "--watch-worker-pid",
                        str(os.getpid()), "--watch-worker-pid", str(dead.pid)], env=ray_env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3 and f"the Ray worker step(s) {dead.pid} exited" in p.stderr, p.stderr[-3000:]
    assert time.monotonic() - t0 < 300  # not the 600 s timeout (start-up alone is slow on a loaded host)
