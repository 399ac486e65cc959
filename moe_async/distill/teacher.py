"""The teacher pool's client side: score every sampled response token with the teacher.

Per sample: the teacher's prompt + the sample's exact response token ids -> one SGLang
``/generate`` scoring call (:meth:`moe_async.engines.client.EngineClient.score`), round-robin
over the teacher engines, at most ``teacher.max_concurrent_requests`` in flight, each bounded by
``teacher.timeout_s`` -> ``sample.teacher_logprobs`` ``[R]``; with ``teacher.topk_forward_kl_coef
> 0`` also the teacher's ``teacher.top_k`` best tokens per position (``top_logprobs_num``) ->
``sample.teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[R, k]``. No re-tokenisation.

Failures: a call that raises, times out, or replies other than one finite logprob <= 0 per
scored token (asked for top-k: and ``k`` distinct ids with finite logprobs <= 0 per token;
``teacher/bad_replies``) leaves them None (a zero distillation advantage, :mod:`.advantages`)
and is counted (``teacher/failures``, ``teacher/timeouts``); each error names the teacher URL.
``teacher.max_consecutive_failures`` failures in a row raise :class:`TeacherFailureError`;
before the teacher's first scored sample the limit is ``first_limit`` (one step's samples) when
smaller, so a teacher that never scores stops the run before its first step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from moe_async.distill.config import TeacherConfig
from moe_async.types import JsonDict, Sample, template_ids

if TYPE_CHECKING:
    from moe_async.engines.client import EngineClient
    from moe_async.logging.timeline import SpanRecorder

log = logging.getLogger(__name__)
_MAX_LOGGED_ERRORS = 5


class TeacherFailureError(RuntimeError):
    """The teacher failed to score too many samples in a row; the message names it and the last error."""


def few_shot_examples(task: str, task_kwargs: JsonDict, k: int) -> list[tuple[str, str]]:
    """``k`` worked ``(question, answer)`` pairs of a reasoning-gym task, the same for every
    prompt: the task's one-shot example first (``rollout.prompt_style='one_shot'``'s, so
    ``few_shot: 1`` shows the teacher exactly that prompt), then problems drawn with a fixed
    seed apart from the train/eval seeds, answered ``"The answer is A."``."""
    from moe_async.rollout.tasks import ONE_SHOT_EXAMPLES

    out = [ONE_SHOT_EXAMPLES[task]] if task in ONE_SHOT_EXAMPLES and k else []
    if k > len(out):
        import reasoning_gym

        ds = reasoning_gym.create_dataset(task, seed=987_654_323, size=k - len(out), **task_kwargs)
        out += [(e["question"], f"The answer is {e['answer']}.") for e in ds]
    return out


def teacher_messages(student: list[dict[str, str]], examples: list[tuple[str, str]],
                     system_prompt: str | None) -> list[dict[str, str]]:
    """The teacher's chat: the student's messages with the system message's content replaced by
    ``system_prompt`` (when given) and the ``examples`` as user/assistant turns right after it."""
    msgs = [dict(m) for m in student]
    head = 1 if msgs and msgs[0]["role"] == "system" else 0
    if system_prompt is not None:
        if head:
            msgs[0]["content"] = system_prompt
        else:
            msgs.insert(0, {"role": "system", "content": system_prompt})
            head = 1
    shots = [m for q, a in examples for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return msgs[:head] + shots + msgs[head:]


#: ``(problem, student prompt ids) -> teacher prompt ids``.
TeacherPromptFn = Callable[[object, list[int]], list[int]]


def make_teacher_prompt_fn(cfg: TeacherConfig, dataset: Any, task: str, task_kwargs: JsonDict
                           ) -> TeacherPromptFn:
    """``fn(problem, student_prompt_ids) -> teacher prompt ids``. Without ``few_shot`` and
    ``system_prompt`` the teacher sees the student's prompt ids unchanged; otherwise the
    dataset's chat messages (``dataset.messages(problem)``, task prompts) are rebuilt by
    :func:`teacher_messages` and tokenised with the student's tokenizer's chat template.

    Raises: ValueError naming ``teacher.few_shot`` for a dataset other than rollout.task's
    generated problems (prompt files: the examples are the generator's, not the rows'), and
    ``teacher.system_prompt`` for one without chat messages."""
    from moe_async.rollout.tasks import TaskDataset

    if cfg.few_shot == 0 and cfg.system_prompt is None:
        return lambda problem, ids: list(ids)
    if cfg.few_shot and not isinstance(dataset, TaskDataset):
        raise ValueError(f"teacher.few_shot={cfg.few_shot} needs rollout.task's generated problems: its worked examples "
                         f"are the {task!r} generator's, not your rows ({type(dataset).__name__}); set "
                         "teacher.few_shot=0 and use teacher.system_prompt or a teacher model (teacher.model_path)")
    if not hasattr(dataset, "messages"):
        raise ValueError("teacher.system_prompt needs a dataset with chat messages to extend; use a teacher model "
                         "(teacher.model_path) instead")
    examples = few_shot_examples(task, task_kwargs, cfg.few_shot)
    tok = dataset.tokenizer

    def fn(problem: object, ids: list[int]) -> list[int]:
        return template_ids(tok.apply_chat_template(teacher_messages(dataset.messages(problem), examples,
                                                                     cfg.system_prompt),
                                                    add_generation_prompt=True, tokenize=True))

    return fn


class TeacherScorer:
    """Scores groups' samples with the teacher engines (see the module docstring).

    Args:
        cfg: the ``teacher`` section.
        clients: async engine clients of the teacher servers (their ``score`` method).
        prompt_fn: ``(problem, student_prompt_ids) -> teacher prompt ids`` (:func:`make_teacher_prompt_fn`).
        source: how errors name the teacher (its model or URLs).
        first_limit: the failure limit until the first sample is scored (one training step's
            samples; 0: ``teacher.max_consecutive_failures`` throughout).
    """

    def __init__(self, cfg: TeacherConfig, clients: Sequence[EngineClient], prompt_fn: TeacherPromptFn,
                 source: str = "teacher", first_limit: int = 0):
        if not clients:
            raise ValueError("TeacherScorer needs at least one teacher engine client")
        self.cfg = cfg
        self.clients = list(clients)
        self.prompt_fn = prompt_fn
        self.source = source
        self._rr = itertools.count()
        self._sem: asyncio.Semaphore | None = None
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.streak = 0
        self.first_limit = int(first_limit)
        self.ever_scored = False
        self.first_error: str | None = None
        self.failure: TeacherFailureError | None = None

    async def score_group(self, problem: object, samples: list[Sample], trace: SpanRecorder | None = None) -> None:
        """Set ``teacher_logprobs`` of every sample (None where the teacher failed); spans
        ``teacher <i>`` / ``score`` into ``trace`` (a :class:`~moe_async.logging.timeline.SpanRecorder`).

        Raises: TeacherFailureError at ``teacher.max_consecutive_failures`` failures in a row."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.max_concurrent_requests)
        prompt = self.prompt_fn(problem, samples[0].prompt_ids) if samples else []
        where = getattr(problem, "index", None)
        errors = await asyncio.gather(*(self._score_one(prompt, s, trace, f"problem {where} sample {i}")
                                        for i, s in enumerate(samples)))
        for err, s in zip(errors, samples):
            if err is None:
                self.streak = 0
                self.ever_scored = self.ever_scored or bool(s.response_ids)
                continue
            self.streak += 1
            self.first_error = self.first_error or err
            lim = self.cfg.max_consecutive_failures
            if lim and self.first_limit and not self.ever_scored:
                lim = min(lim, self.first_limit)
            if lim and self.streak >= lim and self.failure is None:
                never = "" if self.ever_scored else ", every sample of the run so far"
                first = "" if self.first_error == err else f"; first error: {self.first_error}"
                self.failure = TeacherFailureError(
                    f"teacher ({self.source}) failed to score {self.streak} samples in a row{never} "
                    f"(teacher.max_consecutive_failures={self.cfg.max_consecutive_failures}); last error: {err}{first}")
        if self.failure is not None:
            raise self.failure

    async def _score_one(self, prompt: list[int], s: Sample, trace: SpanRecorder | None, where: str) -> str | None:
        """Score one sample (``where``: how a bad reply names it); returns None or the error."""
        s.teacher_logprobs = s.teacher_topk_ids = s.teacher_topk_logprobs = None
        k = self.cfg.top_k if self.cfg.topk_forward_kl_coef > 0 else 0
        if not s.response_ids:  # nothing to score: an empty list, not a failure
            s.teacher_logprobs = []
            if k:
                s.teacher_topk_ids, s.teacher_topk_logprobs = np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
            return None
        assert self._sem is not None
        async with self._sem:
            i = next(self._rr) % len(self.clients)
            url = getattr(self.clients[i], "base_url", f"teacher engine {i}")
            t0 = time.monotonic()
            w0 = trace.now() if trace is not None else 0.0
            err = None
            try:
                ids = list(prompt) + list(s.response_ids)
                out = await asyncio.wait_for(self.clients[i].score(ids, len(prompt), top_logprobs_num=k),
                                             self.cfg.timeout_s)
                err = _bad_reply(out.token_logprobs, len(s.response_ids))
                top = None
                if err is None and k:
                    top, err = _topk_arrays(getattr(out, "top_logprobs", None), len(s.response_ids), k)
                if err is None:
                    s.teacher_logprobs = [float(v) for v in out.token_logprobs]
                    if top is not None:
                        s.teacher_topk_ids, s.teacher_topk_logprobs = top
                else:
                    err = f"{url}: bad reply for {where}: {err}"
                    self.counters["bad_replies"] += 1
            except (asyncio.TimeoutError, TimeoutError):
                err = f"{url}: timeout: no result within teacher.timeout_s={self.cfg.timeout_s:g} s"
                self.counters["timeouts"] += 1
            except Exception as exc:  # noqa: BLE001 - a failed teacher call is counted, not fatal
                err = f"{url}: {type(exc).__name__}: {exc}"[:300]
                self.counters["errors"] += 1
            finally:
                self.counters["seconds"] += time.monotonic() - t0
                self.counters["requests"] += 1
                if trace is not None:
                    trace.add(f"teacher {i}", "score", w0, trace.now())
        if err is not None:
            self.counters["failures"] += 1
            s.metadata["teacher_error"] = err
            seen = self.__dict__.setdefault("_errors_seen", set())
            if err not in seen and len(seen) < _MAX_LOGGED_ERRORS:  # each distinct error once, the first few
                seen.add(err)
                log.warning("teacher (%s) failed to score a sample (its distillation advantage is 0): %s",
                            self.source, err)
            return err
        R = len(s.response_ids)
        self.counters["tokens"] += R
        assert s.teacher_logprobs is not None  # set by the scoring call above
        self.counters["kl_sum"] += sum(a - b for a, b in zip(s.rollout_logprobs, s.teacher_logprobs))
        return None

    def metrics(self) -> dict[str, float]:
        """Cumulative: ``teacher/requests``, ``teacher/failures`` (errors + timeouts + bad replies),
        ``teacher/timeouts``, ``teacher/errors``, ``teacher/bad_replies``, ``teacher/seconds`` (summed over requests), ``teacher/tokens``
        scored and ``teacher/kl_per_token`` (mean over scored tokens of ``logp_student -
        logp_teacher``, the student's sampling logprobs: a reverse-KL estimate)."""
        c = self.counters
        out = {f"teacher/{k}": float(c[k])
               for k in ("requests", "failures", "timeouts", "errors", "bad_replies", "seconds", "tokens")}
        out["teacher/kl_per_token"] = float(c["kl_sum"]) / c["tokens"] if c["tokens"] else 0.0
        return out


