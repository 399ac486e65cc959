"""Engine section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, StrictInt, field_validator, model_validator

from moe_async.config_base import ConfigModel


class EngineConfig(ConfigModel):
    """Inference engines that generate rollouts.

    ``backend='embedded'`` starts our CPU server (transformers-backed, SGLang's HTTP
    protocol) on loopback; ``backend='sglang'`` launches ``python -m sglang.launch_server``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    backend: Literal["embedded", "sglang"] = "embedded"
    num_engines: int = Field(1, ge=1, description="Engine servers (each its own TP x EP group of ranks).")
    tensor_parallel_size: StrictInt = Field(
        1, ge=1, description="Ranks of one engine (SGLang --tp-size); its update-group ranks are rank_offset + TP rank."
    )
    expert_parallel_size: StrictInt = Field(
        1, ge=1, description="Expert parallel size inside one engine (SGLang --ep-size); divides tensor_parallel_size."
    )
    devices_per_engine: StrictInt | None = Field(
        None,
        ge=1,
        description="Devices (GPUs on a cluster) one engine is placed on; None = tensor_parallel_size.",
    )
    nodes_per_engine: StrictInt = Field(
        1, ge=1, description="Nodes one engine spans (SGLang --nnodes; its node ranks get --node-rank and rank 0's "
        "--dist-init-addr from the placement). devices_per_engine is split evenly over them; only backend='sglang'.",
    )
    host: str = "127.0.0.1"
    base_port: int = Field(0, ge=0, le=65535, description="0 = pick free ports.")
    max_running_requests: int = Field(16, ge=1, description="Decode batch size cap.")
    num_threads: int = Field(1, ge=1, description="torch threads in each engine process.")
    eval_num_threads: int | None = Field(
        None, ge=1, description="torch threads of each embedded engine's forward passes while the driver waits on a "
        "held-out evaluation (the trainer computes nothing then), back to num_threads after (its POST "
        "/set_num_threads). None: num_threads throughout. Only backend='embedded'; with cpu_affinity at most its "
        "core count.",
    )
    cpu_affinity: list[StrictInt] | None = Field(
        None,
        description="Core ids every engine server process is pinned to (os.sched_setaffinity, Linux); "
        "None = no pinning. Disjoint from trainer.cpu_affinity models engines and trainer on their own devices.",
    )
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="Where the embedded engine holds the model and runs every forward (its --device): "
        "'cuda' (the engine process's first visible GPU; refused at start on a host without one), 'auto' "
        "(cuda when the engine process sees a GPU, else cpu). Only backend='embedded'; SGLang places itself.",
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="Seconds to wait for /health.")
    request_timeout_s: float = Field(600.0, gt=0)
    max_restarts: StrictInt = Field(
        2, ge=0, description="Restarts allowed per engine (moe_async/orchestration/supervisor.py); an engine "
        "that dies once more is retired (out of routing for good). 0: a dead engine is retired at once.",
    )
    min_healthy_engines: StrictInt = Field(
        1, ge=1, description="Floor of healthy engines (neither dead nor retired): a death that leaves fewer stops "
        "the run with an error naming every engine that is down. At most num_engines.",
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort", description="SGLang pause_generation mode used around weight updates."
    )
    sglang_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Extra sglang.launch_server flags (GPU)."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> "EngineConfig":
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp % ep:
            raise ValueError(f"engine.expert_parallel_size={ep} must divide engine.tensor_parallel_size={tp} "
                             "(SGLang's expert parallelism splits the TP group's ranks)")
        if self.devices_per_engine is not None and self.devices_per_engine < tp:
            raise ValueError(f"engine.devices_per_engine={self.devices_per_engine} is fewer than "
                             f"engine.tensor_parallel_size={tp} (one device per engine rank)")
        if self.min_healthy_engines > self.num_engines:
            raise ValueError(f"engine.min_healthy_engines={self.min_healthy_engines} is more than "
                             f"engine.num_engines={self.num_engines}: the run could never start")
        given = {k.replace("-", "_"): k for k in self.sglang_args}  # the command line turns _ into -
        # the sizes reach SGLang as --tp-size / --ep-size from these fields, which the update group
        # also counts ranks by: a second spelling in sglang_args would let the two disagree
        for key, field in (("tp_size", "tensor_parallel_size"), ("tp", "tensor_parallel_size"),
                           ("tensor_parallel_size", "tensor_parallel_size"), ("ep_size", "expert_parallel_size"),
                           ("ep", "expert_parallel_size"), ("expert_parallel_size", "expert_parallel_size")):
            if key in given:
                raise ValueError(f"engine.sglang_args.{given[key]}: set engine.{field} instead (it becomes SGLang's "
                                 f"--{key.replace('_', '-') if key.endswith('size') else key + '-size'} and sizes "
                                 "the weight-update group's ranks)")
        n, dev = self.nodes_per_engine, self.resolved_devices_per_engine
        if self.backend == "embedded" and n > 1:
            raise ValueError(f"engine.nodes_per_engine={n} with engine.backend='embedded': the embedded CPU engine "
                             "is one process on one node; use backend='sglang'")
        if dev % n:
            raise ValueError(f"engine.nodes_per_engine={n} does not divide the engine's {dev} devices "
                             "(engine.devices_per_engine, else engine.tensor_parallel_size): every node holds "
                             "the same number of its ranks")
        for key in ("nnodes", "node_rank", "dist_init_addr"):
            if key in given:
                raise ValueError(f"engine.sglang_args.{given[key]}: set engine.nodes_per_engine instead (node ranks and "
                                 "rank 0's address come from the engine's placement)")
        if self.backend != "embedded" and self.device != "cpu":
            raise ValueError(f"engine.device={self.device!r} with engine.backend={self.backend!r}: only the embedded "
                             "engine takes a device; SGLang places its ranks on the GPUs it is given")
        et = self.eval_num_threads
        if et is not None and self.backend != "embedded":
            raise ValueError(f"engine.eval_num_threads={et} with engine.backend={self.backend!r}: only the embedded "
                             "engine can change its threads; leave it null")
        if et is not None and self.cpu_affinity is not None and et > len(self.cpu_affinity):
            raise ValueError(f"engine.eval_num_threads={et} exceeds the {len(self.cpu_affinity)} core(s) of "
                             f"engine.cpu_affinity={self.cpu_affinity}: the engine's threads would share them")
        if self.backend == "embedded" and tp > 1:
            raise ValueError(f"engine.tensor_parallel_size={tp} with engine.backend='embedded': the embedded CPU "
                             "engine is one process (one update-group rank); use backend='sglang' for TP > 1")
        return self

    @property
    def resolved_devices_per_engine(self) -> int:
        """Devices one engine is placed on (``devices_per_engine``, else its TP size)."""
        return self.devices_per_engine or self.tensor_parallel_size

    @property
    def devices_per_engine_node(self) -> int:
        """Devices of one engine on each of its ``nodes_per_engine`` nodes."""
        return self.resolved_devices_per_engine // self.nodes_per_engine

    @field_validator("cpu_affinity")
    @classmethod
    def _check_affinity(cls, v: list[int] | None) -> list[int] | None:
        from moe_async.affinity import validate_core_list

        return validate_core_list(v)
