"""Rewards chosen per row by its ``data_source`` (verl's convention), for prompts from files.

A row's spec is ``data.rewards[data_source]``, else a known source's built-in
(:data:`KNOWN_SOURCES`), else ``data.default_reward``; none is an error at start-up naming the
source. Specs: ``math_verify``, ``gsm8k``, ``exact_match``, ``reasoning_gym``, ``verl:<file>``,
``function:<module>:<fn>``, ``remote:<URL>``; each returns a float score.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from pathlib import Path
from typing import Callable, Mapping, Protocol
from urllib.parse import urlsplit

from moe_async.rollout.rewards import (FunctionReward, MathVerifyReward, RemoteReward, RewardConfigError,
                                       RewardValueError, ScoredPrompt, check_reward_value, resolve_import_path)
from moe_async.rollout.tasks import extract_answer
from moe_async.types import JsonDict

BUILTIN = ("math_verify", "gsm8k", "exact_match", "reasoning_gym")
KNOWN_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k", "gsm8k": "gsm8k",
    "lighteval/MATH": "math_verify", "DigitalLearningGmbH/MATH-lighteval": "math_verify",
    "HuggingFaceH4/MATH-500": "math_verify", "math_dapo": "math_verify", "math": "math_verify",
    "BytedTsinghua-SIA/DAPO-Math-17k": "math_verify", "agentica-org/DeepScaleR-Preview-Dataset": "math_verify",
    "deepscaler": "math_verify", "aime": "math_verify", "aime24": "math_verify", "aime25": "math_verify",
}
_GSM = re.compile(r"####\s*([^\n]*)")


def check_spec(spec: str, field: str) -> None:
    """Refuse a malformed spec at start-up (:class:`RewardConfigError` naming ``field``)."""
    kind, _, rest = spec.partition(":")
    if spec in BUILTIN:
        return
    if kind == "verl":
        path, _, fn = rest.partition(":")
        _load_verl(path, fn or "compute_score", field)
    elif kind == "function":
        resolve_import_path(rest, f"{field} ({spec!r})")
    elif kind == "remote":
        if not rest.startswith(("http://", "https://")) or not urlsplit(rest).hostname:
            raise RewardConfigError(f"{field}={spec!r}: remote needs an http(s) URL")
    else:
        raise RewardConfigError(f"{field}={spec!r} is not a reward spec: {list(BUILTIN)}, 'verl:<file.py>[:fn]', "
                                "'function:<module>:<fn>' or 'remote:<URL>'")


class PromptRow(ScoredPrompt, Protocol):
    """What a per-row reward reads of a data file's row (:class:`~moe_async.data.rows.Row`)."""

    @property
    def data_source(self) -> str | None: ...

    @property
    def metadata(self) -> JsonDict: ...

    @property
    def extra_info(self) -> JsonDict: ...


class RewardSpecs(Protocol):
    """The reward choice per data_source (``DataConfig``'s ``data.rewards`` and
    ``data.default_reward``; a :class:`RowReward`)."""

    @property
    def rewards(self) -> Mapping[str, str]: ...

    @property
    def default_reward(self) -> str | None: ...


def spec_for(data_source: str | None, data: RewardSpecs) -> tuple[str, str]:
    """``(spec, config field that chose it)`` for ``data_source``. Raises KeyError when none."""
    if data_source is not None and data_source in data.rewards:
        return data.rewards[data_source], f"data.rewards[{data_source!r}]"
    if data_source in KNOWN_SOURCES:
        return KNOWN_SOURCES[data_source], f"built-in for data_source {data_source!r}"
    if data_source is not None and _is_rg(data_source):
        return "reasoning_gym", f"built-in for reasoning-gym dataset {data_source!r}"
    if data.default_reward is not None:
        return data.default_reward, "data.default_reward"
    raise KeyError(data_source)


def _is_rg(name: str) -> bool:
    from reasoning_gym.factory import DATASETS

    return name in DATASETS


