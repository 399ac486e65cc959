"""The ``trainer.lora`` section: LoRA adapters on the Megatron-Core model, in PEFT's terms."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator

from moe_async.config_base import ConfigModel

# PEFT target module names (HF Llama/Mixtral/Qwen3-MoE) this trainer adapts, and the Megatron
# linear each one is part of (q/k/v are one fused linear_qkv; gate/up one linear_fc1)
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LoraConfig(ConfigModel):
    """LoRA (Hu et al., 2021) as PEFT computes it: ``y = W x + (alpha / rank) * B A dropout(x)``,
    ``A [rank, in]`` (Kaiming-uniform, as PEFT), ``B [out, rank]`` zero at the start, the base
    frozen and the optimizer over adapter parameters only."""

    rank: StrictInt = Field(16, ge=1, description="LoRA rank r (PEFT's ``r``).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank (PEFT's ``lora_alpha``).")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "Dropout on the adapter's input (PEFT's ``lora_dropout``); must be 0 with routed-expert "
        "adapters (PEFT's adapters on fused expert parameters refuse dropout)."))
    target_modules: list[str] = Field(
        default_factory=lambda: list(PEFT_TARGETS),
        description=("PEFT module names to adapt: q_proj, k_proj, v_proj (together: Megatron's fused "
                     "linear_qkv), o_proj, gate_proj, up_proj (together: linear_fc1), down_proj; the MLP "
                     "names apply to dense MLPs and shared experts, and to routed experts per ``experts``."))
    experts: Literal["per_expert", "shared", "off"] = Field("per_expert", description=(
        "Routed experts: one adapter per expert (``per_expert``; it lives on the expert's EP rank), one "
        "adapter shared by all experts of a layer (``shared``; expert parallel size 1), or none (``off``)."))

    merge_and_unload: bool = Field(False, description=(
        "At the run's end also write <run_dir>/merged/: a full HF checkpoint with the adapter merged "
        "into the base (PEFT's merge_and_unload: W + (alpha / rank) B A per adapted weight, routed "
        "experts included), loadable without peft."))

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in PEFT_TARGETS]
        if bad:
            raise ValueError(f"trainer.lora.target_modules: unknown {bad}; known: {list(PEFT_TARGETS)}")
        if not v:
            raise ValueError("trainer.lora.target_modules is empty")
        for group in FUSED_GROUPS:
            have = [t for t in group if t in v]
            if have and len(have) != len(group):
                raise ValueError(f"{have} without {[t for t in group if t not in v]}: "
                                 f"Megatron fuses {list(group)} into one linear; name all of them or none")
        return sorted(set(v), key=PEFT_TARGETS.index)

    @property
    def scaling(self) -> float:
        """alpha / rank (PEFT's ``scaling`` without rsLoRA)."""
        return self.alpha / self.rank
