"""Client parsing and engine command lines (no server needed)."""

from __future__ import annotations

import json

import base64
import sys

import numpy as np
import pytest

from moe_async.engines.base import EmbeddedEngine, SGLangEngine, make_engine
from moe_async.engines.replies import parse_generate
from moe_async.engines.config import EngineConfig


def test_sglang_command_line():
    cfg = EngineConfig(backend="sglang", dtype="bf16", max_running_requests=32, tensor_parallel_size=4,
                       expert_parallel_size=2,
                       sglang_args={"enable_dp_attention": True, "disable_radix_cache": False})
    eng = make_engine(cfg, "/models/m", 30001)
    assert isinstance(eng, SGLangEngine)
    cmd = eng.command()
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for a, b in [("--model-path", "/models/m"), ("--port", "30001"), ("--dtype", "bfloat16"),
                 ("--tp-size", "4"), ("--ep-size", "2"), ("--max-running-requests", "32")]:
        assert cmd[cmd.index(a) + 1] == b
    assert "--enable-return-routed-experts" in cmd and "--enable-dp-attention" in cmd
    assert "--disable-radix-cache" not in cmd
    assert eng.url == "http://127.0.0.1:30001" and not eng.alive


@pytest.mark.parametrize("key,field", [("tp_size", "tensor_parallel_size"), ("ep_size", "expert_parallel_size")])
def test_sglang_sizes_only_from_their_fields(key, field):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=rf"engine.sglang_args.{key}: set engine.{field} instead"):
        EngineConfig(backend="sglang", sglang_args={key: 2})


def test_embedded_command_line():
    eng = make_engine(EngineConfig(num_threads=2), "/m", 0)
    assert isinstance(eng, EmbeddedEngine) and eng.port > 0
    cmd = eng.command()
    assert cmd[cmd.index("--num-threads") + 1] == "2"
    assert eng.env()["OMP_NUM_THREADS"] == "2"


def test_parse_sglang_response_with_spans():
    routed = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    resp = {
        "text": "", "output_ids": [5, 6, 7],
        "meta_info": {
            "id": "r1", "prompt_tokens": 3, "completion_tokens": 3,
            "finish_reason": {"type": "stop", "matched": 7},
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "weight_version": "4",
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
            "routed_experts": base64.b64encode(routed.tobytes()).decode(),
        },
    }
    out = parse_generate(resp, moe_shape=(3, 2))
    assert out.output_token_weight_versions == [3, 3, 4] and out.weight_version == 4
    assert out.finish_reason == "stop" and out.output_logprobs == [-0.1, -0.2, -0.3]
    np.testing.assert_array_equal(out.routed_experts, routed)
    with pytest.raises(ValueError, match="moe_layers"):
        parse_generate(resp)
    del resp["meta_info"]["weight_versions"]
    assert parse_generate(resp, (3, 2)).output_token_weight_versions == [4, 4, 4]


def test_tools_import_safe_and_help():
    """tools/gpu_check.py, tools/sglang_server_check.py and tools/bench_engine.py import without
    side effects and parse --help."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("gpu_check", "sglang_server_check", "bench_engine"):
        spec = importlib.util.spec_from_file_location(f"_tool_{name}", root / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert callable(mod.main)
    for name, flag in (("gpu_check", "--device"), ("sglang_server_check", "--port")):
        r = subprocess.run([sys.executable, str(root / "tools" / f"{name}.py"), "--help"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and flag in r.stdout, (name, r.stdout, r.stderr)


def test_sglang_command_lines_parse_with_sglangs_own_parser():
    """Single- and multi-node command lines as SGLang 0.5.23's ``prepare_server_args`` reads
    them (its own argparse: an unknown or misspelt flag fails here, not on the GPU node)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _sglang_import import load_io_struct

    load_io_struct()
    from sglang.srt.server_args import prepare_server_args

    one = make_engine(EngineConfig(backend="sglang", dtype="bf16", tensor_parallel_size=4, expert_parallel_size=2,
                                   sglang_args={"mem_fraction_static": 0.8}), "/models/m", 30001)
    a = prepare_server_args(one.command()[3:])
    assert (a.tp_size, a.ep_size, a.nnodes, a.node_rank, a.port, a.dtype) == (4, 2, 1, 0, 30001, "bfloat16")
    assert a.enable_return_routed_experts and a.mem_fraction_static == 0.8
    cfg = EngineConfig(backend="sglang", tensor_parallel_size=16, expert_parallel_size=16, nodes_per_engine=2)
    assert cfg.devices_per_engine_node == 8
    b = prepare_server_args(make_engine(cfg, "/m", 30002, node_rank=1, dist_init_addr="10.0.0.5:29600").command()[3:])
    assert (b.tp_size, b.nnodes, b.node_rank, b.dist_init_addr) == (16, 2, 1, "10.0.0.5:29600")
    with pytest.raises(ValueError, match="needs node rank 0's dist_init_addr"):
        make_engine(cfg, "/m", 30003).command()