def _topk_arrays(rows: Sequence[Sequence[tuple[int, float]] | None] | None, n: int, k: int) -> tuple[tuple[np.ndarray, np.ndarray] | None, str | None]:
    """``((ids [n,k] int64, logprobs [n,k] float32), None)`` from a scoring reply's top
    logprobs (per position ``[(token_id, logprob)]``, best first), or ``(None, why)`` when they
    are not ``k`` distinct non-negative ids with finite logprobs <= 0 at each of ``n`` positions."""
    if rows is None:
        return None, f"no top logprobs (asked for top_logprobs_num={k})"
    if len(rows) != n:
        return None, f"{len(rows)} top-logprob rows for {n} scored tokens"
    try:
        ids = np.array([[int(e[0]) for e in (r or [])] for r in rows], dtype=np.int64)
        lps = np.array([[float(e[1]) for e in (r or [])] for r in rows], dtype=np.float64)
    except (TypeError, ValueError, IndexError):
        return None, "top logprobs are not (token id, logprob) rows of equal length"
    if ids.shape != (n, k):
        return None, f"top logprobs of shape {ids.shape}, want ({n}, {k}) (teacher.top_k={k})"
    for t in range(n):
        bad = not (np.isfinite(lps[t]).all() and (lps[t] <= 1e-6).all() and (ids[t] >= 0).all())
        if bad or len(set(ids[t].tolist())) != k:
            return None, f"top logprobs of scored token {t} are not {k} distinct ids with finite logprobs <= 0"
    return (ids, np.minimum(lps, 0.0).astype(np.float32)), None


def _bad_reply(logprobs: Sequence[float], n: int) -> str | None:
    """Why ``logprobs`` is not one finite logprob <= 0 for each of ``n`` scored tokens, or None."""
    try:
        vals = [float(v) for v in logprobs]
    except (TypeError, ValueError):
        return f"logprobs {str(logprobs)[:80]} are not numbers"
    if len(vals) != n:
        return f"{len(vals)} logprobs for {n} scored tokens"
    for t, v in enumerate(vals):
        if not math.isfinite(v) or v > 1e-6:
            return f"logprob {v!r} of scored token {t} is not a finite number <= 0"
    return None
