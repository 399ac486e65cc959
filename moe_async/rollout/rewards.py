"""Built-in reward functions, chosen by ``rollout.reward``.

Each is a picklable ``fn(problem, response_text) -> float`` run by
:class:`moe_async.rollout.reward.RewardPool` under its per-sample timeout (a scorer that hangs,
raises or returns garbage costs one sample, never the loop): ``reasoning_gym``, ``math_verify``,
a function by import path, or a remote reward model over HTTP.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import importlib
import logging
import math
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

if TYPE_CHECKING:
    import httpx

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_MAX_CHARS = 20_000  # only the tail of a (possibly huge) response is parsed by math-verify


class ScoredPrompt(Protocol):
    """What a reward reads of a prompt (a reasoning-gym :class:`~moe_async.rollout.tasks.Problem`,
    a data file's :class:`~moe_async.data.rows.Row`): its question and gold answer."""

    @property
    def question(self) -> str: ...

    @property
    def answer(self) -> str: ...


class RewardSettings(Protocol):
    """The ``rollout.reward*`` fields :func:`build_reward_fn` reads (a ``RolloutConfig``)."""

    @property
    def reward(self) -> str: ...

    @property
    def reward_function(self) -> str | None: ...

    @property
    def reward_url(self) -> str | None: ...

    @property
    def reward_timeout_s(self) -> float: ...


class ScoresPrompts(Protocol):
    """A task source with its own scorer (the reasoning-gym dataset; a data file's dataset):
    the prompt type is the source's own, so it is left open here."""

    def score(self, problem: Any, response_text: str) -> float: ...


#: A reward function: ``(prompt, response text) -> reward`` (checked finite by the caller).
RewardFn = Callable[[ScoredPrompt, str], float]


class RewardConfigError(ValueError):
    """A reward setting cannot be used; the message names the ``rollout.*`` field."""


class RewardValueError(ValueError):
    """A reward function or server gave something that is not a finite number."""


def check_reward_value(value: object, field: str) -> float:
    """``float(value)`` when ``value`` is a finite bool/int/float (numpy scalars included),
    else :class:`RewardValueError` naming ``field`` and the value."""
    if isinstance(value, (bool, int, float)) or (
        isinstance(value, (np.generic, np.ndarray)) and value.shape == () and value.dtype.kind in "biuf"
    ):
        v = float(value)
        if math.isfinite(v):
            return v
    raise RewardValueError(
        f"{field} returned {value!r:.80} ({type(value).__name__}); expected a finite number"
    )


def resolve_import_path(path: str | None, field: str = "rollout.reward_function") -> Callable[..., object]:
    """Import ``"package.module:function"`` (the attribute may be dotted, ``mod:Class.method``).

    Raises:
        RewardConfigError: missing or malformed path, module not importable, attribute
            missing or not callable; the message names ``field``.
    """
    if not path or not isinstance(path, str) or not _IMPORT_PATH.match(path.strip()):
        raise RewardConfigError(f"{field}={path!r} must be an import path 'package.module:function'")
    mod_name, attr = path.strip().split(":", 1)
    try:
        obj: object = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - ImportError or an error while importing it
        raise RewardConfigError(f"{field}={path!r}: cannot import module {mod_name!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardConfigError(f"{field}={path!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardConfigError(f"{field}={path!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


class FunctionReward:
    """``rollout.reward='function'``: ``fn(response, answer, question) -> number``.

    Picklable: holds the import path and resolves it (once) in the process that scores.
    """

    field = "rollout.reward_function"

    def __init__(self, path: str | None):
        self.path = path
        self._fn: Callable[..., object] | None = resolve_import_path(path, self.field)

    def __call__(self, problem: ScoredPrompt, response: str) -> float:
        if self._fn is None:
            self._fn = resolve_import_path(self.path, self.field)
        v = self._fn(response, str(problem.answer), str(problem.question))
        return check_reward_value(v, f"{self.field} {self.path!r}")

    def __getstate__(self) -> dict:
        return {"path": self.path, "_fn": None}


class _PoolBoundsTheTimeout(logging.Filter):
    """Drops math-verify's one-time "Timeout is disabled" warning: off the main thread its own
    SIGALRM timeout cannot run, and the reward pool's per-sample timeout bounds the call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_PoolBoundsTheTimeout())


class MathVerifyReward:
    """``rollout.reward='math_verify'``: 1.0 iff math-verify finds the response's answer
    (``\\boxed{}`` first, else the last expression; last ``20_000`` chars) equal to the gold
    answer, else 0.0. The gold answer is parsed as given, then as ``$answer$``.
    Source: huggingface/Math-Verify (pip ``math-verify==0.9.0``)."""

    def __call__(self, problem: ScoredPrompt, response: str) -> float:
        from math_verify import parse, verify

        # math-verify's own timeouts use SIGALRM: only possible on a main thread (the pool's
        # timeout bounds the call in any case)
        main = threading.current_thread() is threading.main_thread()
        to = 5 if main else None
        gold_txt = str(problem.answer)
        gold = parse(gold_txt, parsing_timeout=to) or parse(f"${gold_txt}$", parsing_timeout=to)
        if not gold:
            raise RewardValueError(f"rollout.reward='math_verify': cannot parse the gold answer {gold_txt!r:.80}")
        pred = parse(str(response)[-_MAX_CHARS:], parsing_timeout=to)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=to) else 0.0


class RemoteReward:
    """``rollout.reward='remote'``: a reward model behind HTTP (see the module table).

    Raises (inside the pool, recorded per sample): :class:`RewardValueError` naming
    ``rollout.reward_url`` on a non-2xx status, a reply that is not JSON, or one without a
    finite ``reward``; TimeoutError (no reply within ``rollout.reward_timeout_s``) and
    ConnectionError (any other transport failure), both naming ``rollout.reward_url``.
    """

    field = "rollout.reward_url"

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url
        self.timeout_s = float(timeout_s)
        self._client: httpx.Client | None = None

    def __call__(self, problem: ScoredPrompt, response: str) -> float:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s)
        try:
            r = self._client.post(self.url, json={
                "question": str(problem.question), "response": str(response), "answer": str(problem.answer),
            })
        except httpx.TimeoutException as e:
            raise TimeoutError(f"{self.field}={self.url!r}: no reply within {self.timeout_s:g} s "
                               f"(rollout.reward_timeout_s; {type(e).__name__})") from e
        except httpx.HTTPError as e:
            raise ConnectionError(f"{self.field}={self.url!r}: {type(e).__name__}: {e}") from e
        if r.status_code // 100 != 2:
            raise RewardValueError(f"{self.field}={self.url!r} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError as e:
            raise RewardValueError(f"{self.field}={self.url!r} reply is not JSON: {r.text[:200]!r}") from e
        if not isinstance(body, dict) or "reward" not in body:
            raise RewardValueError(f"{self.field}={self.url!r} reply has no 'reward' key: {str(body)[:200]}")
        return check_reward_value(body["reward"], f"{self.field}={self.url!r}")

    def __getstate__(self) -> dict:
        return {"url": self.url, "timeout_s": self.timeout_s, "_client": None}


def build_reward_fn(cfg: RewardSettings, dataset: ScoresPrompts) -> RewardFn:
    """The scorer ``fn(problem, response_text) -> float`` for ``cfg`` (a ``RolloutConfig``).

    Raises: RewardConfigError naming the field (bad import path, missing URL).
    """
    kind = cfg.reward
    if kind == "reasoning_gym":
        return dataset.score
    if kind == "math_verify":
        return MathVerifyReward()
    if kind == "function":
        return FunctionReward(cfg.reward_function)
    if kind == "remote":
        if not cfg.reward_url:
            raise RewardConfigError("rollout.reward_url must be set when rollout.reward='remote'")
        return RemoteReward(cfg.reward_url, cfg.reward_timeout_s)
    raise RewardConfigError(f"rollout.reward={kind!r} is not a built-in reward")
