"""A model-only checkpoint from tools/convert_hf_to_megatron.py (TP2) loads into
MegatronTrainer at another layout (EP2): the model is loaded, the optimizer starts fresh
(Megatron-LM's --no-load-optim / --finetune behaviour), the logprobs equal transformers'
on the source HF checkpoint, and one step equals the step of a trainer built from that HF
checkpoint directly. One 2-process torchrun (see _load_converted_checks.py)."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import merged_json, torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_load_converted_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("load_converted"))
    torchrun(2, SCRIPT, tmp, timeout=300)
    return merged_json(tmp, "load_converted")


def test_converted_checkpoint_is_model_only(res):
    assert "moe_async_convert.json" in res["ckpt_files"] and "moe_async_version.txt" not in res["ckpt_files"]
    assert res["ckpt_root_files"] == ["iter_0000000", "latest_checkpointed_iteration.txt"]  # Megatron-LM's container


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
