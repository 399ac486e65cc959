"""The state of one :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`, in one object.

:class:`TrainerState` holds what the trainer's parts (batching, logprobs, the GRPO step,
checkpointing) read and what the step and a checkpoint load change (``version``); the parts
take it, or the fields they need, as explicit arguments.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypedDict

from moe_async.types import JsonDict

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    from moe_async.lora.layers import AdaptedLinear
    from moe_async.models.family import ModelFamily
    from moe_async.replay.megatron import RouterReplayHook
    from moe_async.trainer.config import TrainerConfig


@dataclasses.dataclass
class TrainerState:
    """A built trainer's model, optimizer, config and step counter.

    ``models``: this PP rank's model chunks (megatron.core ``GPTModel``, one per virtual
    pipeline stage, in ``vp_stage`` order); ``ddp_models``: their ``DistributedDataParallel``
    wrappers; ``optimizer``: the (chained) ``MegatronOptimizer`` over them. ``vocab_size``: the
    HF vocabulary V (the embedding is padded beyond it). ``version``: weight_version of the
    current weights (0 after the HF load, +1 per optimizer step). ``thd``: packed THD
    micro-batches; ``vpp``: model chunks per PP rank (None: one); ``cpu``: the CPU mends are on.
    """

    cfg: TrainerConfig
    hf_path: str
    hf_config: JsonDict  # the HF config.json
    family: ModelFamily
    tf_config: TransformerConfig  # megatron.core's (an untyped package: Any to the checker)
    vocab_size: int
    models: list[GPTModel]
    ddp_models: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    opt_config: OptimizerConfig
    router_replay: RouterReplayHook
    lora_linears: list[list[AdaptedLinear]] = dataclasses.field(default_factory=list)  # per chunk (LoRA)
    thd: bool = False
    vpp: int | None = None
    cpu: bool = False
    version: int = 0

    @property
    def model(self) -> GPTModel:
        """The first model chunk (the only one without virtual pipeline stages)."""
        return self.models[0]


class RngState(TypedDict):
    """A rank's ``moe_async_rng/rank_<r>.pt``: the layout it was saved at (``tp``, ``pp``, ...;
    restored only at the same one) and the RNG states of Python, NumPy, torch (CPU, each CUDA
    device; None without CUDA) and Megatron-Core's CUDA RNG tracker."""

    layout: dict[str, int] | None
    random: tuple[object, ...]
    numpy: dict[str, object] | tuple[str, np.ndarray, int, int, float]
    torch: Tensor
    cuda: list[Tensor] | None
    tracker: dict[str, Tensor]
