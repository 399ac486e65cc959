"""The environment interface (SkyRL-gym's ``BaseTextEnv`` shape) and the registry of ours;
selection and construction live in moe_async/agent/env.py."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from moe_async.types import JsonDict


@dataclass
class EnvStep:
    """One environment step's result: observation messages, reward (float), done, metadata."""

    observations: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metadata: JsonDict = field(default_factory=dict)


class Env(Protocol):
    """An environment as the trajectory loop drives it: ours (:class:`TextEnv`) or a
    SkyRL-gym one (whose ``step`` returns its dict, read by :func:`as_step`)."""

    def init(self, prompt: list[dict]) -> tuple[list[dict], JsonDict]: ...

    def step(self, action: str) -> object: ...

    def close(self) -> None: ...


class TextEnv(ABC):
    """A multi-turn text environment (module docstring); ``extras`` as SkyRL-gym passes them."""

    def __init__(self, env_config: JsonDict | None = None, extras: JsonDict | None = None):
        self.env_config = env_config or {}
        self.extras = dict(extras or {})

    def init(self, prompt: list[dict]) -> tuple[list[dict], JsonDict]:
        """The conversation the model starts from (default: ``prompt`` itself) and metadata."""
        return list(prompt), {}

    @abstractmethod
    def step(self, action: str) -> EnvStep | dict:
        """React to the model's turn ``action`` (its decoded text)."""

    def close(self) -> None:
        """Release what the environment holds (default: nothing)."""


def as_step(out: object, env_name: str, env_type: str | None = None) -> EnvStep:
    """An :class:`EnvStep` from what ``step`` returned (an EnvStep or a SkyRL-gym dict).

    ``reward``: a finite real number (None counts as 0.0; bool, str, NaN, inf are refused);
    ``done``: a bool (or 0/1); ``observations``: chat messages ``{role: str, content: str}``.
    ValueError naming the environment (``env_name`` and its Python class ``env_type``), the
    field and the value when it is malformed."""
    who = f"environment {env_name!r}" + (f" ({env_type})" if env_type else "")
    if isinstance(out, EnvStep):
        step = out
    elif isinstance(out, dict):
        missing = [k for k in ("observations", "reward", "done") if k not in out]
        if missing:
            raise ValueError(f"{who}: step() result lacks {missing}")
        obs = out["observations"]
        if obs is not None and not isinstance(obs, (list, tuple)):
            raise ValueError(f"{who}: step() observations={obs!r} is not a list of chat messages")
        meta = out.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{who}: step() metadata={meta!r} is not a dict")
        step = EnvStep(observations=list(obs or []), reward=out["reward"], done=out["done"],
                       metadata=dict(meta or {}))
    else:
        raise ValueError(f"{who}: step() returned {type(out).__name__}, "
                         "want a dict {observations, reward, done, metadata} or an EnvStep")
    r = step.reward
    if r is None:
        r = 0.0
    if isinstance(r, (bool, np.bool_)) or not isinstance(r, (numbers.Real, np.number)) or not math.isfinite(float(r)):
        raise ValueError(f"{who}: step() reward={step.reward!r} ({type(step.reward).__name__}) is not a finite number")
    step.reward = float(r)
    d = step.done
    if isinstance(d, (bool, np.bool_)) or (isinstance(d, (int, np.integer)) and d in (0, 1)):
        step.done = bool(d)
    else:
        raise ValueError(f"{who}: step() done={d!r} ({type(d).__name__}) is not a bool")
    for i, m in enumerate(step.observations):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{who}: step() observations[{i}] is not a chat message {{role, content}}: {m!r}")
        for k in ("role", "content"):
            if not isinstance(m[k], str):
                raise ValueError(f"{who}: step() observations[{i}].{k}={m[k]!r} ({type(m[k]).__name__}) "
                                 "is not a string")
    return step


ENVS: dict[str, Callable[..., TextEnv]] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make ``name`` an ``env_class`` of ours."""

    def deco(cls: type) -> type:
        ENVS[name] = cls
        return cls

    return deco