@pytest.mark.parametrize("kw,match", [
    (dict(backend="sglang", tensor_parallel_size=8, nodes_per_engine=3), "nodes_per_engine=3 does not divide"),
    (dict(nodes_per_engine=2, devices_per_engine=2), "nodes_per_engine=2 with engine.backend='embedded'"),
    (dict(backend="sglang", sglang_args={"nnodes": 2}), "sglang_args.nnodes: set engine.nodes_per_engine"),
    (dict(backend="sglang", sglang_args={"dist_init_addr": "h:1"}), "sglang_args.dist_init_addr: set engine.nodes"),
    # the command line turns _ into -: the hyphenated spellings are the same flags (fresh-user finding)
    (dict(backend="sglang", sglang_args={"node-rank": 1}), "sglang_args.node-rank: set engine.nodes_per_engine"),
    (dict(backend="sglang", sglang_args={"tp-size": 8}), "sglang_args.tp-size: set engine.tensor_parallel_size"),
    (dict(nodes_per_engine=2), "nodes_per_engine=2 with engine.backend='embedded'"),
])
def test_nodes_per_engine_refusals(kw, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        EngineConfig(**kw)


# path -> statuses answered in order (the last one repeats); bodies of the 200s and errors
_SCRIPT = {"/get_model_info": [503, 503, 200], "/continue_generation": [503], "/generate": [500],
           "/flush_cache": [400], "/get_weight_version": [404], "/model_info": [200],
           "/init_weights_update_group": [503], "/weights_layout": [404], "/weights_checksum": [200],
           "/set_num_threads": [404]}
_BODY = {"/get_model_info": {"model_path": "m"}, "/model_info": {"weight_version": "7"},
         "/generate": {"error": {"message": "boom"}}, "/weights_checksum": {"weight_version": "3", "checksums": {}}}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_run_one_retry_and_recovery_policy(kind):
    """The async and the blocking client make the same requests and give the same answers:
    idempotent calls retried on 5xx up to ``retries`` attempts, ``generate`` and the
    weight-group collectives never on a 5xx, 400 from /flush_cache = False, 404 from
    /get_weight_version -> /model_info, /weights_layout and /set_num_threads 404 = None (SGLang), /health
    unreachable = False."""
    import asyncio
    import inspect

    import httpx

    from moe_async.engines.client import EngineClient, EngineRequestError, SyncEngineClient

    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path
        calls.append(path)
        if path == "/health":
            raise httpx.ConnectError("refused", request=req)
        statuses = _SCRIPT[path]
        status = statuses[min(calls.count(path), len(statuses)) - 1]
        return httpx.Response(status, json=_BODY.get(path, {}))

    cls, http = (SyncEngineClient, httpx.Client) if kind == "sync" else (EngineClient, httpx.AsyncClient)
    c = cls("http://engine", retries=3, backoff_s=0.0)
    c._http = http(base_url=c.base_url, transport=httpx.MockTransport(handler))

    def run(fn, *a, **kw):
        out = fn(*a, **kw)
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    def error(fn, *a):
        with pytest.raises(EngineRequestError) as e:
            run(fn, *a)
        return e.value.status_code, e.value.message

    assert run(c.get_model_info) == {"model_path": "m"}
    assert error(c.continue_generation) == (503, "{}")
    assert error(c.generate, [1, 2]) == (500, "boom")
    assert run(c.flush_cache) is False
    assert run(c.get_weight_version) == 7
    assert error(c.init_weights_update_group, "h", 1, 1, 2) == (503, "{}")
    assert run(c.weights_layout) is None
    assert run(c.weights_checksum) == {"weight_version": 3, "checksums": {}}
    assert run(c.health) is False
    assert run(c.set_num_threads, 2) is None
    assert calls == ["/get_model_info"] * 3 + ["/continue_generation"] * 3 + [
        "/generate", "/flush_cache", "/get_weight_version", "/model_info", "/init_weights_update_group",
        "/weights_layout", "/weights_checksum", "/health", "/set_num_threads"]
    # the client method shows the endpoint's own arguments (bound: without self)
    spec = inspect.signature(EngineClient.generate.spec)
    assert inspect.signature(c.generate) == spec.replace(parameters=list(spec.parameters.values())[1:])
    assert list(inspect.signature(c.generate).parameters)[:2] == ["input_ids", "sampling_params"]


def test_scoring_call_is_retried_after_a_dropped_connection():
    """A teacher's scoring call generates nothing: a keep-alive connection the server dropped
    (httpx.ReadError) is retried, not counted as a teacher failure; generate is not retried."""
    import httpx

    from moe_async.engines.client import SyncEngineClient

    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.path)
        if len(calls) == 1:
            raise httpx.ReadError("connection closed", request=req)
        # SGLang's shape: asked from logprob_start_len 1, the token at 1 has no logprob
        assert json.loads(req.content)["logprob_start_len"] == 1
        return httpx.Response(200, json={"meta_info": {"input_token_logprobs": [
            [None, 6, None], [-0.5, 7, None], [-1.5, 8, None]]}})

    c = SyncEngineClient("http://engine", retries=3, backoff_s=0.0)
    c._http = httpx.Client(base_url=c.base_url, transport=httpx.MockTransport(handler))
    out = c.score([5, 6, 7, 8], 2)
    assert calls == ["/generate", "/generate"] and out.token_logprobs == [-0.5, -1.5]
    calls.clear()
    with pytest.raises(httpx.ReadError):
        c.generate([5, 6], {"max_new_tokens": 1})
    assert calls == ["/generate"]
