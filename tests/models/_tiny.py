"""Tiny random HF checkpoints for tests (fp32, vocab 256, hidden 64, 4 heads, 2 layers unless
overridden): Mixtral, Qwen3-MoE and dense Llama here; DeepSeek-V3 in _tiny_deepseek_v3.py, which
uses :func:`common_kw` and :func:`save_random` too."""

from __future__ import annotations

import os


def common_kw(tie: bool, init_std: float, rms_norm_eps: float) -> dict:
    """The config fields every tiny family shares: vocab 256, hidden 64, 2 layers, 4 heads,
    128 positions, default RoPE (theta 1e4), tied embeddings ``tie``, ``initializer_range``
    ``init_std`` (large, 0.2 by default, so logprobs are far from uniform and parity tests bite)."""
    return dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, tie_word_embeddings=tie, initializer_range=init_std,
                rms_norm_eps=rms_norm_eps, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def save_random(path: str, model_cls, config_cls, kw: dict, seed: int, buffers: dict | None = None) -> str:
    """Build ``model_cls(config_cls(**kw))`` under ``torch.manual_seed(seed)``, set every
    ``*norm.weight`` to 1 + 0.1 N(0, 1) (non-trivial, so a swapped norm shows), then each buffer
    whose name ends with a key of ``buffers`` to ``buffers[key]`` x N(0, 1) (drawn after the
    norms, in that order), and save it (fp32 safetensors) to ``path``; returns ``path``."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for suffix, std in (buffers or {}).items():
            for n, b in model.named_buffers():
                if n.endswith(suffix):
                    b.copy_(std * torch.randn_like(b))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def make_tiny_mixtral(path: str, tie: bool = True, seed: int = 0, init_std: float = 0.2, **overrides) -> str:
    """Save a random MixtralForCausalLM (fp32) to ``path``: 2 layers, 4 heads / 2 KV heads,
    4 experts top-2 of width 128; returns ``path``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = dict(common_kw(tie, init_std, 1e-5), intermediate_size=128, num_key_value_heads=2,
              num_local_experts=4, num_experts_per_tok=2)
    return save_random(path, MixtralForCausalLM, MixtralConfig, {**kw, **overrides}, seed)


def make_tiny_qwen3_moe(path: str, tie: bool = False, norm_topk_prob: bool = True, seed: int = 0,
                        init_std: float = 0.2, **overrides) -> str:
    """Save a random Qwen3MoeForCausalLM (fp32) to ``path``: 2 layers, hidden 64, 4 heads /
    2 KV heads of dim 32 (q/k-norm), 4 experts top-2 of width 96, vocab 256; returns ``path``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(common_kw(tie, init_std, 1e-6), intermediate_size=128, moe_intermediate_size=96,
              num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=norm_topk_prob)
    return save_random(path, Qwen3MoeForCausalLM, Qwen3MoeConfig, {**kw, **overrides}, seed)


def make_tiny_llama(path: str, tie: bool = True, seed: int = 0, init_std: float = 0.2, **overrides) -> str:
    """Save a random dense LlamaForCausalLM (fp32) to ``path``: 2 layers, hidden 64, 4 heads /
    2 KV heads, MLP width 128, vocab 256, tied embeddings by default (as SmolLM2); returns ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(common_kw(tie, init_std, 1e-5), intermediate_size=128, num_key_value_heads=2)
    return save_random(path, LlamaForCausalLM, LlamaConfig, {**kw, **overrides}, seed)
