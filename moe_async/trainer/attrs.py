"""The state and methods the trainer's parts read from one another, declared for the type checker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from moe_async.models.family import ModelFamily
    from moe_async.replay.megatron import RouterReplayHook
    from moe_async.trainer.config import TrainerConfig
    from moe_async.types import MicroBatch, Sample


class TrainerAttrs:
    """What :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer` sets in its constructor
    and its parts (the mixins) share. Annotations only: nothing here exists at run time; the
    methods are defined by the part named in their comment."""

    cfg: TrainerConfig
    hf_path: str
    hf_config: dict[str, Any]  # the HF config.json
    family: ModelFamily
    tf_config: Any  # megatron.core TransformerConfig (an untyped package)
    vocab_size: int  # the padded embedding rows
    version: int  # weight_version of the current weights
    models: list[Any]  # this PP rank's model chunks: megatron.core GPTModel (an untyped package)
    model: Any  # models[0]
    ddp_models: list[Any]  # megatron.core DistributedDataParallel wrappers of ``models``
    optimizer: Any  # megatron.core MegatronOptimizer
    router_replay: RouterReplayHook
    _thd: bool  # packed THD micro-batches
    _vpp: int | None  # virtual pipeline stages per PP rank (None: one chunk)
    _cpu: bool  # the CPU mends are active
    _bias_hooks: list[Any]  # torch RemovableHandle
    _rows_hook: Any  # torch RemovableHandle or None
    _router_pad: torch.Tensor | None  # padding positions in the router's token order, during a forward
    _logit_rows: tuple[torch.Tensor, torch.Tensor] | None  # (positions, sequences) the output layer keeps

    if TYPE_CHECKING:
        def close(self) -> None: ...  # MegatronTrainer

        def _dp_max(self, x: float) -> float: ...  # MegatronTrainer

        def _dp_size(self) -> int: ...  # BatchingMixin

        def _pack(self, samples: list[Sample], advantages: list[float] | None,
                  equalize_dp: bool = False) -> list[MicroBatch]: ...  # BatchingMixin

        @staticmethod
        def _packed_seq_params(mb: MicroBatch) -> Any: ...  # BatchingMixin

        def _schedule_shape(self, mbs_list: list[MicroBatch]) -> tuple[int, int]: ...  # BatchingMixin

        def _model_view(self, mb: MicroBatch) -> MicroBatch: ...  # BatchingMixin

        def _to_device(self, mb: MicroBatch) -> MicroBatch: ...  # BatchingMixin

        def _pad_for_pp(self, samples: list[Sample]) -> list[Sample]: ...  # BatchingMixin

        def _data_iterators(self, mbs_list: list[MicroBatch]) -> Any: ...  # BatchingMixin
