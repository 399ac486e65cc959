"""Cluster section of an experiment config: what ``moe-async plan`` checks a layout against.

Nothing here changes how a run starts: ``trainer.nodes`` / ``devices_per_node`` /
``world_size`` and ``engine.num_engines`` / ``devices_per_engine`` say what the roles use;
this section says what the machines have. Units: GiB = 2**30 bytes, GB/s = 10**9 bytes/s.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictInt

from moe_async.config_base import ConfigModel


class ClusterConfig(ConfigModel):
    """The machines a run is planned for (``moe-async plan``); defaults: nodes of 8 H100 80GB."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    nodes: StrictInt | None = Field(
        None, ge=1,
        description="Nodes of the allocation (the sbatch --nodes). None: as many as the trainer and the "
        "engines need (their devices, rounded up to whole nodes)."
    )
    gpus_per_node: StrictInt = Field(8, ge=1, description="GPUs per node.")
    gpu_memory_gib: float = Field(
        79.6, gt=0,
        description="Memory of one GPU in GiB (2**30 bytes): H100 80GB reports 81,559 MiB = 79.6 GiB in "
        "nvidia-smi, H200 143,771 MiB = 140.4 GiB, A100 80GB 81,920 MiB = 80.0 GiB."
    )
    reserved_gib: float = Field(
        4.0, ge=0,
        description="GiB of each trainer GPU not available to the estimate: CUDA context, NCCL buffers, "
        "allocator fragmentation (an assumption; the plan compares with gpu_memory_gib - reserved_gib)."
    )
    cpu_memory_gib: float | None = Field(
        None, gt=0,
        description="Host memory per node in GiB, checked against an offloaded optimizer's state; None: "
        "not checked."
    )
    moe_imbalance: float = Field(
        2.0, ge=1.0,
        description="Routing imbalance the plan assumes: the routed experts' activations on a GPU are this "
        "many times their balanced share (early in RL hot experts take 2-4x the mean tokens). The plan warns "
        "when a run fits only at 1 (balanced routing)."
    )
    link_bandwidth_gb_s: float = Field(
        50.0, gt=0,
        description="GB/s (10**9 bytes/s) of the slowest link a weight sync crosses from the sending "
        "trainer rank to the engines; default one InfiniBand NDR NIC, 400 Gb/s = 50 GB/s. The plan's "
        "sync time is the lower bound bytes / this (a pipelined broadcast moves every byte over it once)."
    )
