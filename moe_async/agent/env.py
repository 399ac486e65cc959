"""Multi-turn text environments, in the Gymnasium style of SkyRL-gym's ``BaseTextEnv``.

An environment is made per trajectory and driven as::

    conversation, metadata = env.init(prompt_messages)
    out = env.step(action_text)   # {observations, reward, done, metadata} (a dict, as
                                  # SkyRL-gym returns, or an EnvStep)
    env.close()

``observations`` are chat messages appended to the conversation; the trajectory's reward is
the sum of the step rewards. SkyRL-gym's environments run unchanged; ours subclass
:class:`TextEnv` and are registered by name in :data:`ENVS`.

Selection (:func:`make_env`): the data row's ``env_class`` (``Row.extra_info["env_class"]``
or ``Row.metadata["env_class"]``; verl/SkyRL files carry it as a column) or else
``agent.env_class``: a name in :data:`ENVS`, or a SkyRL-gym id (``skyrl_gym:<id>``). The row's
label and ``extra_info`` become SkyRL's ``extras`` (:func:`env_extras`).
"""

from __future__ import annotations


import moe_async.agent.builtin  # noqa: F401 - registers the built-in environments
from moe_async.agent.env_base import ENVS, Env, EnvStep, TextEnv, as_step, register_env
from moe_async.types import JsonDict

__all__ = ["ENVS", "EnvStep", "TextEnv", "as_step", "register_env", "check_env_class", "env_class_of",
           "env_extras", "make_env"]


def env_class_of(problem: object, default: str | None) -> str | None:
    """The row's ``env_class`` (extra_info, then metadata), else ``default``."""
    for attr in ("extra_info", "metadata"):
        d = getattr(problem, attr, None)
        if isinstance(d, dict) and d.get("env_class"):
            return str(d["env_class"])
    return default


def env_extras(problem: object) -> JsonDict:
    """SkyRL-gym's ``extras`` for a data row: ``reward_spec.ground_truth`` (the row's answer)
    and ``extra_info``."""
    extra = dict(getattr(problem, "extra_info", None) or {})
    return {"reward_spec": {"method": "rule", "ground_truth": str(getattr(problem, "answer", ""))},
            "extra_info": extra, **({"max_turns": extra["max_turns"]} if "max_turns" in extra else {})}


def check_env_class(name: str) -> str:
    """``"ours"`` or the SkyRL-gym id that ``name`` selects. ValueError naming the class and
    the known ones when it exists nowhere."""
    if name in ENVS:
        return "ours"
    sk_id = name.split(":", 1)[1] if name.startswith("skyrl_gym:") else name
    try:
        from skyrl_gym.envs.registration import registry
    except ImportError:
        registry = None
    if registry is not None and sk_id in registry:
        return sk_id
    known = sorted(ENVS) + ([f"skyrl_gym:{k}" for k in sorted(registry)] if registry is not None else [])
    raise ValueError(f"unknown env_class {name!r} (rollout.agent.env_class or the row's env_class); known: {known}"
                     + ("" if registry is not None else "; SkyRL-gym is not installed (pip install "
                        "'moe-async[agent]')"))


def make_env(name: str, problem: object, env_config: JsonDict | None = None) -> Env:
    """A fresh environment ``name`` for ``problem`` (module docstring); ValueError as
    :func:`check_env_class`."""
    kind = check_env_class(name)
    extras = env_extras(problem)
    if kind == "ours":
        return ENVS[name](env_config=env_config or {}, extras=extras)
    import skyrl_gym
    from omegaconf import OmegaConf

    return skyrl_gym.make(kind, env_config=OmegaConf.create(env_config or {}), extras=extras)
