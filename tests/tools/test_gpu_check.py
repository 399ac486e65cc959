"""tools/gpu_check.py: its CPU dry run (the same steps with ``--device cpu``) passes every step
and ends with one JSON line; SGLang's FlattenedTensorBucket is found in an installed sglang, a
loose ``tensor_bucket.py`` or an sglang wheel; a bucket that rebuilds a tensor wrong is caught;
``--device cuda`` without a GPU exits 2 having checked nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _tool()
STEPS = ["load SGLang FlattenedTensorBucket", "tiny model", "fp32 reference step (cpu)", "HF export",
         "bf16 train step", "FlattenedTensorBucket rebuilds every tensor",
         "engine sync over TensorTransport + greedy equals HF", "checkpoint round trip"]


def test_cpu_dry_run_passes_every_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "out.txt", "w") as out:  # a file, not a pipe: the engine's children inherit it
        p = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--work-dir", str(tmp_path / "w")],
                           stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=1200)
    text = (tmp_path / "out.txt").read_text()
    assert p.returncode == 0, text[-6000:]
    res = json.loads(text.strip().splitlines()[-1])
    assert list(res["steps"]) == STEPS and {s["result"] for s in res["steps"].values()} == {"pass"}
    assert res["device"] == "cpu" and res["gpu"] is None
    ref, loss = res["reference_loss"], res["loss"]
    assert loss != ref and abs(loss - ref) <= G.LOSS_RTOL * max(1.0, abs(ref))  # bf16 is not fp32, but close
    assert res["buckets"] > 1 and res["export"].startswith("41 tensors on cpu")
    assert res["engine"].startswith("engine on cpu, "), res["engine"]  # engine.device follows --device
    assert (tmp_path / "w" / "ckpt").is_dir()


def _bucket_source() -> str:
    return (Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "weight_sync"
            / "tensor_bucket.py").read_text()


def _named():
    g = torch.Generator().manual_seed(3)
    return [("a", torch.randn(300, generator=g)), ("b", torch.randn(7, 9, generator=g).to(torch.bfloat16)),
            ("c", torch.randint(0, 9, (5,), generator=g)), ("d", torch.randn(40, 40, generator=g))]


def test_tensor_bucket_from_sglang_a_file_or_a_wheel(tmp_path):
    named = _named()
    loose = tmp_path / "tensor_bucket.py"
    loose.write_text(_bucket_source())
    wheel = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(G.TENSOR_BUCKET_IN_WHEEL, _bucket_source())
    for where in (None, loose, wheel):
        cls = G.load_tensor_bucket(where)
        assert cls.__name__ == "FlattenedTensorBucket"
        assert G.bucket_round_trip(cls, named, 2048) == 4  # one dtype each: a (1200 B); d (6400 B) alone; b; c
    with pytest.raises(FileNotFoundError, match="make gpu-check-wheels"):
        G.load_tensor_bucket(tmp_path / "nope.py")


def test_a_bucket_that_rebuilds_wrong_is_caught():
    cls = G.load_tensor_bucket()

    class Corrupting(cls):
        def reconstruct_tensors(self):
            out = super().reconstruct_tensors()
            out[-1] = (out[-1][0], out[-1][1] + 1)
            return out

    with pytest.raises(AssertionError, match="d: rebuilt"):
        G.bucket_round_trip(Corrupting, _named(), 1 << 20)


def test_cuda_without_a_gpu_checks_nothing():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(TOOL), "--device", "cuda"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 2 and "no CUDA device visible" in p.stdout, p.stdout + p.stderr
    with pytest.raises(SystemExit):
        G.parse_args(["--startup-timeout", "0"])
