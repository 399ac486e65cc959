"""Tiny random DeepSeek-V3 checkpoints for tests: 3 layers (first dense), hidden 64, 4 heads,
MLA (q_lora 32 or None, kv_lora 32, nope 16, rope 8, v 16), 8 routed experts top-4 in 4 groups
(2 groups chosen), 1 shared expert, vocab 256, NON-ZERO random ``e_score_correction_bias``."""

from __future__ import annotations

import os


def make_tiny_deepseek_v3(path: str, tie: bool = False, q_lora_rank: int | None = 32, seed: int = 0,
                          init_std: float = 0.2, bias_std: float = 0.05, **overrides) -> str:
    """Save a random DeepseekV3ForCausalLM (fp32) to ``path``; returns ``path``."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):  # non-trivial norm weights so a swapped norm shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # the bias must steer the choice
                b.copy_(bias_std * torch.randn_like(b))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path
