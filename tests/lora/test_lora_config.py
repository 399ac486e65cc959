"""trainer.lora validation: PEFT names, fused groups, refusals naming the field."""

from __future__ import annotations

import pytest

from moe_async.lora.config import LoraConfig
from moe_async.trainer.config import TrainerConfig


def test_defaults_and_scaling():
    c = LoraConfig(rank=8, alpha=32)
    assert c.scaling == 4.0 and c.experts == "per_expert"
    assert TrainerConfig(lora={"rank": 4, "target_modules": ["o_proj", "q_proj", "k_proj", "v_proj"]}).lora.target_modules \
        == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("bad, words", [
    ({"target_modules": ["q_proj"]}, "fuses"),
    ({"target_modules": ["gate_proj", "down_proj"]}, "up_proj"),
    ({"target_modules": ["w1"]}, "unknown"),
    ({"rank": 0}, "rank"),
    ({"experts": "all"}, "experts"),
    ({"ranks": 4}, "ranks"),
])
def test_refusals_name_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        TrainerConfig(lora=bad)
