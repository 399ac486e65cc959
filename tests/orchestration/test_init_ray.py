"""init_ray starts a new local Ray even where another job's cluster file is left on the host."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SCRIPT = """
import ray
from moe_async.orchestration.lifecycle import init_ray
init_ray()
print("CPUS", int(ray.cluster_resources()["CPU"]))
ray.shutdown()
"""


def test_stale_current_cluster_file_is_not_joined():
    # what a `ray start --head` that has since died leaves behind: ray.init() without an
    # address reads this file and tries to join a cluster that is gone, refusing num_cpus
    # (a short temp dir: Ray's socket paths must stay under 108 bytes)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mr") as d:
        tmp = Path(d)
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
        env.update(TMPDIR=d)
        p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"CPUS {os.cpu_count()}" in p.stdout
