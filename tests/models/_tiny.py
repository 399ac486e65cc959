"""Tiny random Mixtral checkpoints for tests (2 layers, hidden 64, 4 experts top-2, vocab 256)."""

from __future__ import annotations

import os


def make_tiny_mixtral(path: str, tie: bool = True, seed: int = 0, init_std: float = 0.2, **overrides) -> str:
    """Save a random MixtralForCausalLM (fp32) to ``path``; returns ``path``.

    ``init_std`` is large (0.2) so that logprobs are far from uniform and parity tests bite.
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**kw))
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def make_tiny_qwen3_moe(path: str, tie: bool = False, norm_topk_prob: bool = True, seed: int = 0,
                        init_std: float = 0.2, **overrides) -> str:
    """Save a random Qwen3MoeForCausalLM (fp32) to ``path``: 2 layers, hidden 64, 4 heads /
    2 KV heads of dim 32 (q/k-norm), 4 experts top-2 of width 96, vocab 256; returns ``path``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw))
    with torch.no_grad():  # non-trivial norm weights (incl. q/k norms) so a swapped norm shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def make_tiny_llama(path: str, tie: bool = True, seed: int = 0, init_std: float = 0.2, **overrides) -> str:
    """Save a random dense LlamaForCausalLM (fp32) to ``path``: 2 layers, hidden 64, 4 heads /
    2 KV heads, MLP width 128, vocab 256, tied embeddings by default (as SmolLM2); returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path
