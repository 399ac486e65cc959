"""The distillation teacher's servers (moe_async/distill): their own engine pool, never
weight-synced, or servers already running (``teacher.urls``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_async.errors import UserInputError


def teacher_model_path(cfg: Any, student_path: str) -> str:
    """The checkpoint the teacher engines serve: ``teacher.model_path``, else the student's.

    Raises: UserInputError naming ``teacher.model_path`` when it has no ``config.json``, or
    when its vocabulary is smaller than the student's (it scores the student's token ids)."""
    t = cfg.teacher
    path = t.model_path or student_path
    cj = Path(path) / "config.json"
    if not cj.is_file():
        raise UserInputError(f"teacher.model_path={t.model_path!r}: no HF checkpoint there ({cj} not found)")
    tv = int(json.loads(cj.read_text()).get("vocab_size", 0))
    sv = int(json.loads((Path(student_path) / "config.json").read_text()).get("vocab_size", 0))
    if tv < sv:
        raise UserInputError(f"teacher.model_path={t.model_path!r}: vocab_size {tv} is smaller than the student's "
                             f"{sv}; the teacher scores the student's token ids and must share its tokenizer")
    return path


def start_teacher(cfg: Any, student_path: str) -> tuple[Any, list[str] | None]:
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
