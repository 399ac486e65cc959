"""Sparse upcycling: with identical experts and renormalised top-k weights the MoE
reproduces the dense model (tiny random Llama, and the real SmolLM2 once)."""

from __future__ import annotations

import time

import pytest
import torch

from moe_async.models.upcycle import upcycle_llama_to_mixtral


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("E,k", [(4, 2), (8, 1), (2, 2)])
def test_tiny_upcycle_exact(E: int, k: int) -> None:
    dense = _tiny_llama()
    moe = upcycle_llama_to_mixtral(dense, num_experts=E, top_k=k, router_init_std=0.02, seed=7)
    c = moe.config
    assert c.num_local_experts == E and c.num_experts_per_tok == k and c.tie_word_embeddings
    assert c.rope_parameters["rope_theta"] == 1e5 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 128
    L0 = moe.model.layers[0].mlp
    d0 = dense.model.layers[0].mlp
    I = dense.config.intermediate_size
    assert L0.experts.gate_up_proj.shape == (E, 2 * I, 32)
    assert L0.experts.down_proj.shape == (E, 32, I)
    for e in range(E):  # gate rows first, then up
        assert torch.equal(L0.experts.gate_up_proj[e, :I], d0.gate_proj.weight)
        assert torch.equal(L0.experts.gate_up_proj[e, I:], d0.up_proj.weight)
        assert torch.equal(L0.experts.down_proj[e], d0.down_proj.weight)
    r = L0.gate.weight
    assert r.shape == (E, 32) and r.abs().max() > 0 and 0.01 < r.std().item() < 0.04
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 33, 70, 4, 8]])
    with torch.no_grad():
        diff = (dense(ids).logits - moe(ids).logits).abs().max().item()
    assert diff < 1e-4
    # deterministic in the seed
    again = upcycle_llama_to_mixtral(dense, num_experts=E, top_k=k, router_init_std=0.02, seed=7)
    assert torch.equal(again.model.layers[1].mlp.gate.weight, moe.model.layers[1].mlp.gate.weight)


def test_rejects_zero_router() -> None:
    with pytest.raises(ValueError):
        upcycle_llama_to_mixtral(_tiny_llama(), 4, 2, router_init_std=0.0, seed=0)


@pytest.fixture(scope="module")
def smollm2():
    from moe_async.models.upcycle import load_smollm2_dense

    t0 = time.time()
    dense, tok = load_smollm2_dense()
    t1 = time.time()
    moe = upcycle_llama_to_mixtral(dense, num_experts=4, top_k=2, router_init_std=0.02, seed=1234)
    print(f"\nSmolLM2 load {t1 - t0:.1f}s, upcycle {time.time() - t1:.1f}s")
    return dense, tok, moe


def test_smollm2_upcycle_matches_dense(smollm2, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM

    from moe_async.models.prepare import load_tokenizer, save_checkpoint_atomic

    dense, tok, moe = smollm2
    assert type(dense) is LlamaForCausalLM and getattr(dense.config, "quantization_config", None) is None
    assert dense.config.num_hidden_layers == 30 and dense.config.vocab_size == 49152
    assert moe.config.rope_parameters["rope_theta"] == 1e5 and moe.config.tie_word_embeddings
    assert moe.config.rms_norm_eps == 1e-5 and moe.config.max_position_embeddings == 8192
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 5 - 3."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        ld, lm = dense(ids).logits, moe(ids).logits
    assert (ld - lm).abs().max().item() < 1e-3
    gd = dense.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    gm = moe.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert gd.tolist() == gm.tolist()

    # saved checkpoint reloads with plain transformers, same logits, tokenizer + template
    out = save_checkpoint_atomic(moe, tok, tmp_path / "ckpt")
    re = AutoModelForCausalLM.from_pretrained(out)
    assert type(re) is MixtralForCausalLM
    with torch.no_grad():
        assert torch.equal(re(ids).logits, lm)
    tok2 = load_tokenizer(out)
    assert tok2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok2.eos_token_id == 2 and tok2.pad_token_id is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
