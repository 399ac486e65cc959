"""trainer.lora validation: PEFT names, fused groups, refusals naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import ConfigError, load_config
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


# ------------------------------------------------- refused at config load, not after start-up
SMOKE = Path(__file__).resolve().parents[2] / "configs" / "cpu_smoke.yaml"
LORA = ["trainer.lora.rank=4"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.lora.dropout=0.1"], "trainer.lora.dropout=0.1 with trainer.lora.experts='per_expert': PEFT's"),
    (["trainer.lora.experts=shared", "trainer.expert_model_parallel_size=2"],
     "trainer.lora.experts='shared' with trainer.expert_model_parallel_size=2"),
    (["trainer.moe_grouped_gemm=true"], "trainer.lora.experts='per_expert' with trainer.moe_grouped_gemm=true"),
    (["trainer.expert_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2"],
     "trainer.lora.experts='per_expert' with trainer.expert_tensor_parallel_size=2"),
    (["weight_sync.senders=all"], "weight_sync.senders='all' with trainer.lora"),
])
def test_lora_combinations_refused_at_load(overrides, message):
    """These failed only inside the trainer actor (after model preparation and engine start-up)
    as a traceback, or (several senders) were silently ignored; now refused by the config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(SMOKE, LORA + overrides)
    if not any(o.startswith("trainer.lora") for o in overrides):
        try:  # the same without LoRA: not refused for LoRA's sake
            load_config(SMOKE, overrides)
        except ConfigError as e:
            assert "trainer.lora" not in str(e)


@pytest.mark.parametrize("overrides", [["trainer.lora.dropout=0.1", "trainer.lora.experts='off'"],
                                       ["trainer.expert_model_parallel_size=2", "trainer.lora.experts=per_expert"],
                                       ["trainer.pipeline_model_parallel_size=2"],
                                       ["trainer.expert_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2",
                                        "trainer.lora.experts='off'"]])
def test_lora_combinations_that_run_are_accepted(overrides):
    assert load_config(SMOKE, LORA + overrides).trainer.lora.rank == 4


def test_show_config_refuses_in_one_line_exit_2(capsys):
    assert main(["show-config", str(SMOKE), *LORA, "trainer.lora.dropout=0.1"]) == 2
    err = capsys.readouterr().err.splitlines()  # the config refusals' form: file, then the field's message
    assert err == [f"moe-async: invalid config {SMOKE}:", "  trainer.lora.dropout=0.1 with trainer.lora.experts="
                   "'per_expert': PEFT's adapters on fused expert parameters take no dropout; set dropout 0 or experts 'off'"]
