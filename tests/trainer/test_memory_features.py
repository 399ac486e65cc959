"""Megatron-Core's activation recompute and optimizer CPU offload through MegatronTrainer (1 CPU
process, gloo; one subprocess runs every check: tests/trainer/_memory_checks.py).

Recompute: full (uniform and block) and selective (Megatron's default core_attn, and core_attn +
moe) give the gradient of no recompute (every parameter's main_grad within 1e-6 relative;
measured bit-equal) and hold less activation memory for the backward (autograd's saved tensors,
parameters excluded; figures printed). Optimizer offload: HybridDeviceOptimizer (fraction 1 and
0.5) steps equal the on-device distributed optimizer's over 3 steps. Without CUDA both sides are
host memory: what is tested is the offload code path (grads copied to the host copies, the host
Adam step, the copy back), not a saving of device memory.
"""

from __future__ import annotations

import os

import pytest
from _launch import cpu_check_json

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return cpu_check_json(os.path.join(HERE, "_memory_checks.py"), str(tmp_path_factory.mktemp("mem")), timeout=300)


@pytest.mark.parametrize("mode", ["full_uniform", "full_block", "selective", "selective_moe"])
def test_recompute_gradients_equal_and_activations_lower(res, mode):
    r, base = res["recompute"][mode], res["recompute"]["none"]
    print(f"saved activations, peak: {mode} {r['peak_bytes'] / 2**20:.2f} MiB vs no recompute "
          f"{base['peak_bytes'] / 2**20:.2f} MiB ({r['peak_bytes'] / base['peak_bytes']:.2f}x)")
    assert r["tf"][0] == mode.split("_")[0]  # the setting reached Megatron's TransformerConfig
    assert r["n"] > 200_000 and r["grad_rel"] <= 1e-6
    assert abs(r["loss"] - base["loss"]) <= 1e-6 * abs(base["loss"])
    assert abs(r["grad_norm"] - base["grad_norm"]) <= 1e-6 * base["grad_norm"]
    assert r["peak_bytes"] < base["peak_bytes"]


def test_recompute_savings_order(res):
    """Full recompute keeps only layer inputs: less than selective core_attn, which keeps the
    MLP's activations; recomputing the MoE layer too lands in between."""
    rc = res["recompute"]
    assert rc["full_uniform"]["peak_bytes"] < rc["selective_moe"]["peak_bytes"] < rc["selective"]["peak_bytes"]
    assert rc["full_uniform"]["peak_bytes"] <= 0.6 * rc["none"]["peak_bytes"]


@pytest.mark.parametrize("mode", ["offload", "offload_half"])
def test_optimizer_offload_steps_equal_device_optimizer(res, mode):
    o, d = res["offload"][mode], res["offload"]["device"]
    assert o["hybrid"] == 2  # dense and expert optimizers are HybridDeviceOptimizers
    assert d["hybrid"] == 0
    for a, b in zip(o["loss"], d["loss"]):
        assert abs(a - b) <= 1e-6 * max(abs(b), 1e-3), (a, b)
    assert o["w_max_abs"] <= 1e-6  # every weight after 3 steps
    # the grad norms of steps 2-3 follow weights that differ by the rounding of Megatron's two
    # Adams (host: torch AdamW fused=True; device: torch AdamW): measured 3.6e-6 relative at step 3
    assert o["grad_norm"][0] == d["grad_norm"][0]
    for a, b in zip(o["grad_norm"], d["grad_norm"]):
        assert abs(a - b) <= 1e-5 * b, (a, b)


def test_offload_fraction_moves_that_share_to_host_copies(res):
    full, half = res["offload"]["offload"], res["offload"]["offload_half"]
    assert full["host_numel"] == full["shard_numel"]
    assert 0.4 <= half["host_numel"] / half["shard_numel"] <= 0.6
    assert full["cpu_optimizers"] >= 1 and half["cpu_optimizers"] >= 1


def test_memory_settings_are_checked():
    from pydantic import ValidationError

    from moe_async.trainer.config import TrainerConfig

    with pytest.raises(ValidationError, match="recompute_method"):
        TrainerConfig(recompute_granularity="full")
    with pytest.raises(ValidationError, match="recompute_granularity='selective'"):
        TrainerConfig(recompute_modules=["core_attn"])
    with pytest.raises(ValidationError, match="use_distributed_optimizer"):
        TrainerConfig(optimizer_cpu_offload=True)
    with pytest.raises(ValidationError, match="recompute_modules"):
        TrainerConfig(recompute_granularity="selective", recompute_modules=["attention"])
    with pytest.raises(ValidationError, match="'moe_act' needs trainer.moe_grouped_gemm=true"):
        TrainerConfig(recompute_granularity="selective", recompute_modules=["moe_act"])
    with pytest.raises(ValidationError, match="router_replay"):
        TrainerConfig(moe_expert_capacity_factor=1.0, router_replay="R3")


def test_unavailable_kernels_are_refused_naming_the_field(monkeypatch):
    """Where CUDA / DeepEP are absent (this machine): the flex dispatcher is refused before any
    model is built, naming the field. The grouped expert MLP builds here (the legacy GroupedMLP
    over the compat grouped GEMM); on a CUDA host with neither Transformer Engine nor the
    grouped_gemm package it is refused, naming the field."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("refusals of the CPU host")
    from moe_async.trainer.moe_kernels import check_flex_dispatcher, check_grouped_gemm, grouped_gemm_available

    with pytest.raises(ValueError, match="trainer.moe_token_dispatcher_type='flex' needs CUDA"):
        check_flex_dispatcher()
    assert grouped_gemm_available() is True
    check_grouped_gemm()  # no error without CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA host without TE / grouped_gemm
    assert grouped_gemm_available() is False
    with pytest.raises(ValueError, match=r"trainer.moe_grouped_gemm=true needs Transformer Engine .* or the "
                                         r"grouped_gemm package .* on a CUDA host"):
        check_grouped_gemm()


def test_dispatcher_and_expert_capacity(res):
    """allgather gives alltoall's gradient; a capacity of 2x the balanced share (4 experts, top-2:
    every token at most once per expert, so no expert can get more) drops nothing, padded to capacity or not; a capacity of 0.5x drops
    tokens (by probability or by position), which changes the gradient."""
    d = res["dispatch"]
    assert d["allgather"]["tf"][0] == "allgather" and d["allgather"]["grad_rel"] <= 1e-6
    for k in ("capacity_no_drop", "capacity_padded"):
        assert d[k]["tf"][1] == 2.0 and d[k]["grad_rel"] <= 1e-6, k
    for k, policy in (("capacity_drop", "probs"), ("capacity_drop_position", "position")):
        assert d[k]["tf"][1:] == [0.5, policy] and d[k]["grad_rel"] > 1e-3, k
    assert d["capacity_drop"]["grad_rel"] != d["capacity_drop_position"]["grad_rel"]
