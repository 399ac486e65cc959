"""A model-only checkpoint from tools/convert_hf_to_megatron.py (TP2) loads into
MegatronTrainer at another layout (EP2): the model is loaded, the optimizer starts fresh
(Megatron-LM's --no-load-optim / --finetune behaviour), the logprobs equal transformers'
on the source HF checkpoint, and one step equals the step of a trainer built from that HF
checkpoint directly. One 2-process torchrun (see _load_converted_checks.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_load_converted_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("load_converted"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_addr=127.0.0.1", f"--master_port={port}", SCRIPT, tmp],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-6000:])
    with open(os.path.join(tmp, "load_converted.json")) as f:
        return json.load(f)


def test_converted_checkpoint_is_model_only(res):
    assert "moe_async_convert.json" in res["ckpt_files"] and "moe_async_version.txt" not in res["ckpt_files"]


def test_logprobs_equal_hf_after_load(res):
    assert res["before_load_maxdiff"] > 0.1  # the trainer started from other weights
    assert res["lens_ok"]
    assert res["maxdiff"] <= 1e-5, res["maxdiff"]
    assert res["direct_maxdiff"] <= 1e-5


def test_optimizer_starts_fresh_and_says_so(res):
    assert res["version_after_load"] == 0
    assert len(res["log"]) >= 1 and "loaded the model only" in res["log"][0]


def test_step_equals_trainer_built_from_hf(res):
    a, b = res["step_loaded"], res["step_direct"]
    for k in ("loss", "grad_norm", "num_tokens", "kl_k3"):
        assert abs(a[k] - b[k]) <= 1e-6 * max(abs(a[k]), abs(b[k]), 1e-12), (k, a[k], b[k])
    assert a["grad_norm"] > 0
    assert res["same_after_step"] and res["n_tensors"] > 10
    assert res["version_after_step"] == 1


def test_missing_model_key_is_named(res):
    assert res["missing_error"] is not None and "decoder.final_layernorm.weight" in res["missing_error"]


def test_vocab_padding_mismatch_is_named(res):
    e = res["vocab_error"]
    assert e is not None and "make_vocab_size_divisible_by" in e and "256" in e and "288" in e


def test_trainer_checkpoint_converts_back_to_hf(res):
    """MegatronTrainer.save_checkpoint (with chained optimizer state) -> HF: the trainer's
    exported tensors, bit for bit (checksums)."""
    assert res["trained_to_hf_equal"]
