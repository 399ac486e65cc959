"""The distillation teacher's servers (moe_async/distill): their own engine pool, never
weight-synced, or servers already running (``teacher.urls``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

from moe_async.errors import UserInputError
from moe_async.types import Tokenizer

if TYPE_CHECKING:
    from moe_async.config import ExperimentConfig
    from moe_async.orchestration.engine_pool import EnginePool


def _vocab_size(cj: Path, field: str) -> int:
    """``vocab_size`` of the HF ``config.json`` ``cj``; UserInputError naming ``field`` and the
    file when it is unreadable, not JSON, or has no positive integer ``vocab_size``."""
    try:
        d = json.loads(cj.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserInputError(f"{field}: {cj} is not a readable JSON file ({type(exc).__name__}: {exc})") from None
    v = d.get("vocab_size") if isinstance(d, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserInputError(f"{field}: {cj} has vocab_size={v!r}, want a positive integer")
    return v


def _tokenizer(path: str, field: str) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        # transformers types its tokenizer classes' calls more widely than the Protocol the package uses
        return cast(Tokenizer, AutoTokenizer.from_pretrained(path))
    except Exception as exc:  # noqa: BLE001 - any failure is the checkpoint's, named
        raise UserInputError(f"{field}: no tokenizer loads from {path} ({type(exc).__name__}: {str(exc)[:200]})") \
            from None


def tokenizer_difference(student: Tokenizer, teacher: Tokenizer) -> str | None:
    """How two HF tokenizers differ in what scoring the student's token ids depends on (their
    vocabularies token -> id, then their special tokens and ids), or None when they agree."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        missing = sorted((t for t in sv if t not in tv), key=lambda t: sv[t])
        if missing:
            return (f"{len(missing)} of the student's tokens are not in the teacher's vocabulary, e.g. "
                    f"{missing[0]!r} (id {sv[missing[0]]})")
        moved = sorted((t for t in sv if tv[t] != sv[t]), key=lambda t: sv[t])
        if moved:
            t = moved[0]
            return f"{len(moved)} tokens have other ids, e.g. {t!r}: {sv[t]} in the student's, {tv[t]} in the teacher's"
        extra = sorted((t for t in tv if t not in sv), key=lambda t: tv[t])
        return f"the teacher's vocabulary has {len(extra)} tokens the student's lacks, e.g. {extra[0]!r} (id {tv[extra[0]]})"
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} differs: {a!r} in the student's, {b!r} in the teacher's"
    sa = sorted(zip(student.all_special_tokens, student.all_special_ids))
    ta = sorted(zip(teacher.all_special_tokens, teacher.all_special_ids))
    if sa != ta:
        return f"special tokens differ: {sa} in the student's, {ta} in the teacher's"
    return None


def check_teacher_top_k(cfg: ExperimentConfig, student_path: str) -> None:
    """With ``teacher.topk_forward_kl_coef > 0``: ``teacher.top_k`` must not exceed the
    student's ``vocab_size`` (the vocabulary the top-k forward KL is taken over; the teacher
    shares it). Raises UserInputError naming ``teacher.top_k`` and the checkpoint."""
    t = cfg.teacher
    if not (t.enabled and t.topk_forward_kl_coef > 0):
        return
    cj = Path(student_path) / "config.json"
    v = _vocab_size(cj, "the student's checkpoint")
    if t.top_k > v:
        raise UserInputError(f"teacher.top_k={t.top_k} exceeds the vocabulary ({cj}: vocab_size {v}); the top-k "
                             "forward KL takes at most every token: set teacher.top_k <= vocab_size")


