"""The environment interface (SkyRL-gym's ``BaseTextEnv`` shape) and the registry of ours;
selection and construction live in moe_async/agent/env.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class EnvStep:
    """One environment step's result: observation messages, reward (float), done, metadata."""

    observations: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class TextEnv(ABC):
    """A multi-turn text environment (module docstring); ``extras`` as SkyRL-gym passes them."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        self.env_config = env_config or {}
        self.extras = dict(extras or {})

    def init(self, prompt: list[dict]) -> tuple[list[dict], dict[str, Any]]:
        """The conversation the model starts from (default: ``prompt`` itself) and metadata."""
        return list(prompt), {}

    @abstractmethod
    def step(self, action: str) -> EnvStep | dict:
        """React to the model's turn ``action`` (its decoded text)."""

    def close(self) -> None:
        """Release what the environment holds (default: nothing)."""


def as_step(out: Any, env_name: str) -> EnvStep:
    """An :class:`EnvStep` from what ``step`` returned (an EnvStep or a SkyRL-gym dict).
    ValueError naming the environment and the field when it is malformed."""
    if isinstance(out, EnvStep):
        step = out
    elif isinstance(out, dict):
        missing = [k for k in ("observations", "reward", "done") if k not in out]
        if missing:
            raise ValueError(f"environment {env_name!r}: step() result lacks {missing}")
        step = EnvStep(observations=list(out["observations"] or []), reward=out["reward"],
                       done=bool(out["done"]), metadata=dict(out.get("metadata") or {}))
    else:
        raise ValueError(f"environment {env_name!r}: step() returned {type(out).__name__}, "
                         "want a dict {observations, reward, done, metadata} or an EnvStep")
    try:
        step.reward = float(step.reward if step.reward is not None else 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"environment {env_name!r}: step() reward {step.reward!r} is not a number") from None
    for i, m in enumerate(step.observations):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"environment {env_name!r}: observation {i} is not a chat message "
                             f"{{role, content}}: {m!r}")
    return step


ENVS: dict[str, Callable[..., TextEnv]] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make ``name`` an ``env_class`` of ours."""

    def deco(cls: type) -> type:
        ENVS[name] = cls
        return cls

    return deco
