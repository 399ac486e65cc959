"""Virtual pipeline stages: combinations Megatron-Core (or this trainer) does not run are refused
by ``MegatronTrainer`` before any process group is created, naming the field. (The layouts that
run are checked in tests/trainer/test_layouts.py: PP2+VPP2 and PP2+VPP2+EP2 equal 1 process.)"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from _tiny import make_tiny_mixtral
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    tmp = tmp_path_factory.mktemp("vpp")
    return {"l2": make_tiny_mixtral(str(tmp / "l2")),
            "l4": make_tiny_mixtral(str(tmp / "l4"), num_hidden_layers=4),
            "ds3": make_tiny_deepseek_v3(str(tmp / "ds3"), num_hidden_layers=4)}


def _trainer(path, construct=False, **kw):
    """MegatronTrainer at PP2 + VPP2 (+ kw); ``construct``: the config not validated
    (``model_construct``), to reach the trainer's own checks of what the config refuses."""
    import torch.distributed as dist

    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    kw = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, **kw)
    cfg = (TrainerConfig.model_construct(**{**TrainerConfig().model_dump(), **kw}) if construct
           else TrainerConfig(**kw))
    try:
        return MegatronTrainer(cfg, path)
    finally:
        assert not dist.is_initialized()  # refused before torch.distributed was touched


def test_layers_not_divisible_by_pp_times_vpp(ckpts):
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2: the model's 2 layers are "
                                         r"not divisible by .* = 4"):
        _trainer(ckpts["l2"])


def test_router_replay_r2_refused(ckpts):
    """R2 needs PP1 (its recording forward); R3 at PP2+VPP2: tests/replay/test_replay_layouts.py."""
    with pytest.raises(ValueError, match=r"router_replay='R2' with trainer.virtual_pipeline"):  # the config
        _trainer(ckpts["l4"], router_replay="R2")
    with pytest.raises(NotImplementedError, match=r"router_replay='R2' with trainer.virtual_pipeline"):
        _trainer(ckpts["l4"], construct=True, router_replay="R2")


def test_deepseek_v3_vp_stage_needs_virtual_pipeline(ckpts):
    """deepseek_v3's block spec is sliced per model chunk (PP2+VPP2 equals 1 process:
    tests/models/test_family_layouts.py); a vp_stage without virtual pipeline stages is refused."""
    import json

    from moe_async.models.deepseek_v3 import DEEPSEEK_V3

    with open(os.path.join(ckpts["ds3"], "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=r"vp_stage=0 with virtual pipeline world size None"):
        DEEPSEEK_V3.layer_spec(hf, vp_stage=0)


def test_router_replay_r2_with_pp_refused_by_the_config():
    """R2 at PP2 (no VPP) is refused when the config is read (show-config, train), naming both
    fields, not only in the first train step (fresh-user finding); R3 at PP2 is accepted."""
    from moe_async.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match=r"router_replay='R2' with trainer.pipeline_model_parallel_size=2"):
        TrainerConfig(pipeline_model_parallel_size=2, router_replay="R2")
    assert TrainerConfig(pipeline_model_parallel_size=2, router_replay="R3").router_replay == "R3"
