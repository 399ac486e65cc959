"""Weight-sync section of an experiment config."""

from __future__ import annotations

from typing import Literal

import warnings

from pydantic import ConfigDict, Field, model_validator

from moe_async.config_base import ConfigModel

#: Below this budget most real tensors exceed a bucket (each then sent alone): warn when the config loads.
SMALL_BUCKET_BYTES = 1024**2


class WeightSyncConfig(ConfigModel):
    """How trained weights reach the engines.

    Data path (``transport: broadcast``): Megatron params -> HF names (models mapping table)
    -> buckets of at most ``bucket_bytes`` (flattened; bucket k+1 packed while bucket k is
    broadcast) -> broadcast over a dedicated process group (NCCL on GPU, gloo on CPU) ->
    engine ``/update_weights_from_distributed``. ``transport: tensor`` (colocated engines on
    the trainer's host, e.g. one GPU shared: NCCL refuses two ranks on one device): the same
    buckets and session, each bucket sent as ``/update_weights_from_tensor`` with CUDA IPC
    handles (CPU: shared memory by name) instead of a broadcast. ``transport: disk``
    (fallback): safetensors files under ``disk_dir`` -> engine ``/update_weights_from_disk``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    transport: Literal["broadcast", "tensor", "disk"] = Field(
        "broadcast", description="broadcast (bucketed, process group) | tensor (colocated: CUDA IPC / shared "
        "memory handles, /update_weights_from_tensor) | disk (safetensors + /update_weights_from_disk)."
    )
    bucket_bytes: int = Field(512 * 1024**2, ge=1, description="Bucket budget in bytes.")
    interval_steps: int = Field(1, ge=1, description="Sync every k optimizer steps.")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    check: bool = Field(False, description="Compare per-tensor checksums after every sync.")
    timeout_s: float = Field(600.0, gt=0)
    overlap: bool = Field(True, description="Pack bucket k+1 in a background thread while bucket k is broadcast.")
    pause_scope: Literal["sync", "last_bucket"] = Field(
        "sync",
        description="Engines paused for the whole sync (SGLang: each bucket is applied at once), or only "
        "for the last bucket (engines that stage buckets and apply on the versioned last call, e.g. "
        "the embedded engine: generation goes on while the other buckets arrive; shorter stall).",
    )
    senders: Literal["one", "all"] = Field(
        "one",
        description="one: global rank 0 sends every tensor (the other ranks' shards gathered to it); all: every "
        "trainer rank sends the shards it holds, once, over its own update group (moe_async.weight_sync.senders; "
        "broadcast transport only).",
    )
    disk_dir: str | None = Field(
        None, description="Directory the disk transport writes (must be readable by the engines); default: a temp dir."
    )

    @model_validator(mode="after")
    def _refuse_unused_fields(self) -> "WeightSyncConfig":
        """A field the chosen transport does not read is refused when set to anything but its
        default, naming it (not silently ignored): ``disk_dir`` (only ``disk`` writes files),
        ``backend`` with ``tensor`` (no process group: memory handles in
        ``/update_weights_from_tensor``). Raises ValueError."""
        unused: list[tuple[str, str | None, str]] = []
        if self.disk_dir is not None and self.transport != "disk":
            unused.append(("disk_dir", None, "only transport 'disk' writes files"))
        if self.backend != "auto" and self.transport == "tensor":
            unused.append(("backend", "auto", "it forms no process group: each bucket goes as memory handles "
                                              "in /update_weights_from_tensor"))
        if self.senders != "one" and self.transport != "broadcast":
            unused.append(("senders", "one", "only the broadcast transport has several senders"))
        for name, default, reason in unused:
            raise ValueError(
                f"weight_sync.{name}={getattr(self, name)!r} is unused with weight_sync.transport="
                f"{self.transport!r} ({reason}): remove it (default {default!r}) or choose another transport")
        return self

    @model_validator(mode="after")
    def _warn_small_buckets(self) -> "WeightSyncConfig":
        if self.transport in ("broadcast", "tensor") and self.bucket_bytes < SMALL_BUCKET_BYTES:
            warnings.warn(
                f"weight_sync.bucket_bytes={self.bucket_bytes} is below {SMALL_BUCKET_BYTES} bytes: every "
                f"tensor larger than the budget is sent alone in a bucket grown to its size, "
                f"and the many small broadcasts are slow",
                UserWarning,
                stacklevel=2,
            )
        return self
