"""trainer.load pointing at another model's checkpoint is refused before any process starts,
naming the first tensor whose shape differs (moe_async/trainer/ckpt_shapes.py, called by the
driver's resolve_checkpoint), from the checkpoint's torch_dist metadata alone."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from _launch import run

from moe_async.config import load_config
from moe_async.errors import UserInputError
from moe_async.trainer.ckpt_shapes import first_shape_difference, torch_dist_shapes

HERE = os.path.dirname(__file__)
SMOKE = Path(HERE).resolve().parents[1] / "configs" / "cpu_smoke.yaml"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU checks")
    tmp = tmp_path_factory.mktemp("cs")
    run([sys.executable, os.path.join(HERE, "_ckpt_shapes_checks.py"), str(tmp), str(tmp / "out.json")], timeout=300)
    return tmp, json.loads((tmp / "out.json").read_text())


def test_stacked_and_per_layer_keys():
    per_layer = {"embedding.word_embeddings.weight": (10, 4),
                 "decoder.layers.0.input_layernorm.weight": (4,), "decoder.layers.1.input_layernorm.weight": (4,),
                 "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (8, 4),
                 "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": (8, 4),
                 "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight": (8, 4),
                 "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": (8, 4)}
    got = torch_dist_shapes(per_layer, vocab_rows=16)
    assert got["embedding.word_embeddings.weight"] == (16, 4)
    assert got["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (2, 4)
    assert got["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 2, 8, 4)
    assert got["decoder.layers.1.input_layernorm.weight"] == (4,)
    assert got["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (2, 8, 4)
    assert first_shape_difference({"decoder.layers.1.input_layernorm.weight": (4,), "x": (1,)}, got) is None
    assert first_shape_difference({"embedding.word_embeddings.weight": (16, 8)}, got) == (
        "embedding.word_embeddings.weight", (16, 8), (16, 4))


@pytest.mark.parametrize("fam, key", [
    ("mixtral", "decoder.layers.mlp.experts.experts.linear_fc1.weight"),
    ("qwen3_moe", "decoder.layers.mlp.router.weight"),
    ("llama", "embedding.word_embeddings.weight"),
    ("deepseek_v3", "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"),
])
def test_every_family_checkpoint_matches_its_model_only(ckpts, fam, key):
    r = ckpts[1][fam]
    assert r["n_saved"] > 5 and r["saved_not_expected"] == []  # every saved model tensor is checked
    assert r["same_diff"] is None
    assert r["other_diff"][0] == key and r["other_diff"][1] != r["other_diff"][2]


def test_resolve_checkpoint_refuses_another_models_checkpoint(ckpts):
    from moe_async.orchestration.driver import resolve_checkpoint

    tmp = ckpts[0]
    same = tmp / "smoke_same" / "step_0"
    assert resolve_checkpoint(load_config(SMOKE, [f"trainer.load={same}"])) == (str(same), 0)
    other = tmp / "smoke_other" / "step_0"
    t0 = time.perf_counter()
    with pytest.raises(UserInputError) as ei:
        resolve_checkpoint(load_config(SMOKE, [f"trainer.load={other}"]))
    assert time.perf_counter() - t0 < 60  # metadata only: no model built, no process started
    assert str(ei.value) == (
        f"trainer.load={str(other)!r} is a checkpoint of another model: tensor "
        "decoder.layers.mlp.experts.experts.linear_fc1.weight has shape [2, 4, 192, 64] there, the configured "
        "model (mixtral) needs [2, 4, 256, 64]")
    # the same checkpoint with the model sized as it was saved is accepted
    ok = load_config(SMOKE, [f"trainer.load={other}", "model.intermediate_size=96"])
    assert resolve_checkpoint(ok) == (str(other), 0)


def test_configured_hf_config_without_making_the_model(tmp_path):
    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import configured_hf_config

    d = configured_hf_config(ModelConfig(source="random_moe", cache_dir=str(tmp_path), intermediate_size=96))
    assert (d["model_type"], d["intermediate_size"], d["vocab_size"], d["num_local_experts"]) == ("mixtral", 96, 49152, 4)
    assert list(tmp_path.iterdir()) == []  # nothing made
    assert configured_hf_config(ModelConfig(source="smollm2_upcycled", cache_dir=str(tmp_path))) is None
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    assert configured_hf_config(ModelConfig(source="hf", hf_path=str(tmp_path)))["hidden_size"] == 8
    assert configured_hf_config(ModelConfig(source="hf", hf_path=str(tmp_path / "nope"))) is None
