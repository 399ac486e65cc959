"""The ``data`` section of an experiment config: train files, named eval sets, rewards per
``data_source``.

Paths are local JSONL/JSON/Parquet files, folders of them, or ``save_to_disk`` folders, in the
``slime``, ``verl`` or ``messages`` format (``auto`` detects). Rewards: ``rewards[data_source]``,
else a known source's built-in, else ``default_reward``. Bad values are refused naming the field.

Design notes: ``docs/design/data.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from moe_async.config_base import ConfigModel

Format = Literal["auto", "slime", "verl", "messages"]


class EvalSetConfig(ConfigModel):
    """One named eval set: its file(s) and sampling."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str | list[str] = Field(..., description="File(s) or folder, as data.train.")
    format: Format | None = Field(None, description="Default: data.format.")
    n_samples: int = Field(4, ge=1, description="k: samples per prompt for eval/<name>/mean_at_k, pass_at_k.")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: rollout.eval_max_new_tokens.")
    temperature: float | None = Field(None, gt=0, description="Sampled answers' temperature; default rollout.temperature.")
    limit: int | None = Field(None, ge=1, description="Use the first N rows only.")


class DataConfig(ConfigModel):
    """Prompts from files (``docs/design/data.md``). ``train`` unset: the reasoning-gym task of
    ``rollout.task`` is the source (the CPU demo's default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    train: str | list[str] | None = Field(None, description="Train file(s)/folder; None = rollout.task.")
    format: Format = "auto"
    input_key: str = Field("prompt", description="slime --input-key: the prompt column.")
    label_key: str = Field("label", description="slime --label-key: the answer column.")
    metadata_key: str = Field("metadata", description="slime --metadata-key: a dict (or JSON text) per row.")
    apply_chat_template: bool = Field(
        True, description="Chat-template the prompt with the tokenizer's own template (slime --apply-chat-template); "
        "false: a string prompt is tokenized as is.")
    system_prompt: str | None = Field(
        None, description="Prepended as a system message to a prompt that has none (None: rollout.system_prompt "
        "for string prompts, nothing for message lists; '': nothing).")
    max_prompt_length: int | None = Field(
        None, ge=1, description="Prompts longer than this many tokens are skipped before generation, counted "
        "as rollout/dropped/prompt_over_max_length.")
    shuffle: bool = Field(True, description="A seeded shuffle of the train rows every epoch.")
    seed: int = Field(42, description="Shuffle seed: epoch e's order is permutation(seed, e).")
    rewards: dict[str, str] = Field(default_factory=dict, description="data_source -> reward spec.")
    default_reward: str | None = Field(None, description="Reward spec of rows whose data_source has none.")
    eval: dict[str, EvalSetConfig] = Field(default_factory=dict, description="Named eval sets.")
    cache_dir: str | None = Field(None, description="datasets' Arrow cache (None: datasets' default).")

    @field_validator("eval")
    @classmethod
    def _names(cls, v: dict[str, EvalSetConfig]) -> dict[str, EvalSetConfig]:
        for name in v:
            if not name or "/" in name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"eval set name {name!r} must be letters, digits, '_' or '-' (it names eval/<name>/...)")
        return v

    @model_validator(mode="after")
    def _absolute(self) -> "DataConfig":
        """Paths (files, eval sets, verl reward files, cache) made absolute against the loading
        process's working directory: Ray actors run elsewhere."""
        def ab(p: str) -> str:
            return str(Path(p).expanduser().resolve())

        if self.train is not None:
            self.train = ab(self.train) if isinstance(self.train, str) else [ab(p) for p in self.train]
        for e in self.eval.values():
            e.path = ab(e.path) if isinstance(e.path, str) else [ab(p) for p in e.path]
        fix = {}
        for src, spec in self.rewards.items():
            kind, _, rest = spec.partition(":")
            fix[src] = f"verl:{ab(rest.split(':')[0])}" + (f":{rest.split(':', 1)[1]}" if ":" in rest else "") \
                if kind == "verl" else spec
        self.rewards = fix
        if self.default_reward and self.default_reward.startswith("verl:"):
            rest = self.default_reward[5:]
            self.default_reward = f"verl:{ab(rest.split(':')[0])}" + (f":{rest.split(':', 1)[1]}" if ":" in rest else "")
        if self.cache_dir:
            self.cache_dir = ab(self.cache_dir)
        return self

    @property
    def enabled(self) -> bool:
        return self.train is not None

    def train_paths(self) -> list[str]:
        return [] if self.train is None else ([self.train] if isinstance(self.train, str) else list(self.train))
