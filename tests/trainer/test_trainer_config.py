"""Trainer config: layouts this trainer cannot run are refused at load, naming the field and
the reason."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from moe_async.trainer.config import TrainerConfig


def test_virtual_pipeline_needs_pipeline_parallelism():
    with pytest.raises(ValidationError, match="virtual_pipeline_model_parallel_size=2 needs "
                                              "trainer.pipeline_model_parallel_size > 1 .got 1."):
        TrainerConfig(virtual_pipeline_model_parallel_size=2)
    assert TrainerConfig(pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2).virtual_pipeline_model_parallel_size == 2
    assert TrainerConfig(virtual_pipeline_model_parallel_size=1).virtual_pipeline_model_parallel_size == 1


def test_context_parallel_needs_transformer_engine_with_cuda(monkeypatch):
    """CP > 1 with CUDA but without Transformer Engine is refused (Megatron's local attention
    asserts CP == 1); without CUDA it validates (the CPU path's compat CP attention)."""
    import moe_async.trainer.config as tc

    if not torch.cuda.is_available():
        assert TrainerConfig(context_parallel_size=2).context_parallel_size == 2
    monkeypatch.setattr(tc, "_cuda_available", lambda: True)
    monkeypatch.setattr(tc, "_have_transformer_engine", lambda: False)
    with pytest.raises(ValidationError, match="context_parallel_size=2 with CUDA needs Transformer Engine.*dot_product_attention"):
        TrainerConfig(context_parallel_size=2)


def test_distributed_optimizer_switch():
    assert TrainerConfig().use_distributed_optimizer is False
    assert TrainerConfig(use_distributed_optimizer=True).use_distributed_optimizer is True


def test_token_budget_padded_pp_allowed_not_with_vpp():
    import pytest as _pt
    from pydantic import ValidationError

    from moe_async.trainer.config import TrainerConfig

    assert TrainerConfig(max_tokens_per_micro_batch=4096).max_tokens_per_micro_batch == 4096
    # padded at PP > 1: one [B, S] shape per step (parity in tests/trainer/test_layouts.py)
    assert TrainerConfig(max_tokens_per_micro_batch=4096, pipeline_model_parallel_size=2,
                         sequence_packing="padded").max_tokens_per_micro_batch == 4096
    with _pt.raises(ValidationError, match="trainer.max_tokens_per_micro_batch=4096 with"):
        TrainerConfig(max_tokens_per_micro_batch=4096, pipeline_model_parallel_size=2, sequence_packing="padded",
                      virtual_pipeline_model_parallel_size=2)
    with _pt.raises(ValidationError, match="max_tokens_per_micro_batch"):
        TrainerConfig(max_tokens_per_micro_batch=0)


def test_fully_reshardable_needs_distributed_optimizer():
    import pytest as _pt
    from pydantic import ValidationError

    from moe_async.trainer.config import TrainerConfig

    TrainerConfig(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
    with _pt.raises(ValidationError, match="dist_ckpt_optim_fully_reshardable=true needs trainer.use_distributed_optimizer"):
        TrainerConfig(dist_ckpt_optim_fully_reshardable=True)


def test_sequence_packing_field_and_refusals(monkeypatch):
    """trainer.sequence_packing: 'auto' (default) resolves to 'thd' only with CUDA + Transformer
    Engine and CP 1, else 'padded'; 'thd' with CP > 1 is refused naming both fields; 'thd' with CUDA
    but without TE is refused (Megatron's local attention refuses packed_seq_params); the token
    budget runs at PP > 1 with 'thd' only."""
    import moe_async.trainer.config as tc

    assert TrainerConfig().sequence_packing == "auto"
    with pytest.raises(ValidationError, match="sequence_packing"):
        TrainerConfig(sequence_packing="bshd")
    with pytest.raises(ValidationError, match="sequence_packing='thd' with trainer.context_parallel_size=2"):
        TrainerConfig(sequence_packing="thd", context_parallel_size=2)
    assert TrainerConfig(sequence_packing="thd", max_tokens_per_micro_batch=512,
                         pipeline_model_parallel_size=2).max_tokens_per_micro_batch == 512
    if not torch.cuda.is_available():
        assert tc.resolve_sequence_packing("auto") == "padded"
        assert TrainerConfig(sequence_packing="thd").sequence_packing == "thd"
    assert tc.resolve_sequence_packing("padded") == "padded"
    monkeypatch.setattr(tc, "_cuda_available", lambda: True)
    monkeypatch.setattr(tc, "_have_transformer_engine", lambda: True)
    assert tc.resolve_sequence_packing("auto") == "thd"
    assert tc.resolve_sequence_packing("auto", context_parallel_size=2) == "padded"
    monkeypatch.setattr(tc, "_have_transformer_engine", lambda: False)
    assert tc.resolve_sequence_packing("auto") == "padded"
    with pytest.raises(ValidationError, match="sequence_packing='thd' with CUDA needs Transformer Engine"):
        TrainerConfig(sequence_packing="thd")
    # a config validated on a CPU-only host, run on a CUDA host without TE: the trainer's own
    # resolve (MegatronTrainer.__init__) refuses it too
    with pytest.raises(ValueError, match="sequence_packing='thd' with CUDA needs Transformer Engine"):
        tc.resolve_sequence_packing("thd")
