"""Trainer config: layouts this trainer cannot run are refused at load, naming the field and
the reason."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from moe_async.trainer.config import TrainerConfig, _have_transformer_engine


def test_virtual_pipeline_needs_pipeline_parallelism():
    with pytest.raises(ValidationError, match="virtual_pipeline_model_parallel_size=2 needs "
                                              "trainer.pipeline_model_parallel_size > 1 .got 1."):
        TrainerConfig(virtual_pipeline_model_parallel_size=2)
    assert TrainerConfig(pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2).virtual_pipeline_model_parallel_size == 2
    assert TrainerConfig(virtual_pipeline_model_parallel_size=1).virtual_pipeline_model_parallel_size == 1


@pytest.mark.skipif(torch.cuda.is_available() and _have_transformer_engine(), reason="TE present")
def test_context_parallel_needs_transformer_engine():
    with pytest.raises(ValidationError, match="context_parallel_size=2 needs Transformer Engine.*dot_product_attention"):
        TrainerConfig(context_parallel_size=2)


def test_distributed_optimizer_switch():
    assert TrainerConfig().use_distributed_optimizer is False
    assert TrainerConfig(use_distributed_optimizer=True).use_distributed_optimizer is True
