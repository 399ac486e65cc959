"""Tiny random DeepSeek-V3 checkpoints for tests: 3 layers (first dense), hidden 64, 4 heads,
MLA (q_lora 32 or None, kv_lora 32, nope 16, rope 8, v 16), 8 routed experts top-4 in 4 groups
(2 groups chosen), 1 shared expert, vocab 256, NON-ZERO random ``e_score_correction_bias``."""

from __future__ import annotations

from _tiny import common_kw, save_random  # same directory: its importers have it on sys.path


def make_tiny_deepseek_v3(path: str, tie: bool = False, q_lora_rank: int | None = 32, seed: int = 0,
                          init_std: float = 0.2, bias_std: float = 0.05, **overrides) -> str:
    """Save a random DeepseekV3ForCausalLM (fp32) to ``path``; ``e_score_correction_bias``
    drawn as ``bias_std`` x N(0, 1) so that the bias steers the expert choice; returns ``path``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(common_kw(tie, init_std, 1e-6), intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    return save_random(path, DeepseekV3ForCausalLM, DeepseekV3Config, {**kw, **overrides}, seed,
                       buffers={"e_score_correction_bias": bias_std})
