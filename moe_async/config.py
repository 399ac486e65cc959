"""Experiment config: the pydantic schema that composes each component's own config,
YAML loading and ``a.b.c=value`` command-line overrides.

Errors: :class:`ConfigError` (a ``ValueError``) naming the file and the dotted field.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from moe_async.config_base import ConfigModel

from moe_async.buffer.config import AsyncConfig
from moe_async.data.config import DataConfig
from moe_async.distill.config import TeacherConfig
from moe_async.engines.config import EngineConfig
from moe_async.logging.config import LoggingConfig
from moe_async.models.config import ModelConfig
from moe_async.plan.config import ClusterConfig
from moe_async.rollout.config import RolloutConfig
from moe_async.trainer.config import TrainerConfig
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.types import JsonDict


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and field."""


class ExperimentConfig(ConfigModel):
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
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt files (moe_async/data); unset: rollout.task.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Machines, for `moe-async plan`.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="On-policy distillation (moe_async/distill).")

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
        # off-policy data needs a correction (else anchored to the wrong policy).
        if a.max_staleness > 0 and t.off_policy_correction == "none":
            raise ValueError(
                "trainer.off_policy_correction='none' with async.max_staleness>0 trains off-policy "
                "data uncorrected; choose one of 'tis', 'tis_seq', 'mis', 'mis_seq', 'icepop', 'opsm', "
                "'decoupled_ppo' (or set async.mode='sync')"
            )
        # atomic apply: SGLang applies each bucket as it arrives; pausing only for the last bucket
        # would serve requests from half-updated weights (the embedded engine stages them)
        if self.engine.backend == "sglang" and w.transport in ("broadcast", "tensor") and w.pause_scope == "last_bucket":
            raise ValueError(
                "weight_sync.pause_scope='last_bucket' needs an engine that stages buckets until the "
                "versioned last one (engine.backend='embedded'); SGLang applies each bucket at once, so "
                "requests would be served from half-updated weights: use pause_scope='sync'"
            )
        if t.lora is not None and w.senders == "all":  # the adapter sync gathers the adapter on rank 0
            raise ValueError("weight_sync.senders='all' with trainer.lora: the adapter-only sync gathers the "
                             "adapter on trainer rank 0 and sends it from there; set weight_sync.senders='one'")
        # GRPO (moe_async/trainer/advantages.py, the only advantage estimator) normalises each
        # reward against its own group: a group of one sample has advantage 0, no gradient
        tch = self.teacher
        if tch.enabled and self.rollout.temperature != 1.0:
            raise ValueError(
                f"teacher.enabled with rollout.temperature={self.rollout.temperature}: the reverse-KL advantage "
                "compares the student's sampling logprobs (log_softmax(logits / temperature)) with the teacher's "
                "(temperature 1); set rollout.temperature=1.0"
            )
        if tch.enabled and self.rollout.agent.enabled:
            raise ValueError("teacher.enabled with rollout.agent.enabled: a teacher scores single-turn responses "
                             "only (a trajectory's observation tokens are not the student's); use one of them")
        if tch.enabled and tch.few_shot and self.data.train is not None:
            raise ValueError(
                f"teacher.few_shot={tch.few_shot} with prompt files (data.train): the worked examples are drawn from "
                f"rollout.task's generator ({self.rollout.task!r}), not from your rows; set teacher.few_shot=0 and "
                "give the teacher its context with teacher.system_prompt, or another model (teacher.model_path)")
        distill_only = tch.enabled and tch.reward_coef == 0  # per-token advantages need no group
        if self.rollout.n_samples_per_prompt < 2 and not distill_only:
            raise ValueError(
                f"rollout.n_samples_per_prompt={self.rollout.n_samples_per_prompt}: GRPO's advantage is "
                "group-relative (reward minus the group mean, moe_async/trainer/advantages.py), so a group "
                "of one sample always has advantage 0 and nothing is learned; use >= 2"
            )
        ag = self.rollout.agent  # multi-turn: every row needs an environment
        if ag.enabled and ag.env_class is None and self.data.train is None:
            raise ValueError("rollout.agent.enabled: set rollout.agent.env_class (generated tasks have no "
                             "env_class column), e.g. answer_retry or skyrl_gym:gsm8k_multi_turn")
        if ag.enabled and ag.env_class is not None:
            from moe_async.agent.env import check_env_class

            check_env_class(ag.env_class)
        if ag.enabled and ag.tools:  # an unknown tool: refused here, not in the rollout actor after start-up
            from moe_async.agent.builtin import resolve_tools

            resolve_tools(list(ag.tools))
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
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: merged by the base
                continue  # loader; a key written next to it overrides the merged one (YAML)
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} at line {line} (first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _parse_value(raw: str) -> object:
    """Parse an override value with YAML rules (``1e-6`` -> float, ``true`` -> bool)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: JsonDict, overrides: list[str]) -> JsonDict:
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
        if isinstance(e.get("input"), bool) and e["type"] != "extra_forbidden":  # YAML 1.1: yes/no/on/off
            got = (f" (got the boolean {str(e['input']).lower()}: YAML reads unquoted yes/no/on/off/true/false as "
                   "booleans; quote a word meant as text)")
        named = not loc or msg.startswith(loc + ".")  # the message names the field already
        lines.append(f"  {'' if named else loc + ': '}{msg}{got}")
    return "\n".join(lines)


#: The key naming a config's base files (``docs/configs.md``).
BASE_KEY = "base"


def deep_merge(base: JsonDict, over: JsonDict) -> JsonDict:
    """A new dict: ``base`` with ``over`` merged in, ``over`` winning. Mappings merge key by
    key, recursively; any other value (a list, a scalar, ``null``) replaces the base's whole."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_mapping(p: Path) -> JsonDict:
    """One YAML file's top-level mapping (an empty file is ``{}``); errors name the file."""
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
    return loaded


def read_config_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> tuple[JsonDict, list[Path]]:
    """Read a YAML experiment file with its base files, merged.

    A file may name base files under the top-level key ``base``: one path or a list of
    paths, each relative to the directory of the file that names it (absolute paths too).
    Bases are read the same way (a base may have bases), merged left to right with
    :func:`deep_merge` (a later base wins), and the file's own keys are merged over them
    last, so the file overrides its bases and command-line overrides (applied by
    :func:`load_config`) override everything.

    Returns: the merged mapping (without ``base``) and every file read, bases first.

    Raises:
        ConfigError: naming the file: not found, YAML error, not a mapping, ``base`` not a
            path or list of paths, a base that is missing, or a cycle (the chain of files).
    """
    p = Path(path)
    here = p.resolve()
    data = _read_mapping(p)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data, [p]
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{p}: {BASE_KEY} must be a file path or a non-empty list of file paths "
                          f"(relative to {p.parent}), got {bases!r}")
    merged: JsonDict = {}
    files: list[Path] = []
    for b in bases:
        bp = Path(b) if Path(b).is_absolute() else p.parent / b
        if not bp.is_file():
            raise ConfigError(f"{p}: {BASE_KEY} {b!r} not found (looked for {bp})")
        if bp.resolve() in (*_chain, here):
            cycle = " -> ".join(str(c) for c in (*_chain, here, bp.resolve()))
            raise ConfigError(f"{p}: {BASE_KEY} {b!r} makes a cycle: {cycle}")
        sub, sub_files = read_config_tree(bp, (*_chain, here))
        merged = deep_merge(merged, sub)
        files += [f for f in sub_files if f not in files]
    return deep_merge(merged, data), [*files, p]


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML experiment file (with its ``base`` files, :func:`read_config_tree`), apply
    overrides and validate.

    Args:
        path: YAML file, or ``None`` for defaults.
        overrides: ``["trainer.lr=1e-5", ...]``.

    Raises:
        ConfigError: unreadable file, YAML syntax error, a bad ``base``, unknown key or bad
            value; the message names the file (and its bases) and the dotted field.
    """
    data: JsonDict = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        data, files = read_config_tree(path)
        if len(files) > 1:
            source += " (with base " + ", ".join(str(f) for f in files[:-1]) + ")"
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