def _load_verl(path: str, fn: str, field: str) -> Callable[..., object]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise RewardConfigError(f"{field}: verl reward file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"moe_async_user_reward_{abs(hash(str(p.resolve())))}", p)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"{field}: verl reward file {path!r} cannot be loaded as a Python module")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - the user's file
        raise RewardConfigError(f"{field}: cannot load {path!r}: {type(e).__name__}: {e}") from e
    f = getattr(mod, fn, None)
    if not callable(f):
        raise RewardConfigError(f"{field}: {path!r} has no function {fn!r}")
    return f


def _math(gold: str, response: str) -> float:
    return MathVerifyReward()(_Gold(gold), response)


class _Gold:
    def __init__(self, answer: str):
        self.answer = answer
        self.question = ""


def gsm8k_score(answer: str, response: str) -> float:
    """GSM8K: gold after ``####`` (else the label), response after its last ``####`` (else
    math-verify's own extraction), compared by math-verify."""
    m = _GSM.findall(answer)
    gold = (m[-1] if m else answer).strip().replace(",", "")
    r = _GSM.findall(response)
    if r:
        response = f"${r[-1].strip().replace(',', '')}$"
    return _math(gold, response)


def exact_match(answer: str, response: str) -> float:
    """1.0 iff :func:`extract_answer` (``\\boxed{}`` first) equals the label, trimmed."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response or "")
    got = boxed[-1] if boxed else extract_answer(response)
    return 1.0 if got is not None and got.strip() == str(answer).strip() else 0.0


def reasoning_gym_score(row: PromptRow, response: str) -> float:
    """reasoning-gym's scorer of dataset ``row.data_source``, 1.0 iff it scores exactly 1.0."""
    from reasoning_gym import get_score_answer_fn

    ans = extract_answer(response)
    if ans is None:
        return 0.0
    meta = dict(row.metadata.get("reasoning_gym", row.metadata) or {})
    entry = {"question": row.question, "answer": row.answer, "metadata": meta}
    return 1.0 if float(get_score_answer_fn(row.data_source)(ans, entry)) == 1.0 else 0.0


def _builtin(kind: str, row: PromptRow, response: str) -> float:
    if kind == "math_verify":
        return _math(row.answer, response)
    if kind == "gsm8k":
        return gsm8k_score(row.answer, response)
    if kind == "reasoning_gym":
        return reasoning_gym_score(row, response)
    return exact_match(row.answer, response)


def builtin_score(row: PromptRow, response: str, data: RewardSpecs) -> float:
    """The row's built-in scorer (exact match when its spec is not a built-in)."""
    try:
        spec, _ = spec_for(row.data_source, data)
    except KeyError:
        spec = "exact_match"
    return _builtin(spec if spec in BUILTIN else "exact_match", row, response)


class RowReward:
    """``fn(row, response) -> float`` choosing the scorer by ``row.data_source`` (module
    docstring). Picklable (rewards, default and timeout only); user functions are loaded once
    per process that scores."""

    def __init__(self, rewards: dict[str, str], default: str | None, timeout_s: float = 10.0):
        self.rewards, self.default, self.timeout_s = dict(rewards), default, float(timeout_s)
        self._fns: dict[str, Callable[[PromptRow, str], object]] = {}

    @property
    def default_reward(self) -> str | None:
        return self.default

    def _fn(self, spec: str) -> Callable[[PromptRow, str], object]:
        if spec not in self._fns:
            kind, _, rest = spec.partition(":")
            if spec in BUILTIN:
                self._fns[spec] = functools.partial(_builtin, spec)
            elif kind == "verl":
                path, _, name = rest.partition(":")
                f = _load_verl(path, name or "compute_score", spec)

                def verl(row: PromptRow, resp: str, f: Callable[..., object] = f) -> object:  # no label: ground_truth None, as verl's .get()
                    gt = row.answer if getattr(row, "has_label", True) else None
                    out = f(row.data_source, resp, gt, row.extra_info)
                    return out.get("score") if isinstance(out, dict) else out
                self._fns[spec] = verl
            elif kind == "function":
                self._fns[spec] = FunctionReward(rest)
            elif kind == "remote":
                self._fns[spec] = RemoteReward(rest, self.timeout_s)
            else:
                raise RewardConfigError(f"{spec!r} is not a reward spec")
        return self._fns[spec]

    def __call__(self, row: PromptRow, response: str) -> float:
        try:
            spec, _ = spec_for(row.data_source, self)
        except KeyError:
            raise RewardConfigError(f"no reward for data_source {row.data_source!r} (data.rewards, "
                                    "data.default_reward)") from None
        v = self._fn(spec)(row, response)
        v = check_reward_value(v, f"reward {spec!r} (data_source {row.data_source!r})")
        if not math.isfinite(v):  # pragma: no cover - check_reward_value refuses it
            raise RewardValueError(f"reward {spec!r} returned {v}")
        return v

    def __getstate__(self) -> dict:
        return {"rewards": self.rewards, "default": self.default, "timeout_s": self.timeout_s, "_fns": {}}
