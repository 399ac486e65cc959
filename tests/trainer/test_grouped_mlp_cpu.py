"""The grouped expert MLP as this host builds it (``trainer.moe_grouped_gemm=true`` without CUDA:
Megatron-Core's own legacy ``GroupedMLP`` over the compat grouped GEMM, nothing stood in) equals
the sequential expert MLP on the same weights (logprobs, loss, every gradient, the step: fp32
and bf16), and their torch_dist checkpoints load into each other bit-exact (weights and the plain
optimizer's state; the distributed optimizer's is refused across), Megatron-Core's strict load of the grouped model's own sharded state dict
from a sequential checkpoint finding every key; the HF export is the same. One process (see
_grouped_mlp_cpu_checks.py); the TE layout (``TEGroupedMLP``) is test_grouped_experts.py's."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import merged_json, run_json, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_grouped_mlp_cpu_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build of the grouped expert MLP")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("grouped_cpu"))


@pytest.fixture(scope="module")
def res(tmp):
    return run_json(SCRIPT, tmp, timeout=400)


def test_megatron_grouped_mlp_builds_here(res):
    assert "grouped_gemm" in res["mends"]
    for p in res["parity"].values():
        assert p["modules"] == ["megatron.core.transformer.moe.experts.SequentialMLP",
                                "megatron.core.transformer.moe.experts.GroupedMLP"]
        assert p["grp_params"] == [f"decoder.layers.{i}.mlp.experts.weight{w}" for i in (0, 1) for w in (1, 2)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_equals_sequential_on_the_same_weights(res, dtype):
    p = res["parity"][dtype]
    assert p["exports"][0] == p["exports"][1]  # the HF load into, and export from, either layout
    if dtype == "fp32":
        assert p["exports"][1] == res["src"]
    assert p["logprob_maxdiff"] == 0.0
    s, g = p["steps"]
    assert s["loss"] == g["loss"] and s["num_tokens"] == g["num_tokens"] == 26.0
    assert abs(s["grad_norm"] - g["grad_norm"]) <= 1e-6 * s["grad_norm"]  # summed in another order
    assert p["grad_names"] == 29 and p["grad_expert_names"] == 2 * 4 * 2 and p["grad_nan"] == 0
    assert p["grad_absmax"] > 0.1 and p["grad_maxdiff"] == 0.0  # every gradient element equal
    assert p["after_step_changed"] and p["after_step_maxdiff"] == 0.0


def test_moe_act_recompute_equal_gradients_less_memory(res):
    """``recompute_modules: [moe_act]`` (only the grouped expert MLP has it; compat mend 18 lets
    Megatron's CheckpointWithoutOutput run without TE): gradients bit-equal, fewer saved bytes."""
    r = res["recompute"]
    assert r["moe_act"]["modules"] == ["moe_act"] and r["moe_act"]["loss"] == r["none"]["loss"]
    assert r["moe_act"]["grad_maxdiff"] == 0.0
    assert r["moe_act"]["peak_bytes"] < r["none"]["peak_bytes"], r
    print(f"saved activations: none {r['none']['peak_bytes'] / 2**20:.3f} MiB, "
          f"moe_act {r['moe_act']['peak_bytes'] / 2**20:.3f} MiB")


def test_sequential_checkpoint_loads_into_grouped_bit_exact(res):
    assert res["grp_export_before_load"] == res["other"] != res["src"]
    assert res["grp_export"] == res["src"]
    assert res["ckpt_logprob_maxdiff"] == 0.0


def test_megatron_strict_load_of_grouped_sharded_state_dict(res):
    s = res["strict"]
    assert s["absent"] == [] and s["ckpt_only"] == [], (s["absent"][:5], s["ckpt_only"][:5])
    assert s["expert_keys"] == [f"decoder.layers.{i}.mlp.experts.weight{w}" for i in (0, 1) for w in (1, 2)]
    assert s["unequal"] == [] and s["equal"] == 17  # every tensor read back equals the loaded model's


def test_grouped_checkpoint_loads_into_sequential_and_steps_equal(res):
    assert res["grp_after_step1"] != res["src"] and res["grp_args_moe_grouped_gemm"] is True
    assert res["seq2_loaded"] == res["grp_after_step1"]  # weights
    a, b = res["seq2_step2"], res["grp_step2"]  # and the optimizer's state: the next step equal
    assert a["loss"] == b["loss"] and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    assert res["seq2_after_step2"] == res["grp_after_step2"]


def test_distributed_optimizer_state_across_the_expert_layout_is_refused(res):
    """Its buffers follow the parameters, so its state read across would land on other ones
    (measured: every tensor of the next step differed): refused naming the field, the trainer
    unchanged."""
    kind, msg = res["do_refusal"]
    assert kind == "UserInputError"
    assert ("saved with the grouped expert MLP and this trainer has trainer.moe_grouped_gemm=false; resume with "
            "trainer.moe_grouped_gemm=true") in msg
    assert res["do_after_refusal"] == res["other"]


@pytest.mark.slow
def test_across_expert_parallel_layouts(res, tmp):
    """EP2 (2 local experts per rank): the grouped layout loads the 1-process sequential
    checkpoint and the sequential layout the 1-process grouped one; a sequential process loads
    the EP2 grouped checkpoint. The 1-process interchange is proven by default above."""
    torchrun(2, SCRIPT, tmp, "ep2", timeout=400)
    r = merged_json(tmp, "ep2")
    assert r["ep2_local_experts"] == 2 and r["ep2_module"].endswith(".GroupedMLP")
    assert r["ep2_export"] == res["src"]
    assert max(abs(x - y) for u, v in zip(r["ep2_logprobs"], res["seq_logprobs"]) for x, y in zip(u, v)) <= 1e-6
    assert r["ep2_seq_from_grp_export"] == res["grp_after_step1"]
    back = run_json(SCRIPT, tmp, "from_ep2", timeout=300)
    assert back["seq_from_grp_ep2_export"] == res["src"]


@pytest.mark.slow
def test_a_run_with_the_grouped_expert_mlp(tmp_path):
    """``moe-async train`` (cpu_smoke) with ``trainer.moe_grouped_gemm=true``: 4 steps, the
    engine's weights equal the grouped trainer's export after the last sync. The export from the
    grouped layout is proven by default above (bit-equal to the sequential one's)."""
    from _launch import finished_train

    _, run_dir, summary, steps = finished_train(tmp_path / "out", "trainer.moe_grouped_gemm=true",
                                                f"model.cache_dir={tmp_path / 'cache'}")
    assert "moe_grouped_gemm: true" in (run_dir / "config.yaml").read_text()
    assert len(steps) >= 4 and summary["final_weight_version"] == 4
    assert summary["final_weights_match"] is True and summary["engine_weights_match"] == [True]