def teacher_model_path(cfg: ExperimentConfig, student_path: str) -> str:
    """The checkpoint the teacher engines serve: ``teacher.model_path``, else the student's.

    The teacher scores the student's token ids, so it must share the student's tokenizer:
    another model's tokenizer must equal the student's (vocabulary and special tokens,
    :func:`tokenizer_difference`) and its ``vocab_size`` be at least the student's.

    Raises: UserInputError naming ``teacher.model_path`` and the file when it has no
    ``config.json`` or a malformed one, no loadable tokenizer, or another tokenizer."""
    t = cfg.teacher
    path = t.model_path or student_path
    field = f"teacher.model_path={t.model_path!r}"
    cj = Path(path) / "config.json"
    if not cj.is_file():
        raise UserInputError(f"{field}: no HF checkpoint there ({cj} not found)")
    tv = _vocab_size(cj, field)
    if not t.model_path or Path(t.model_path).resolve() == Path(student_path).resolve():
        return path
    sv = _vocab_size(Path(student_path) / "config.json", "the student's checkpoint")
    if tv < sv:
        raise UserInputError(f"{field}: vocab_size {tv} is smaller than the student's "
                             f"{sv}; the teacher scores the student's token ids and must share its tokenizer")
    diff = tokenizer_difference(_tokenizer(student_path, "the student's checkpoint"), _tokenizer(path, field))
    if diff is not None:
        raise UserInputError(f"{field}: its tokenizer is not the student's ({student_path}): {diff}; the teacher "
                             "scores the student's token ids and must share its tokenizer")
    return path


def start_teacher(cfg: ExperimentConfig, student_path: str) -> tuple[EnginePool | None, list[str] | None]:
    """``(pool, urls)``: with ``teacher.urls`` no pool and those URLs; else an
    :class:`~moe_async.orchestration.engine_pool.EnginePool` of ``teacher.engine`` serving
    :func:`teacher_model_path`, launched (the caller shuts it down). ``(None, None)`` without a
    teacher. Raises UserInputError naming ``teacher.urls`` when one does not answer ``/health``,
    and what :meth:`EnginePool.launch` raises (the pool is shut down first)."""
    t = cfg.teacher
    if not t.enabled:
        return None, None
    if t.urls:  # servers already running: each must answer /health now, not fail every sample later
        from moe_async.engines.client import SyncEngineClient
        from moe_async.errors import UserInputError

        down = []
        for u in t.urls:
            c = SyncEngineClient(u, timeout_s=10.0)
            try:
                if not c.health(timeout=10.0):
                    down.append(u)
            finally:
                c.close()
        if down:
            raise UserInputError(f"teacher.urls: {', '.join(down)} did not answer /health (start the teacher "
                                 "servers first, or leave teacher.urls empty to start teacher.engine)")
        return None, list(t.urls)
    from moe_async.orchestration.engine_pool import EnginePool
    from moe_async.orchestration.placement import place_engines

    path = teacher_model_path(cfg, student_path)
    pool = EnginePool(cfg.model_copy(update={"engine": t.engine}), path, placement=place_engines(cfg, engine=t.engine))
    try:
        return pool, pool.launch()
    except BaseException:
        pool.shutdown()
        raise


class TeacherRecovery:
    """Restarts the teacher engines (their own pool, never weight-synced: a restarted one serves
    the same frozen checkpoint at the same URL, so the scorer's clients need nothing new).

    :meth:`check` (called between the driver's waits, at most every ``interval_s``) restarts
    each engine whose server process exited, up to ``teacher.engine.max_restarts`` restarts
    per engine; one more death raises RuntimeError naming the teacher engine, why it died and
    the limit. ``pool``: ``dead_engines() -> ["engine <i> at <url> <why>"]``,
    ``restart(i, timeout_s) -> url`` (:class:`~moe_async.orchestration.engine_pool.EnginePool`).
    """

    def __init__(self, pool: EnginePool, max_restarts: int, startup_timeout_s: float, interval_s: float = 5.0):
        self.pool = pool
        self.max_restarts = int(max_restarts)
        self.timeout_s = float(startup_timeout_s) + 120.0
        self.interval_s = interval_s
        self.restarts: dict[int, int] = {}
        self.events: list[str] = []
        self._last = float("-inf")

    def check(self, now: float | None = None) -> list[int]:
        """Restart the dead teacher engines (class docstring); their indices."""
        import time

        now = time.monotonic() if now is None else now
        if now - self._last < self.interval_s:
            return []
        self._last = now
        out = []
        for line in self.pool.dead_engines():
            i = int(line.split()[1])
            n = self.restarts.get(i, 0)
            if n >= self.max_restarts:
                raise RuntimeError(f"teacher {line}; it was restarted {n} times already "
                                   f"(teacher.engine.max_restarts={self.max_restarts})")
            self.restarts[i] = n + 1
            self.pool.restart(i, self.timeout_s)
            self.events.append(f"teacher {line}: restarted ({n + 1}/{self.max_restarts})")
            out.append(i)
        return out
