"""Checks shared by the mapping tests of the expert-bias families (deepseek_v3, glm4_moe):
the checkpoint's tensors from disk, the router expert bias required both ways, and the
in-memory fused expert layout mapping as the on-disk one does."""

from __future__ import annotations

import os

import pytest
import torch

from moe_async.models import hf_to_megatron, megatron_to_hf


def disk(ckpt: str) -> dict[str, torch.Tensor]:
    """``ckpt``'s ``model.safetensors`` tensors by HF name."""
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt, "model.safetensors"))


def check_expert_bias_required(hf: dict[str, torch.Tensor], ckpt: str, hf_layer: int, megatron_layer: int) -> None:
    """Without HF layer ``hf_layer``'s ``e_score_correction_bias`` the HF -> Megatron mapping
    raises KeyError naming it as missing; without Megatron layer ``megatron_layer``'s
    ``router.expert_bias`` the Megatron -> HF mapping raises KeyError naming it as not set."""
    miss = dict(hf)
    del miss[f"model.layers.{hf_layer}.mlp.gate.e_score_correction_bias"]
    with pytest.raises(KeyError, match="missing HF tensors.*e_score_correction_bias"):
        hf_to_megatron(miss, ckpt)
    meg = hf_to_megatron(hf, ckpt)
    meg.pop(f"decoder.layers.{megatron_layer}.mlp.router.expert_bias")
    with pytest.raises(KeyError, match="not set.*e_score_correction_bias"):
        list(megatron_to_hf(meg.items(), ckpt))


def check_in_memory_fused_layout(model_cls, ckpt: str) -> None:
    """transformers' in-memory state dict (fused ``mlp.experts.gate_up_proj``) of ``model_cls``
    loaded from ``ckpt`` maps to exactly the Megatron tensors of the on-disk checkpoint."""
    m = model_cls.from_pretrained(ckpt)
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    a, b = hf_to_megatron(sd, ckpt), hf_to_megatron(disk(ckpt), ckpt)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
