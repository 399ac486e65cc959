"""Waiting for a Ray cluster to hold what a run needs, for ``launch/slurm/train.sbatch``.

    python -m moe_async.orchestration.cluster --address HOST:PORT --nodes N [--gpus-per-node G]
        [--tag RESOURCE] [--head-only] [--timeout S] [--watch-pid PID] CONFIG.yaml [key=value ...]
    python -m moe_async.orchestration.cluster --preflight --gpus-per-node G CONFIG.yaml [key=value ...]

Polls until the job's own nodes (``--tag``) have joined and the GPUs the config needs are
available (a cluster that falls short prints one ``waiting ... need ...; have ...`` line
first), then exits 0; a bad config exits 2, a timeout 1 (``need ...; have ...``), a watched
launcher step that exits first 3.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from moe_async.config import ExperimentConfig

EXIT_TIMEOUT, EXIT_HEAD_GONE = 1, 3


class ClusterTimeout(TimeoutError):
    """The cluster did not reach the resources needed in time; the message says need vs have."""


class HeadGone(RuntimeError):
    """The watched head process exited before the cluster answered."""


def required_resources(cfg: ExperimentConfig, nodes: int, gpus_per_node: float = 0.0) -> dict[str, float]:
    """What a run of ``cfg`` needs from the cluster: ``{"nodes": n}`` plus ``"GPU"`` when the
    nodes have GPUs (one device per trainer rank, ``devices per engine`` per engine, and per
    teacher engine when the distillation teacher's own engines run on GPUs)."""
    need: dict[str, float] = {"nodes": float(max(nodes, cfg.trainer.nodes))}
    if gpus_per_node > 0:
        need["GPU"] = float(cfg.trainer.resolved_world_size
                            + cfg.engine.num_engines * cfg.engine.resolved_devices_per_engine)
        tch = getattr(cfg, "teacher", None)
        if tch is not None and tch.enabled and not tch.urls and (tch.engine.backend == "sglang"
                                                                 or tch.engine.device != "cpu"):
            need["GPU"] += tch.engine.num_engines * tch.engine.resolved_devices_per_engine
    return need


def gpu_need(cfg: ExperimentConfig) -> str | None:
    """The config field that needs GPUs (``engine.backend='sglang'``: SGLang engines run on GPUs
    only; ``engine.device='cuda'``: the embedded engine on a GPU; the same two of
    ``teacher.engine`` when the distillation teacher starts its own engines), else None."""
    pools = [("engine", cfg.engine)]
    tch = getattr(cfg, "teacher", None)
    if tch is not None and tch.enabled and not tch.urls:
        pools.append(("teacher.engine", tch.engine))
    for name, e in pools:
        if e.backend == "sglang":
            return f"{name}.backend='sglang'"
        if getattr(e, "device", "cpu") == "cuda":
            return f"{name}.device='cuda'"
    return None


def refuse_without_gpus(cfg: ExperimentConfig, gpus: float | None = None, where: str = "this host") -> None:
    """Refuse a config that needs GPUs (:func:`gpu_need`) where there are none, instead of
    placing its engines on CPU-only bundles. ``gpus`` None: this host's CUDA devices for a local
    run; skipped when attached to a cluster (``RAY_ADDRESS``; the driver counts its GPUs after
    connecting).

    Raises:
        UserInputError: naming the field, ``where`` and its 0 GPU.
    """
    from moe_async.errors import UserInputError

    need = gpu_need(cfg)
    if need is None:
        return
    if gpus is None:
        if os.environ.get("RAY_ADDRESS"):
            return
        import torch

        gpus = float(torch.cuda.device_count())
    if gpus <= 0:
        field = need.split("=")[0]
        fix = f"{field}=cpu" if field.endswith(".device") else f"{field}=embedded"
        raise UserInputError(f"{need} needs GPUs and {where} has 0 GPU (on Slurm: sbatch --gpus-per-node=N; "
                             f"on CPU: {fix})")


def cluster_has(tag: str | None) -> dict[str, float]:
    """``{"nodes": joined nodes (carrying ``tag``; all alive nodes without one), "GPU": available
    GPUs, "CPU": available CPUs}`` of the connected Ray cluster."""
    import ray

    total, avail = ray.cluster_resources(), ray.available_resources()
    nodes = total.get(tag, 0.0) if tag else float(sum(1 for n in ray.nodes() if n.get("Alive")))
    return {"nodes": nodes, "GPU": avail.get("GPU", 0.0), "CPU": avail.get("CPU", 0.0)}


def _fmt(d: dict[str, float]) -> str:
    parts = []
    for k, v in d.items():
        n = int(v) if float(v).is_integer() else v
        parts.append(f"{n} {k[:-1] if k == 'nodes' and n == 1 else k}")
    return ", ".join(parts)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of the launcher counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_for_cluster(address: str, need: dict[str, float], timeout_s: float, tag: str | None = None,
                     watch_pid: int | None = None, poll_s: float = 0.5,
                     watch_workers: Sequence[int] = (),
                     on_short: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """Connect to ``address`` once its port answers, then poll until :func:`cluster_has` meets
    ``need``; returns what the cluster has. Leaves the connection closed (``ray.shutdown``).
    ``on_short(have)`` is called once, at the first poll that falls short of ``need``.

    Raises:
        ClusterTimeout: after ``timeout_s``: ``need ... ; have ...`` (what is missing).
        HeadGone: ``watch_pid`` (the head's launcher step) or one of ``watch_workers`` (the
            worker nodes' steps) exited before the cluster was ready.
    """
    import ray

    host, _, port = address.rpartition(":")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    have: dict[str, float] = {"nodes": 0.0}

    def check_head() -> None:
        if not _alive(watch_pid):
            raise HeadGone(f"the Ray head process {watch_pid} exited before the cluster at {address} was ready")
        gone = [p for p in watch_workers if not _alive(p)]
        if gone:
            raise HeadGone(f"the Ray worker step(s) {', '.join(map(str, gone))} exited before the cluster at "
                           f"{address} was ready (their log: the launcher's log directory)")

    while True:  # the head's port
        check_head()
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ClusterTimeout(f"need {_fmt(need)}; have nothing: no Ray head answers at {address} "
                                 f"after {timeout_s:.0f} s")
        time.sleep(poll_s)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception:
        check_head()  # another process answered on the port and ours exited: HeadGone
        raise
    try:
        while True:
            check_head()
            have = cluster_has(tag)
            if all(have.get(k, 0.0) >= v for k, v in need.items()):
                return have
            if on_short is not None:
                on_short(have)
                on_short = None
            if time.monotonic() > deadline:
                missing = ", ".join(f"{k} ({have.get(k, 0.0):g} of {v:g})" for k, v in need.items()
                                    if have.get(k, 0.0) < v)
                raise ClusterTimeout(f"need {_fmt(need)}; have {_fmt({k: have.get(k, 0.0) for k in need})} at "
                                     f"{address} after {timeout_s:.0f} s (missing: {missing})")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_async.orchestration.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="HOST:PORT of the Ray head (GCS); required unless --preflight")
    p.add_argument("--nodes", type=int, default=1, help="nodes the launcher started")
    p.add_argument("--gpus-per-node", type=float, default=0.0, help="GPUs each node registers (0: CPU)")
    p.add_argument("--tag", default=None, help="custom resource each of the launcher's nodes carries (1 each)")
    p.add_argument("--head-only", action="store_true", help="wait for the head node alone (1 tagged node)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait (default 300)")
    p.add_argument("--watch-pid", type=int, default=None, help="fail at once when this process exits")
    p.add_argument("--watch-worker-pid", type=int, action="append", default=[],
                   help="a worker node's launcher step: fail at once when it exits (repeatable)")
    p.add_argument("--preflight", action="store_true", help="only check the config and its GPU need, no Ray")
    p.add_argument("config", help="YAML experiment file")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    a = p.parse_args(argv)
    from moe_async.config import ConfigError, load_config
    from moe_async.errors import UserInputError

    try:
        cfg = load_config(a.config, a.overrides)
        refuse_without_gpus(cfg, a.gpus_per_node, "the allocation (--gpus-per-node)")
    except (ConfigError, UserInputError) as e:
        print(f"moe-async: {e}", file=sys.stderr)
        return 2
    if a.preflight:
        return 0
    if a.address is None:
        p.error("--address is required")
    need = {"nodes": 1.0} if a.head_only else required_resources(cfg, a.nodes, a.gpus_per_node)
    t0 = time.monotonic()

    def waiting(have: dict[str, float]) -> None:
        print(f"[moe-async] waiting for the Ray cluster at {a.address}: need {_fmt(need)}; have "
              f"{_fmt({k: have.get(k, 0.0) for k in need})}", flush=True)

    try:
        have = wait_for_cluster(a.address, need, a.timeout, a.tag, a.watch_pid, watch_workers=a.watch_worker_pid,
                                on_short=waiting)
    except ClusterTimeout as e:
        print(f"moe-async: the Ray cluster is not ready: {e}", file=sys.stderr)
        return EXIT_TIMEOUT
    except HeadGone as e:
        print(f"moe-async: {e}", file=sys.stderr)
        return EXIT_HEAD_GONE
    print(f"[moe-async] Ray cluster at {a.address} ready after {time.monotonic() - t0:.1f} s: have {_fmt(have)} "
          f"(need {_fmt(need)})", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
