"""Weight-sync section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WeightSyncConfig(BaseModel):
    """How trained weights reach the engines.

    Data path: Megatron params -> HF names (models mapping table) -> buckets of at most
    ``bucket_bytes`` (flattened) -> broadcast over a dedicated process group (NCCL on GPU,
    gloo on CPU) -> engine ``/update_weights_from_distributed``.
    """

    model_config = ConfigDict(extra="forbid")

    bucket_bytes: int = Field(512 * 1024**2, ge=1, description="Bucket budget in bytes.")
    interval_steps: int = Field(1, ge=1, description="Sync every k optimizer steps.")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    check: bool = Field(False, description="Compare per-tensor checksums after every sync.")
    timeout_s: float = Field(600.0, gt=0)
