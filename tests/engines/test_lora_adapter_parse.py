"""The embedded engine's reading of a PEFT adapter (``parse_peft``), against adapters written by
HF ``peft`` itself: the routed-expert wrappers are matched to their parameters whatever order
``target_parameters`` was saved in (PEFT keeps it as a set, so the order follows the hash seed),
and bad values are refused naming the field or tensor instead of loading or failing later."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from moe_async.engines.embedded.lora import LoraError, parse_peft

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "models"))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from _tiny import make_tiny_mixtral
    from safetensors.torch import load_file
    from test_embedded_lora import _peft_adapter
    from transformers import MixtralForCausalLM

    d = tmp_path_factory.mktemp("lora_parse")
    model_dir = make_tiny_mixtral(str(d / "model"), eos_token_id=255)
    _peft_adapter(model_dir, str(d / "a"), 3)
    with open(d / "a" / "adapter_config.json") as f:
        config = json.load(f)
    return config, load_file(str(d / "a" / "adapter_model.safetensors")), MixtralForCausalLM.from_pretrained(model_dir)


@pytest.mark.parametrize("order", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                   ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]])
def test_expert_adapters_found_in_either_saved_order(adapter, order):
    config, tensors, model = adapter
    assert sorted(config["target_parameters"]) == sorted(order)
    ad = parse_peft("a", dict(config, target_parameters=order), tensors, model, torch.float32)
    for path, by_param in ad.experts.items():
        mod = dict(model.named_modules())[path]
        assert sorted(by_param) == ["down_proj", "gate_up_proj"]
        for pname, (A, B) in by_param.items():
            E, out, inn = getattr(mod, pname).shape
            assert A.shape == (E, config["r"], inn) and B.shape == (E, out, config["r"])
    # the same tensors placed the same way in both orders
    other = parse_peft("b", dict(config, target_parameters=order[::-1]), tensors, model, torch.float32)
    for path in ad.experts:
        for pname in ("gate_up_proj", "down_proj"):
            assert all(torch.equal(x, y) for x, y in zip(ad.experts[path][pname], other.experts[path][pname]))


@pytest.mark.parametrize("field,value,message", [
    ("r", 0, "r=0 must be a positive integer"),
    ("lora_alpha", math.nan, "lora_alpha=nan must be finite"),
    ("alpha_pattern", {"q_proj": 800}, "alpha_pattern"),
    ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
])
def test_bad_config_values_refused_naming_the_field(adapter, field, value, message):
    config, tensors, model = adapter
    with pytest.raises(LoraError, match=message.replace("[", r"\[")):
        parse_peft("bad", dict(config, **{field: value}), tensors, model, torch.float32)


def test_non_finite_tensor_refused_naming_it(adapter):
    config, tensors, model = adapter
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    bad = dict(tensors)
    bad[key] = tensors[key].clone()
    bad[key].view(-1)[0] = float("nan")
    with pytest.raises(LoraError, match="non-finite"):
        parse_peft("bad", config, bad, model, torch.float32)
