"""Context parallelism: what the trainer still refuses, naming the field, before any process
group or model is built (no torchrun needed)."""

from __future__ import annotations

import pytest

from moe_async.trainer.config import TrainerConfig
from moe_async.trainer.megatron_trainer import MegatronTrainer


@pytest.mark.parametrize("kw, match", [
    (dict(router_replay="R2"), "router_replay='R2' with trainer.context_parallel_size=2"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     "virtual_pipeline_model_parallel_size with trainer.context_parallel_size=2"),
])
def test_refused_with_context_parallel(kw, match):
    with pytest.raises(ValueError, match=match):  # the config refuses it (show-config, train)
        TrainerConfig(context_parallel_size=2, **kw)
    cfg = TrainerConfig.model_construct(**{**TrainerConfig().model_dump(), "context_parallel_size": 2, **kw})
    with pytest.raises(NotImplementedError, match=match):  # and so does the trainer, given such a config
        MegatronTrainer(cfg, "/nonexistent-hf-dir")


def test_sequence_multiple():
    """Padded lengths: TP without CP; CP * lcm(2, TP) with CP (2*CP chunks, S/CP divisible by TP)."""
    from moe_async.trainer.batching import seq_multiple

    assert [seq_multiple(tp, cp) for tp, cp in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (1, 4)]] == [1, 2, 4, 4, 12, 8]
