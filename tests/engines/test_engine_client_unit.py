"""Client parsing and engine command lines (no server needed)."""

from __future__ import annotations

import base64
import sys

import numpy as np
import pytest

from moe_async.engines.base import EmbeddedEngine, SGLangEngine, make_engine
from moe_async.engines.client import parse_generate
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
    """tools/gpu_check.py and tools/bench_engine.py import without side effects and parse --help."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("gpu_check", "bench_engine"):
        spec = importlib.util.spec_from_file_location(f"_tool_{name}", root / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert callable(mod.main)
    r = subprocess.run([sys.executable, str(root / "tools" / "gpu_check.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--port" in r.stdout
