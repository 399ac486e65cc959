"""tools/sglang_server_check.py without a GPU: importing it starts nothing, its arguments parse (bad
ones refused naming the flag), the transport follows the visible GPUs (NCCL never with two
ranks on one device), the read-back comparison is exact, and the summary is one JSON line."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _tool():
    spec = importlib.util.spec_from_file_location("sglang_server_check", os.path.join(ROOT, "tools", "sglang_server_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_transport_choice(capsys):
    g = _tool()
    a = g.parse_args([])
    assert (a.transport, a.compare_rows, a.port) == ("auto", 4, 30000)
    assert g.parse_args(["--transport", "tensor", "--compare-rows", "2"]).compare_rows == 2
    with pytest.raises(SystemExit):
        g.parse_args(["--transport", "gloo"])
    with pytest.raises(SystemExit):
        g.parse_args(["--compare-rows", "0"])
    assert "--compare-rows must be >= 1" in capsys.readouterr().err
    assert g.pick_transport("auto", 1) == ("tensor", 0)
    assert g.pick_transport("auto", 2) == ("nccl", 1)
    assert g.pick_transport("tensor", 8) == ("tensor", 0)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one device"):
        g.pick_transport("nccl", 1)
    with pytest.raises(ValueError, match="no CUDA device"):
        g.pick_transport("auto", 0)


def test_compare_weights_is_exact():
    g = _tool()
    t = torch.tensor([[1.0, 2.0], [3.0, 1.0 + 2**-10], [5.0, 6.0]])  # 1 + 2^-10 rounds to 1 in bf16
    bf = t[:2].to(torch.bfloat16).float().tolist()
    replies = {"a": bf, "b": None, "c": [[1.0, 2.0], [3.0, 1.5]]}
    res = g.compare_weights(replies.get, {"a": t, "b": t, "c": t}, torch.bfloat16, 2)
    assert res["a"] == "equal" and res["b"] == "unsupported"
    assert res["c"].startswith("differs: max abs diff 0.5")
    assert g.compare_weights(replies.get, {"a": t}, torch.float32, 2)["a"].startswith("differs")


def test_summary_is_one_json_line(capsys):
    g = _tool()
    ck = g.Checks()
    ck.run("one", lambda: 1)

    def skip():
        raise g.SkipCheck("nothing to read")

    ck.run("two", skip)
    with pytest.raises(SystemExit) as e:
        ck.run("three", lambda: 1 / 0)
    assert e.value.code == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: v["result"] for k, v in last.items()} == {"one": "pass", "two": "skip", "three": "fail"}
    assert last["two"]["note"] == "nothing to read" and "ZeroDivisionError" in last["three"]["note"]
    assert all(v["seconds"] >= 0 for v in last.values())
