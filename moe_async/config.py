"""Experiment config: the pydantic schema that composes each component's own config,
YAML loading and ``a.b.c=value`` command-line overrides.

Errors: :class:`ConfigError` (a ``ValueError``) naming the file and the dotted field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moe_async.buffer.config import AsyncConfig
from moe_async.engines.config import EngineConfig
from moe_async.logging.config import LoggingConfig
from moe_async.models.config import ModelConfig
from moe_async.rollout.config import RolloutConfig
from moe_async.trainer.config import TrainerConfig
from moe_async.weight_sync.config import WeightSyncConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and field."""


class ExperimentConfig(BaseModel):
    """One experiment. Unknown keys anywhere are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "experiment"
    seed: int = 1234
    num_steps: int = Field(10, ge=1, description="Optimizer steps to run.")
    eval_before: bool = True
    eval_after: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        a, t, w = self.async_, self.trainer, self.weight_sync
        if a.mode == "sync" and a.max_staleness != 0:
            raise ValueError("async.max_staleness must be 0 when async.mode='sync'")
        if a.mode == "one_step_off" and a.max_staleness != 1:
            raise ValueError("async.max_staleness must be 1 when async.mode='one_step_off'")
        if a.max_staleness < w.interval_steps - 1:
            raise ValueError(
                f"async.max_staleness={a.max_staleness} cannot hold with weight_sync.interval_steps="
                f"{w.interval_steps}: tokens would be at least {w.interval_steps - 1} versions old"
            )
        # C11: off-policy data needs a correction.
        if a.max_staleness > 0 and t.off_policy_correction == "none":
            raise ValueError(
                "trainer.off_policy_correction='none' with async.max_staleness>0 trains off-policy "
                "data uncorrected; choose one of 'tis', 'tis_seq', 'mis', 'mis_seq', 'icepop', 'opsm', "
                "'decoupled_ppo' (or set async.mode='sync')"
            )
        # C1: SGLang applies each bucket as it arrives; pausing only for the last bucket
        # would serve requests from half-updated weights (the embedded engine stages them)
        if self.engine.backend == "sglang" and w.transport == "broadcast" and w.pause_scope == "last_bucket":
            raise ValueError(
                "weight_sync.pause_scope='last_bucket' needs an engine that stages buckets until the "
                "versioned last one (engine.backend='embedded'); SGLang applies each bucket at once, so "
                "requests would be served from half-updated weights: use pause_scope='sync'"
            )
        # GRPO (moe_async/trainer/advantages.py, the only advantage estimator) normalises each
        # reward against its own group: a group of one sample has advantage 0, no gradient
        if self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt={self.rollout.n_samples_per_prompt}: GRPO's advantage is "
                "group-relative (reward minus the group mean, moe_async/trainer/advantages.py), so a group "
                "of one sample always has advantage 0 and nothing is learned; use >= 2"
            )
        # router replay: R3 replays the engine's routes (R2 uses them for the agreement metric)
        r = self.rollout
        if t.router_replay != "off" and not r.return_routed_experts:
            if t.router_replay == "R3" and "return_routed_experts" in r.model_fields_set:
                raise ValueError(
                    "trainer.router_replay='R3' replays the engine's routed experts: "
                    "rollout.return_routed_experts must be true (it is set to false)"
                )
            if "return_routed_experts" not in r.model_fields_set:
                r.return_routed_experts = True
        return self

    @property
    def effective_staleness(self) -> int:
        """The bound K used by the buffer."""
        return self.async_.max_staleness


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a mapping that repeats a key.

    Plain YAML keeps the last of two equal keys silently, so a config with ``lr`` written
    twice would train with whichever came last; here it is an error naming key and line.
    """

    def construct_mapping(self, node, deep=False):  # noqa: D102 (PyYAML hook)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: merged by the base
                continue  # loader; a key written next to it overrides the merged one (YAML)
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} at line {line} (first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _parse_value(raw: str) -> Any:
    """Parse an override value with YAML rules (``1e-6`` -> float, ``true`` -> bool)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place) and return it.

    Raises:
        ConfigError: an override without ``=`` or that descends into a non-mapping.
    """
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key.sub=value")
        key, raw = ov.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {ov!r}: empty key part in {key.strip()!r} (expected key.sub=value)")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(raw)
    return data


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]).replace("async_", "async")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":  # our validators' messages name their fields themselves
            msg = msg.removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and not isinstance(e.get("input"), dict) else ""
        named = not loc or msg.startswith(loc + ".")  # the message names the field already
        lines.append(f"  {'' if named else loc + ': '}{msg}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML experiment file, apply overrides and validate.

    Args:
        path: YAML file, or ``None`` for defaults.
        overrides: ``["trainer.lr=1e-5", ...]``.

    Raises:
        ConfigError: unreadable file, YAML syntax error, unknown key or bad value; the
            message names the file and the dotted field.
    """
    data: dict[str, Any] = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: YAML error: {e}") from e
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(data, list(overrides or []))
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def dump_config(cfg: ExperimentConfig) -> str:
    """Serialise a config back to YAML (round-trips through :func:`load_config`)."""
    from moe_async.models.config import RANDOM_ONLY_FIELDS

    data = cfg.model_dump(by_alias=True)
    if cfg.model.source != "random_moe":  # sizes of a random model: not this run's model
        data["model"] = {k: v for k, v in data["model"].items() if k not in RANDOM_ONLY_FIELDS}
    return yaml.safe_dump(data, sort_keys=False)
