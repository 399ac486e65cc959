"""Multi-turn text environments, in the Gymnasium style of SkyRL-gym's ``BaseTextEnv``.

An environment is made per trajectory and driven as::

    conversation, metadata = env.init(prompt_messages)
    out = env.step(action_text)   # {observations, reward, done, metadata} (a dict, as
                                  # SkyRL-gym returns, or an EnvStep)
    env.close()

``observations`` are chat messages (``{"role": "user" | "tool", "content": str}``) appended
to the conversation; the trajectory's reward is the sum of the step rewards. SkyRL-gym
environments (``skyrl_gym.make(id, env_config=..., extras=...)``) run unchanged; ours
subclass :class:`TextEnv` and are registered by name in :data:`ENVS`.

Selection (:func:`make_env`): the data row's ``env_class`` (``Row.extra_info["env_class"]``
or ``Row.metadata["env_class"]``; verl/SkyRL files carry it as a column) or else
``agent.env_class``. A name in :data:`ENVS` is ours; ``skyrl_gym:<id>`` (or any id SkyRL-gym
has registered) is SkyRL-gym's. The row's label becomes ``extras["reward_spec"]["ground_truth"]``
and its ``extra_info`` ``extras["extra_info"]``, as SkyRL's dataset rows carry them.
"""

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


def env_class_of(problem: Any, default: str | None) -> str | None:
    """The row's ``env_class`` (extra_info, then metadata), else ``default``."""
    for attr in ("extra_info", "metadata"):
        d = getattr(problem, attr, None)
        if isinstance(d, dict) and d.get("env_class"):
            return str(d["env_class"])
    return default


def env_extras(problem: Any) -> dict[str, Any]:
    """SkyRL-gym's ``extras`` for a data row: ``reward_spec.ground_truth`` (the row's answer)
    and ``extra_info``."""
    extra = dict(getattr(problem, "extra_info", None) or {})
    return {"reward_spec": {"method": "rule", "ground_truth": str(getattr(problem, "answer", ""))},
            "extra_info": extra, **({"max_turns": extra["max_turns"]} if "max_turns" in extra else {})}


def make_env(name: str, problem: Any, env_config: dict[str, Any] | None = None) -> Any:
    """A fresh environment ``name`` for ``problem`` (module docstring). ValueError naming the
    class and the known ones when it exists nowhere."""
    extras = env_extras(problem)
    if name in ENVS:
        return ENVS[name](env_config=env_config or {}, extras=extras)
    sk_id = name.split(":", 1)[1] if name.startswith("skyrl_gym:") else name
    try:
        import skyrl_gym
    except ImportError:
        skyrl_gym = None
    if skyrl_gym is not None:
        from skyrl_gym.envs.registration import registry

        if sk_id in registry:
            from omegaconf import OmegaConf

            return skyrl_gym.make(sk_id, env_config=OmegaConf.create(env_config or {}), extras=extras)
    known = sorted(ENVS) + ([f"skyrl_gym:{k}" for k in sorted(registry)] if skyrl_gym is not None else [])
    raise ValueError(f"unknown env_class {name!r} (agent.env_class or the row's env_class); known: {known}"
                     + ("" if skyrl_gym is not None else "; SkyRL-gym is not installed (pip install "
                        "'moe-async[agent]')"))
