"""Tiny random GLM-4.5 (``glm4_moe``) checkpoints for tests (case C26): vocab 128, hidden 64,
2 layers (the first dense, intermediate 96), 4 routed experts top-2 of width 32 + 1 shared
expert, 4 heads / 2 KV heads of dim 16, ``partial_rotary_factor=0.5``, q/k/v biases, q/k norm,
``routed_scaling_factor`` 2.5, NON-ZERO random fp32 ``e_score_correction_bias``; plus, written
into the safetensors after transformers' save (transformers builds no MTP layer), the MTP
block ``model.layers.2.*`` of ``num_nextn_predict_layers=1``: ``eh_proj``, ``enorm``,
``hnorm``, ``shared_head.norm`` and a whole MoE decoder layer (as GLM-4.5's checkpoints hold)."""

from __future__ import annotations

import os

from _tiny import common_kw, save_random  # same directory: its importers have it on sys.path


def make_tiny_glm4_moe(path: str, tie: bool = False, seed: int = 0, init_std: float = 0.2,
                       bias_std: float = 0.05, mtp: bool = True, **overrides) -> str:
    """Save a random Glm4MoeForCausalLM (fp32) to ``path`` (see the module docstring);
    ``mtp``: append the MTP block's tensors to ``model.safetensors``; returns ``path``."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(common_kw(tie, init_std, 1e-5), vocab_size=128, intermediate_size=96, moe_intermediate_size=32,
              num_key_value_heads=2, head_dim=16, n_routed_experts=4, n_shared_experts=1,
              num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
              num_nextn_predict_layers=1)
    kw["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}
    kw.update(overrides)
    save_random(path, Glm4MoeForCausalLM, Glm4MoeConfig, kw, seed,
                buffers={"e_score_correction_bias": bias_std})
    if mtp:
        f = os.path.join(path, "model.safetensors")
        sd = load_file(f)
        L = kw["num_hidden_layers"]
        g = torch.Generator().manual_seed(seed + 1)
        src = f"model.layers.{L - 1}."  # an MoE layer: the MTP block holds one like it
        extra = {f"model.layers.{L}." + k[len(src):]: torch.randn(v.shape, generator=g) * 0.1
                 for k, v in sd.items() if k.startswith(src)}
        H = kw["hidden_size"]
        extra[f"model.layers.{L}.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
        for n in ("enorm", "hnorm", "shared_head.norm"):
            extra[f"model.layers.{L}.{n}.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        save_file({**sd, **extra}, f, metadata={"format": "pt"})
    return path
