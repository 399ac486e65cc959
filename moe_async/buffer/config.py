"""Async/buffer section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from moe_async.config_base import ConfigModel


class AsyncConfig(ConfigModel):
    """How far generation may run ahead of training.

    ``mode='sync'`` is on-policy (``max_staleness`` forced to 0: generate, then train);
    ``fully_async`` lets generation run ahead by up to ``max_staleness`` weight versions.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["sync", "one_step_off", "fully_async"] = "fully_async"
    max_staleness: int = Field(1, ge=0, description="K: max versions between a token and training.")
    stale_policy: Literal["drop"] = "drop"
