"""Each CPU mend is still needed (the original fails) and works once applied (fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _launch import run_json

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="mends apply only without CUDA")


@pytest.fixture(scope="module")
def r():
    return run_json(os.path.join(os.path.dirname(__file__), "_compat_checks.py"), timeout=120)


def test_mends_still_needed(r):
    assert r["before_te_general_gemm_defined"] is False  # moe_utils.py NameError without TE
    assert r["before_stream"] is not None  # token_dispatcher.py torch.cuda.Stream()
    assert r["before_current_device"] is not None  # rotary/router/utils current_device()
    assert r["before_zeros_cuda"] is not None  # schedules/optimizer device="cuda"
    assert r["before_seed"] is not None  # tensor_parallel/random.py
    assert r["before_recompute_rng"] is not None  # random.py: recompute saves torch.cuda's RNG state
    assert r["before_move_numpy"] == "Tensor"  # moe_utils.maybe_move_tensor_to_cpu on CPU
    assert r["before_norm_sp"] == "AssertionError"  # torch_norm.py: no sequence parallel
    assert r["before_grouped_gemm"] is False  # grouped_gemm_util.py: GroupedMLP asserts the CUDA package
    assert r["before_jit_fuser"] == "compile"  # experts.py: GroupedMLP's activations via torch.compile
    assert r["before_cwo_fp8"] is True  # random.py: fp8=False turns FP8 on (then TE's NameError)


def test_applied_and_idempotent(r):
    assert r["apply1"] is True and r["apply2"] is True
    assert r["mends"] == ["rng_tracker", "cuda_streams", "current_device", "te_general_gemm",
                          "maybe_move_tensor_to_cpu", "torch_norm_sequence_parallel", "uneven_first_dim_gather",
                          "recompute_rng_state", "checkpoint_without_output_fp8", "hybrid_device_optimizer",
                          "dist_opt_torch_adam_step", "grouped_gemm", "megatron_jit_eager", "megatron_without_wandb", "cuda_to_cpu_mode"]
    assert r["modes_on_stack"] == 1


def test_mends_work(r):
    assert r["te_general_gemm"] and r["stream_ok"]
    assert r["current_device"] == "cpu"
    assert r["zeros_cuda_device"] == "cpu" and r["tensor_cuda_int"] == "cpu"
    assert r["to_cuda"] == "cpu,cpu" and r["pin"] is False
    assert r["type_name"] == "torch.cuda.FloatTensor"  # clip_grads.py / optimizer.py checks
    assert r["type_name_bf16"] == "torch.cuda.BFloat16Tensor" and r["type_cast_ok"]
    assert r["move_numpy"] == "ndarray" and r["move_numpy_utils"] == "ndarray"
    assert r["grouped_gemm"] == [True, True, True, "noop_decorator"]  # mend 17
    assert r["cwo_fp8"] == [False, True]  # mend 18
    assert r["jit_late"] == ["noop_decorator", True, False, False]  # mend 19, Megatron imported first


def test_megatron_jit_fuser_eager_when_compat_comes_first():
    """Mend 19 in the trainer's order (moe_async.compat, then Megatron): the router's and the
    fusions' jit_fuser functions are plain functions and neither dynamo nor inductor is imported
    (each cost a trainer process ~3.7 s of CPU)."""
    code = ("import sys, json, moe_async.compat\n"
            "from megatron.core.transformer.moe.router import TopKRouter\n"
            "from megatron.core.fusions import fused_bias_geglu as g\n"
            "print(json.dumps([type(TopKRouter.__dict__['_apply_expert_bias']).__name__,"
            " type(g.geglu).__name__, 'torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["function", "function", False, False]


def test_megatron_imports_no_wandb_but_others_still_do():
    """Mend 20: after moe_async.compat, Megatron's modules that import wandb when installed
    (timers, the inference context) get their fallback (None); an import of wandb from
    anywhere else still works and is the real package."""
    code = ("import sys, json, moe_async.compat\n"
            "from megatron.core import timers\n"
            "from megatron.core.inference.contexts import dynamic_context as dc\n"
            "seen = 'wandb' in sys.modules\n"
            "import wandb\n"
            "print(json.dumps([timers.wandb is None, dc.HAVE_WANDB, seen, hasattr(wandb, 'init')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, False, True]


def test_cpu_rng_tracker(r):
    assert r["tracker_cls"] == "CpuRNGStatesTracker"
    assert r["fork_restores_outer"] and r["fork_advances"] and r["fork_reproducible"]


def test_torch_norm_sequence_parallel(r):
    """Mend 8: the torch RMSNorm is built under sequence parallelism, its params are marked
    ``sequence_parallel`` (so finalize_model_grads sums their grads over TP), the math is the
    plain norm's, and a norm built without sequence parallelism is not marked."""
    assert r["norm_sp_type"] == "RMSNorm"
    assert r["norm_sp_marked"] == [True] and r["norm_plain_marked"] == [None]
    assert r["norm_sp_cfg_untouched"] and r["norm_sp_same_math"]
