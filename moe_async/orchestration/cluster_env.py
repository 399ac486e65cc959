"""The environment every process of a run gets (driver, trainer ranks, engines, their children).

:func:`no_proxy_hosts` adds loopback and the cluster's own addresses to ``no_proxy`` so engine
traffic never goes through an inherited HTTP proxy; :func:`worker_env` is the Ray runtime
environment's ``env_vars`` (threads, ``no_proxy``, the socket interface and NCCL settings), so
trainer ranks and engines see the same values.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import os
import socket
from typing import Iterable, Mapping

LOOPBACK = ("localhost", "127.0.0.1", "::1")
PASSED = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG",
          "MOE_ASYNC_RUN_ID")
DEFAULTS = {"NCCL_CUMEM_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def no_proxy_hosts(env: Mapping[str, str] | None = None, hosts: Iterable[str] = ()) -> str:
    """``no_proxy`` of ``env`` (lower- and upper-case, merged), plus :data:`LOOPBACK`, this
    host's name, and ``hosts`` (e.g. the Ray head's address), comma-separated, each once, in
    first-seen order."""
    env = os.environ if env is None else env
    seen: list[str] = []
    found = [env.get("no_proxy", ""), env.get("NO_PROXY", "")]
    for h in [*",".join(found).split(","), *LOOPBACK, socket.gethostname(), *hosts]:
        h = h.strip()
        if h and h not in seen:
            seen.append(h)
    return ",".join(seen)


def head_host(address: str | None) -> list[str]:
    """The host of a ``HOST:PORT`` Ray address (``[]`` for None, ``auto`` or ``local``)."""
    if not address or address in ("auto", "local"):
        return []
    host = address.split("://")[-1].rpartition(":")[0] or address
    return [host.strip("[]")]


def worker_env(env: Mapping[str, str] | None = None, hosts: Iterable[str] = (),
               engine_log_dir: str | None = None) -> dict[str, str]:
    """``env_vars`` of the run's Ray runtime environment (``docs/design/orchestration.md``); ``env``: the
    driver's environment (default ``os.environ``); ``hosts``: cluster addresses for ``no_proxy``."""
    env = os.environ if env is None else env
    np = no_proxy_hosts(env, hosts)
    out = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "no_proxy": np, "NO_PROXY": np}
    for k, v in DEFAULTS.items():
        out[k] = env.get(k, v)
    for k in PASSED:
        if env.get(k):
            out[k] = env[k]
    if engine_log_dir:
        out["MOE_ASYNC_ENGINE_LOG_DIR"] = engine_log_dir
    return out
