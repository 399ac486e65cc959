"""moe_async.models.rope against transformers' YaRN (``_compute_yarn_parameters``,
DeepSeek-V3's ``yarn_apply_mscale``) and Megatron-Core's (``YarnRotaryEmbedding``,
``_yarn_get_concentration_factor``, MLA's softmax scale): the Megatron fields chosen reproduce
transformers' cos/sin factor, softmax factor and inverse frequencies exactly; what Megatron
cannot reproduce is refused naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from moe_async.models.rope import read_rope

RELEASED = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}


def _ds3(rope_scaling=None, **kw):
    d = {"model_type": "deepseek_v3", "rope_theta": 10000, "max_position_embeddings": 163840,
         "qk_rope_head_dim": 64, "hidden_size": 7168, "num_attention_heads": 128, **kw}
    if rope_scaling is not None:
        d["rope_scaling"] = dict(rope_scaling)  # transformers' config adds keys to the dict it is given
    return d


def _hf(d):
    """transformers' (inv_freq, attention_factor) and DeepSeek-V3's softmax factor."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    c = DeepseekV3Config(**{k: v for k, v in d.items() if k != "model_type"})
    inv, af = ROPE_INIT_FUNCTIONS["yarn"](c)
    return inv, af, yarn_apply_mscale(c.rope_parameters, 1.0)


VARIANTS = {
    "released": RELEASED,
    "no_mscale_fields": {k: v for k, v in RELEASED.items() if k not in ("mscale", "mscale_all_dim")},
    "mscale_only": {**{k: v for k, v in RELEASED.items() if k != "mscale_all_dim"}, "mscale": 0.707},
    "both_differ": {**RELEASED, "mscale": 0.8, "mscale_all_dim": 0.6, "factor": 8, "beta_fast": 16},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_megatron_fields_reproduce_transformers(name):
    from moe_async.compat import apply_cpu_compat

    apply_cpu_compat()  # YarnRotaryEmbedding moves its frequencies to torch.cuda.current_device()
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )

    d = _ds3(VARIANTS[name])
    rope = read_rope(d, ("default", "yarn"))
    mg = rope.megatron_yarn()
    inv, af, softmax = _hf(d)
    assert mg["rope_type"] == "yarn"
    assert _yarn_get_concentration_factor(mg["rotary_scaling_factor"], mg["mscale"], mg["mscale_all_dim"]) == af
    assert rope.attention_factor == af
    assert _yarn_get_mscale(mg["rotary_scaling_factor"], mg["mscale_all_dim"]) ** 2 == pytest.approx(softmax, rel=1e-15)
    assert rope.softmax_mscale == pytest.approx(softmax, rel=1e-15)
    emb = YarnRotaryEmbedding(64, rotary_base=mg["rotary_base"], scaling_factor=mg["rotary_scaling_factor"],
                              original_max_position_embeddings=mg["original_max_position_embeddings"],
                              beta_fast=mg["beta_fast"], beta_slow=mg["beta_slow"], mscale=mg["mscale"],
                              mscale_all_dim=mg["mscale_all_dim"], use_cpu_initialization=True)
    freqs, _ = emb.get_emb(3)
    assert torch.equal(freqs[1, 0, 0, :32], inv)  # position 1: the inverse frequencies themselves


def test_released_softmax_factor_is_about_1_87():
    rope = read_rope(_ds3(RELEASED), ("default", "yarn"))
    assert rope.softmax_mscale == pytest.approx((0.1 * math.log(40) + 1) ** 2) and 1.87 < rope.softmax_mscale < 1.88
    assert rope.attention_factor == 1.0


def test_transformers5_rope_parameters_read_too():
    d = _ds3(rope_parameters={**{k: v for k, v in RELEASED.items() if k != "type"}, "rope_type": "yarn",
                              "rope_theta": 5e4})
    rope = read_rope(d, ("default", "yarn"))
    assert rope.is_yarn and rope.theta == 5e4 and rope.factor == 40


@pytest.mark.parametrize("change,needle", [
    ({"type": "longrope"}, "rope_scaling.rope_type='longrope'"),
    ({"truncate": False}, "rope_scaling.truncate"),
    ({"attention_factor": 1.2}, "rope_scaling.attention_factor"),
    ({"mscale": None}, "rope_scaling.mscale_all_dim"),
    ({"factor": None}, "rope_scaling.factor"),
])
def test_refused_naming_the_field(change, needle):
    with pytest.raises(ValueError) as e:
        read_rope(_ds3({**RELEASED, **change}), ("default", "yarn"))
    assert needle in str(e.value)


def test_yarn_refused_unless_the_caller_supports_it():
    """read_rope refuses YaRN where the caller's family does not list it (naming the field);
    DeepSeek-V3 reads it into MLA's YaRN fields."""
    from moe_async.models import get_family

    with pytest.raises(ValueError) as e:
        read_rope(_ds3(RELEASED))
    assert "rope_scaling.rope_type='yarn'" in str(e.value) and "deepseek_v3" in str(e.value)
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                           first_k_dense_replace=1, n_group=1, topk_group=1, rope_scaling=dict(RELEASED),
                           rope_theta=10000).to_dict()
    a = get_family("deepseek_v3").arch_args(cfg)
    kw = get_family("deepseek_v3").model_config_kwargs(a, moe_aux_loss_coeff=0.0)
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["mscale"], kw["mscale_all_dim"],
            kw["original_max_position_embeddings"]) == ("yarn", 40.0, 1.0, 1.0, 4096)


def test_glm4_moe_refuses_yarn_naming_the_field():
    """glm4_moe (partial rotary) does not take YaRN: refused with the field named."""
    from moe_async.models import get_family

    d = {"model_type": "glm4_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8},
         "rope_theta": 1e4}
    with pytest.raises(ValueError) as e:
        get_family("glm4_moe").arch_args(d)
    assert "rope_scaling.rope_type='yarn'" in str(e.value)
