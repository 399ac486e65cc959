"""A proxy in the environment (sbatch and srun hand ``http_proxy``/``HTTP_PROXY`` down to every
process) must not intercept engine traffic: with every proxy variable pointing at a closed port
and no ``no_proxy``, a real embedded engine still starts (its health checks), answers health
and generates through both clients; and the run's worker environment carries a ``no_proxy``
with loopback and the cluster's addresses."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moe_async.engines.base import make_engine
from moe_async.engines.client import EngineClient, SyncEngineClient
from moe_async.engines.config import EngineConfig
from moe_async.orchestration.cluster_env import head_host, no_proxy_hosts, worker_env

_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens, a proxied request fails
_PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture
def proxied(monkeypatch):
    for k in _PROXY_VARS:
        monkeypatch.setenv(k, _PROXY)
    for k in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=2)
    d = tmp_path_factory.mktemp("tiny_proxy")
    MixtralForCausalLM(cfg).save_pretrained(d)
    return str(d)


def test_proxy_in_environment_does_not_intercept_engine_traffic(proxied, model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOE_ASYNC_ENGINE_LOG_DIR", str(tmp_path / "logs"))
    eng = make_engine(EngineConfig(startup_timeout_s=120, num_threads=1), model_dir)
    try:
        eng.launch()  # polls GET /health until 200: through the proxy it never would be
        # the environment's proxy really is in force for a client that trusts it
        with pytest.raises(httpx.ConnectError):  # to the proxy port, not the engine
            httpx.get(f"{eng.url}/health", timeout=5.0)
        assert eng.healthy()
        assert eng.log_path.startswith(str(tmp_path / "logs"))  # engine logs where the run asked
        sp = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
        with SyncEngineClient(eng.url, timeout_s=60, retries=1) as c:
            assert c.health() is True
            out = c.generate([3, 4, 5], sp)
            assert len(out.output_ids) == 4

        async def run():
            async with EngineClient(eng.url, timeout_s=60, retries=1) as c:
                return await c.health(), await c.generate([3, 4, 5], sp)

        ok, out2 = asyncio.run(run())
        assert ok is True and out2.output_ids == out.output_ids  # greedy: the same tokens
    finally:
        eng.shutdown()


def test_worker_env_no_proxy_and_nccl_settings() -> None:
    env = {"no_proxy": "corp.example,10.1.2.3", "NO_PROXY": "10.1.2.3,.internal", "NCCL_SOCKET_IFNAME": "ib0",
           "HTTP_PROXY": _PROXY}
    out = worker_env(env, hosts=head_host("10.0.0.7:6379"), engine_log_dir="/runs/x/logs")
    hosts = out["no_proxy"].split(",")
    assert hosts[:3] == ["corp.example", "10.1.2.3", ".internal"]  # the user's first, each once
    assert {"localhost", "127.0.0.1", "::1", "10.0.0.7"} <= set(hosts) and len(hosts) == len(set(hosts))
    assert out["NO_PROXY"] == out["no_proxy"]
    assert out["NCCL_CUMEM_ENABLE"] == "0" and out["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert out["NCCL_SOCKET_IFNAME"] == "ib0" and "GLOO_SOCKET_IFNAME" not in out
    assert out["MOE_ASYNC_ENGINE_LOG_DIR"] == "/runs/x/logs" and "HTTP_PROXY" not in out
    assert worker_env({"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"] == "1"  # the user's value kept
    assert head_host(None) == [] and head_host("auto") == [] and head_host("[::1]:6379") == ["::1"]
    # what httpx makes of the merged list: loopback and the head are not proxied
    from httpx._utils import get_environment_proxies

    import os

    old = dict(os.environ)
    try:
        os.environ.update(HTTP_PROXY=_PROXY, NO_PROXY=no_proxy_hosts({}, ["10.0.0.7"]))
        os.environ.pop("no_proxy", None)
        mounts = get_environment_proxies()
        assert mounts.get("all://127.0.0.1", "proxied") is None and mounts.get("all://10.0.0.7", "proxied") is None
    finally:
        os.environ.clear()
        os.environ.update(old)
