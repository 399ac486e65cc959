"""moe_async.models: model families (exact-key registry by HF ``model_type``) and the ONE
declarative Megatron <-> HF parameter mapping, used by tools/, checkpoint loading and weight
sync.

Public API:
    get_family(model_type) -> ModelFamily
    hf_to_megatron(hf_state, hf_config) -> dict[str, Tensor]
    megatron_to_hf(named, hf_config) -> Iterator[tuple[str, Tensor]]
    tensor_checksum(t) -> str
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import torch

from moe_async.models import deepseek_v3 as _deepseek_v3  # noqa: F401  (registers "deepseek_v3")
from moe_async.models import glm4_moe as _glm4_moe  # noqa: F401  (registers "glm4_moe")
from moe_async.models import llama as _llama  # noqa: F401  (registers "llama")
from moe_async.models import mixtral as _mixtral  # noqa: F401  (registers "mixtral")
from moe_async.models import qwen3_moe as _qwen3_moe  # noqa: F401  (registers "qwen3_moe")
from moe_async.models.checksum import tensor_checksum
from moe_async.models.family import (
    ArchArgs,
    ModelFamily,
    get_family,
    hf_config_dict,
    local_spec_name,
    register_family,
    HfConfig,
)

__all__ = [
    "ArchArgs",
    "ModelFamily",
    "get_family",
    "hf_config_dict",
    "hf_to_megatron",
    "local_spec_name",
    "megatron_to_hf",
    "register_family",
    "tensor_checksum",
]


def _family(hf_config: HfConfig) -> ModelFamily:
    return get_family(hf_config_dict(hf_config).get("model_type"))


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: HfConfig) -> dict[str, torch.Tensor]:
    """Full HF tensors (on-disk names, or transformers' in-memory fused expert layout) ->
    full Megatron tensors (local-spec names). KeyError names any unused HF key or missing
    HF source; ValueError for an unsupported config field."""
    return _family(hf_config).hf_to_megatron(hf_state, hf_config)


def megatron_to_hf(
    named: Iterable[tuple[str, torch.Tensor]], hf_config: HfConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron tensors (local or TE spec names) -> HF on-disk names, streaming.
    KeyError on an unknown Megatron name or, once exhausted, on any HF key left unset."""
    return _family(hf_config).megatron_to_hf(named, hf_config)
