"""Logging section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from moe_async.config_base import ConfigModel


class LoggingConfig(ConfigModel):
    """wandb (offline by default; ``online`` when configured), optionally TensorBoard, plus a
    console line per step and a metrics.jsonl file; all get the same metric names."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "moe-async"
    output_dir: str = Field("runs", description="Run dirs are created under this path.")
    tensorboard: bool = Field(False, description="Also write the per-step metrics, under the same names, as "
                                                 "TensorBoard event files in <run dir>/tensorboard (tensorboardX).")
    quiet: bool = Field(False, description="No per-step console lines and no live view (CI, scripts); "
                                           "metrics.jsonl, console.log and the trace are written as usual.")
