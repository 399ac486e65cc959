"""The small interfaces the rollout manager and the weight transports see (``typing.Protocol``,
structural: any object with these members fits; nothing here is imported at run time but
typing).

- :class:`GenerateEngine`: an engine client as :class:`~moe_async.rollout.manager.RolloutManager`
  calls it (:class:`~moe_async.engines.client.EngineClient`, test fakes).
- :class:`GroupBuffer`: the rollout buffer as the manager fills it (the Ray
  :class:`~moe_async.orchestration.buffer_actor.BufferProxy` over the buffer actor; test fakes).
- :class:`WeightReceiver`: an engine as the weight transports update it
  (:class:`~moe_async.engines.client.SyncEngineClient`; replies are the engine's JSON dicts).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from moe_async.types import Group


class GenerateEngine(Protocol):
    """One engine's ``/generate`` (SGLang's native API), awaited by the rollout manager."""

    base_url: str  # named in errors
    timeout_s: float  # per-request limit (engine.request_timeout_s), named in errors

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None,
                       return_logprob: bool = True, return_routed_experts: bool = False) -> Any:
        """A ``GenerateOutput``-like reply: ``output_ids``, ``output_token_logprobs``,
        ``finish_reason``, ``weight_version``, optionally ``output_token_weight_versions``
        and ``routed_experts``."""
        ...


class GroupBuffer(Protocol):
    """Admission and hand-in of rollout groups (async)."""

    admit_waits: bool  # True: admit() itself waits for capacity (the manager does not sleep)

    async def admit(self) -> int | None:
        """A slot for one group: the weight_version it is admitted at, or None (no capacity)."""
        ...

    async def put(self, group: Group) -> None:
        """Hand in the finished group of an admitted slot."""
        ...

    async def cancel(self, reason: str = "cancelled") -> None:
        """Return an admitted slot unused, counted under ``reason``."""
        ...


class WeightReceiver(Protocol):
    """An engine's weight-update endpoints (blocking calls, each returning the engine's reply)."""

    base_url: str

    def health(self, timeout: float = 5.0) -> bool: ...

    def flush_cache(self, timeout_s: float = 0.0) -> bool: ...

    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: Mapping[str, object],
                                       serialized_named_tensors: list[str], load_format: str | None = None) -> dict: ...

    def unload_lora_adapter(self, lora_name: str) -> dict: ...

    def pause_generation(self, mode: str = "abort") -> dict: ...

    def continue_generation(self) -> dict: ...

    def begin_weight_update(self, atomic: bool = False, selector: str = "all") -> dict: ...

    def end_weight_update(self) -> dict: ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> dict: ...

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: int | str | None = None,
                                        load_format: str | None = "flattened_bucket",
                                        abort_all_requests: bool = False) -> dict: ...

    def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                   load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                                   weight_version: int | str | None = None,
                                   abort_all_requests: bool = False) -> dict: ...

    def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                 flush_cache: bool = True) -> dict: ...

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict: ...

    def weights_layout(self) -> dict | None:
        """The engine's send order, or None where the engine has no ``/weights_layout`` (SGLang)."""
        ...

    def weights_checksum(self) -> dict: ...
