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


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_tensor_refused_naming_it(adapter, value):
    """Separate tensors, and one received bucket (every tensor a view of one buffer, checked in
    one pass): NaN and +-inf anywhere are refused, naming the tensor."""
    from moe_async.engines.embedded.lora_routes import decode_adapter_tensors
    from moe_async.weight_sync.lora_sync import lora_bucket_entries

    config, tensors, model = adapter
    key = sorted(k for k in tensors if "lora_B" in k)[-1]
    bad = {k: v.clone() for k, v in tensors.items()}
    bad[key].view(-1)[-1] = value
    entries, _flat = lora_bucket_entries(bad)
    bucket, _storage = decode_adapter_tensors(entries[0], "flattened_bucket")
    for ts in (bad, bucket):
        with pytest.raises(LoraError, match=f"tensor {key.replace('.', '[.]')} holds non-finite values"):
            parse_peft("bad", config, ts, model, torch.float32)
    parse_peft("good", config, decode_adapter_tensors(lora_bucket_entries(tensors)[0][0], "flattened_bucket")[0],
               model, torch.float32)


def test_received_adapter_views_the_sender_until_unloaded_then_a_held_one_is_copied(adapter):
    """A received bucket is not copied: the adapter views the sender's shared memory (as SGLang
    keeps the tensors it is given). An unload while a request still holds the adapter copies it
    out first (the sender may rewrite its memory once the unload answered); an unload of an
    adapter no request holds just drops it."""
    from moe_async.engines.embedded.lora import EngineLora
    from moe_async.engines.embedded.lora_routes import decode_adapter_tensors
    from moe_async.weight_sync.lora_sync import lora_bucket_entries

    config, tensors, model = adapter
    lora = EngineLora(model)
    entries, flat = lora_bucket_entries(tensors)

    def load(name: str):
        ts, bucket = decode_adapter_tensors(entries[0], "flattened_bucket")
        ad = parse_peft(name, config, ts, model, torch.float32, lora.modules)
        assert bucket is not None and ad.views(bucket) and ad.views(flat)  # the sender's memory itself
        ad.sender = bucket
        lora.load(ad)
        return ad

    v1, v2 = load("v1"), load("v2")
    lora.acquire("v1")  # a request runs on v1
    assert lora.unload("v1") is False and not v1.views(flat) and v1.sender is None  # copied out
    assert lora.unload("v2") is True and "v2" not in lora.adapters
    flat.fill_(0)  # the sender reuses its buffer
    path, (A, B) = sorted(v1.linear.items())[0]
    assert torch.equal(A, tensors[f"base_model.model.{path}.lora_A.weight"])
    assert torch.equal(B, tensors[f"base_model.model.{path}.lora_B.weight"])
    epath, by = sorted(v1.experts.items())[0]
    A, B = by["down_proj"]
    E, r = A.shape[:2]
    peft_b = [v for k, v in tensors.items() if k.startswith(f"base_model.model.{epath}.lora_B")]
    assert any(torch.equal(B.permute(1, 2, 0).reshape(B.shape[1], r * E), v) for v in peft_b)
    lora.release("v1")  # its last request ended: gone
    assert lora.adapters == {}


def test_bucket_sent_again_reuses_its_parse_and_reads_the_new_values(adapter):
    """A sender's reused buffers (two, alternating, as the adapter sync sends them): the second
    load of a bucket reuses its parse (views, no decode), yet the adapter holds the bucket's
    new values, equal to a full parse of them; a non-finite value written into a reused
    bucket is still refused naming the tensor; another config parses in full."""
    from moe_async.engines.embedded.lora_bucket import BucketAdapters
    from moe_async.engines.embedded.tensor_update import flattened_bucket, load_entry
    from moe_async.weight_sync.adapter_buffers import PackedAdapter, layout_of

    config, tensors, model = adapter
    parser = BucketAdapters(model, dict(model.named_modules()), torch.float32)
    bufs = [PackedAdapter.allocate(layout_of(tensors)) for _ in range(3)]
    bufs[2].write(tensors)  # another sender's bucket, kept mapped before these
    parser.parse("other", config, *flattened_bucket(load_entry(bufs[2].entries()[0])))

    def send(v: int, buf: PackedAdapter, cfg: dict = config, values: dict | None = None):
        buf.write(values or {k: (v + 1) * t for k, t in tensors.items()})
        return parser.parse(f"p@{v}", cfg, *flattened_bucket(load_entry(buf.entries()[0])))

    for v in range(4):
        ad = send(v, bufs[v % 2])
        assert parser.reused == max(0, v - 1) and ad.name == f"p@{v}" and ad.views(bufs[v % 2].flat)
        ref = parse_peft("ref", config, {k: (v + 1) * t for k, t in tensors.items()}, model, torch.float32)
        for path, (A, B) in ref.linear.items():
            assert torch.equal(ad.linear[path][0], A) and torch.equal(ad.linear[path][1], B)
        for path, by in ref.experts.items():
            for q, (A, B) in by.items():
                assert torch.equal(ad.experts[path][q][0], A) and torch.equal(ad.experts[path][q][1], B)
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    bad = {k: t.clone() for k, t in tensors.items()}
    bad[key].view(-1)[0] = math.nan
    with pytest.raises(LoraError, match=f"tensor {key.replace('.', '[.]')} holds non-finite values"):
        send(4, bufs[0], values=bad)
    ad = send(5, bufs[1], cfg=dict(config, lora_alpha=2 * config["lora_alpha"]))
    assert parser.reused == 2 and ad.scaling == 2 * config["lora_alpha"] / config["r"]


def test_finiteness_check_exact_when_the_sum_overflows():
    """The check's fast pass is a sum: finite values whose sum overflows are still finite
    (settled by ``aminmax``), and one NaN or inf anywhere is found, even among +-inf pairs."""
    from moe_async.engines.embedded.lora import is_finite

    big = torch.full((64,), 3e38)
    assert is_finite(big) and is_finite(torch.full((8,), 6e4, dtype=torch.float16))
    for bad in (math.nan, math.inf, -math.inf):
        t = big.clone()
        t[17] = bad
        assert not is_finite(t) and not is_finite(torch.tensor([1.0, bad]))
    assert not is_finite(torch.tensor([math.inf, -math.inf]))
