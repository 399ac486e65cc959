"""The grouped expert MLP (``trainer.moe_grouped_gemm=true``) built here by the product path
(Megatron-Core's ``TEGroupedMLP`` from ``TESpecProvider``, only Transformer Engine's
``GroupedLinear`` stood in by plain torch) is interchangeable with the sequential expert MLP: a
checkpoint of either loads into the other bit-exact (model and optimizer), Megatron-Core's strict
``dist_checkpointing`` load of the grouped model's own sharded state dict from a sequential
checkpoint finds every key, and both give the same logprobs, steps and HF export. One process
(see _grouped_experts_checks.py)."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import merged_json, run_json, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_grouped_experts_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU check with Transformer Engine stood in")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("grouped"))


@pytest.fixture(scope="module")
def res(tmp):
    return run_json(SCRIPT, tmp, timeout=400)


def test_product_path_builds_megatron_grouped_mlp(res):
    assert res["seq_modules"][0] == "megatron.core.transformer.moe.experts.SequentialMLP"
    mte = "megatron.core.extensions.transformer_engine.TEGroupedLinear"  # Megatron's class, over the stand-in
    assert res["grp_modules"] == ["megatron.core.transformer.moe.experts.TEGroupedMLP",
                                  f"linear_fc1: {mte}", f"linear_fc2: {mte}"], res["grp_modules"]


def test_sequential_checkpoint_loads_into_grouped_bit_exact(res):
    assert res["grp_export_before_load"] == res["other"] != res["src"]  # HF load + export of the grouped layout
    assert res["seq_export"] == res["src"] and res["grp_export"] == res["src"]
    assert res["logprob_maxdiff"] == 0.0, res["logprob_maxdiff"]


def test_megatron_strict_load_of_grouped_sharded_state_dict(res):
    s = res["strict"]
    assert s["absent"] == [] and s["ckpt_only"] == [], (s["absent"][:5], s["ckpt_only"][:5])
    assert any(k.endswith("linear_fc1.weight3") for k in s["expert_keys"]), s["expert_keys"][:8]
    assert len(s["expert_keys"]) == 2 * 2 * 4  # 2 layers x fc1/fc2 x 4 experts, each its own tensor
    assert s["unequal"] == [] and s["equal"] >= len(s["expert_keys"])  # read back equal to the loaded model


def test_grouped_checkpoint_loads_into_sequential_and_steps_equal(res):
    assert res["grp_after_step1"] != res["src"]
    assert res["grp_args_moe_grouped_gemm"] is True  # Megatron-LM's args say which layout saved it
    assert res["seq2_loaded"] == res["grp_after_step1"]
    a, b = res["seq2_step2"], res["grp_step2"]
    for k in ("loss", "grad_norm", "num_tokens"):
        assert abs(a[k] - b[k]) <= 1e-6 * max(abs(a[k]), 1e-12), (k, a[k], b[k])
    assert res["seq2_after_step2"] == res["grp_after_step2"]


@pytest.mark.slow
def test_grouped_at_ep2_loads_sequential_checkpoint(res, tmp):
    """EP2 (2 local experts per rank: local index != global index) loads the 1-process
    sequential checkpoint: the same export and logprobs."""
    torchrun(2, SCRIPT, tmp, "ep2", timeout=400)
    r = merged_json(tmp, "ep2")
    assert r["ep2_local_experts"] == 2
    assert r["ep2_export"] == res["src"]
    assert max(abs(x - y) for u, v in zip(r["ep2_logprobs"], res["seq_logprobs"]) for x, y in zip(u, v)) <= 1e-6
