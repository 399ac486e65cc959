"""Which run this is, where it writes, and what it resumes from (``trainer.resume``).

The run id is ``MOE_ASYNC_RUN_ID`` when set (a requeued job finds its run dir again), else the
new run dir's name. A save dir is owned by the run that claimed it (:data:`OWNER_FILE`):
:func:`plan_start` refuses, before any process starts, a save dir holding another run's
checkpoints, naming the directory and its owner.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_async.errors import UserInputError
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from moe_async.config import ExperimentConfig

OWNER_FILE = "moe_async_owner.json"
RUN_ID_ENV = "MOE_ASYNC_RUN_ID"
_STEP = re.compile(r"step_(\d+)")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class StartPlan:
    """What :func:`plan_start` decided: ``run_id`` (None: the new run dir's name), ``run_dir``
    (None: a new stamped one), ``save_dir`` (None: ``<run dir>/checkpoints``), the checkpoint to
    load and its step (``None, 0``: start), and whether it was found by ``resume: auto``."""

    run_id: str | None
    run_dir: Path | None
    save_dir: Path | None
    load_path: str | None
    start_step: int
    auto_resumed: bool = False


def env_run_id() -> str | None:
    """``MOE_ASYNC_RUN_ID`` (None when unset or empty). Raises UserInputError naming it when it
    is not 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit."""
    rid = os.environ.get(RUN_ID_ENV) or None
    if rid is not None and not _ID.fullmatch(rid):
        raise UserInputError(f"{RUN_ID_ENV}={rid!r}: a run id is 1-128 characters of letters, digits, '.', '_', "
                             "'-' (starting with a letter or digit)")
    return rid


def step_dirs(save_dir: Path) -> dict[int, Path]:
    """``{N: <save_dir>/step_<N>}`` of the finished checkpoints there (``.tmp`` ones excluded)."""
    if not save_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in save_dir.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()}


def owner(save_dir: Path) -> JsonDict | None:
    """The owner file's dict (``run_id``, ``run_dir``); None when there is none. A file that is not
    a JSON object with a ``run_id`` reads as ``{"run_id": None}`` (an unknown owner)."""
    f = save_dir / OWNER_FILE
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
        return d if isinstance(d, dict) and d.get("run_id") else {"run_id": None}
    except (OSError, ValueError):
        return {"run_id": None}


def _has_checkpoints(save_dir: Path) -> bool:
    return bool(step_dirs(save_dir)) or (save_dir / "latest").is_file()


def plan_start(cfg: ExperimentConfig, resolve_checkpoint: Callable[[ExperimentConfig], tuple[str | None, int]]) -> StartPlan:
    """Decide run dir, save_dir and checkpoint (``docs/design/orchestration.md``). ``resolve_checkpoint(cfg)``
    is the driver's ``trainer.load`` resolver (``(path, step)``, raising UserInputError).

    Raises:
        UserInputError: naming ``trainer.save_dir`` (or the run dir's checkpoints) and the run
            owning it; naming the existing run dir and ``trainer.resume``; naming
            ``MOE_ASYNC_RUN_ID``; whatever ``resolve_checkpoint`` raises.
    """
    t = cfg.trainer
    rid = env_run_id()
    run_dir = Path(cfg.logging.output_dir).expanduser().resolve() / f"{cfg.name}-{rid}" if rid else None
    if run_dir is not None and t.resume == "never" and (run_dir / "config.yaml").exists():
        raise UserInputError(f"run directory {run_dir} exists ({RUN_ID_ENV}={rid}) and trainer.resume='never': "
                             "set trainer.resume=auto to continue that run, or another run id")
    if t.save_dir is not None:
        save_dir: Path | None = Path(t.save_dir).expanduser().resolve()
    else:
        save_dir = run_dir / "checkpoints" if run_dir is not None else None
    where = f"trainer.save_dir={t.save_dir!r}" if t.save_dir is not None else f"the run's checkpoint directory"
    own = owner(save_dir) if save_dir is not None else None
    mine = own is not None and rid is not None and own.get("run_id") == rid
    if t.resume == "auto" and save_dir is not None and mine and (save_dir / "latest").is_file():
        auto_cfg = cfg.model_copy(update={"trainer": t.model_copy(update={"load": str(save_dir)})})
        load_path, step = resolve_checkpoint(auto_cfg)
        return StartPlan(rid, run_dir, save_dir, load_path, step, auto_resumed=True)
    load_path, step = resolve_checkpoint(cfg)
    if save_dir is not None:
        for up in save_dir.parents:  # never write inside another run's checkpoint directory
            if (up / OWNER_FILE).is_file():
                up_own = owner(up) or {}
                raise UserInputError(f"{where}: {save_dir} is inside {up}, the checkpoint directory of run "
                                     f"{up_own.get('run_id')!r}: choose a directory of its own")
    other = (own or {}).get("run_id") not in (None, rid)  # claimed by another run, saved or not yet
    if save_dir is not None and not mine and (_has_checkpoints(save_dir) or other):
        continues = load_path is not None and Path(load_path).resolve().parent == save_dir \
            and all(n <= step for n in step_dirs(save_dir))
        if not continues:
            who = (own or {}).get("run_id")
            by = f"run {who!r}" if who else f"an unknown run (no readable {OWNER_FILE})"
            hint = (" (trainer.resume=auto resumes only the run's own checkpoints: set MOE_ASYNC_RUN_ID to that "
                    "run's id to continue it)" if t.resume == "auto" else "")
            if not _has_checkpoints(save_dir):
                raise UserInputError(f"{where}: {save_dir} belongs to {by}, which has saved no checkpoint yet "
                                     f"and may still be running; choose another trainer.save_dir{hint}")
            raise UserInputError(f"{where}: {save_dir} holds checkpoints of {by} (steps "
                                 f"{sorted(step_dirs(save_dir))}); this run would overwrite them: choose another "
                                 f"trainer.save_dir, or continue that run with trainer.load={save_dir}{hint}")
    return StartPlan(rid, run_dir, save_dir, load_path, step)


def claim(save_dir: Path, run_id: str, run_dir: Path) -> None:
    """Write :data:`OWNER_FILE` in ``save_dir`` (created), atomically; the previous owner, if
    another, is kept as ``continued_from``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    prev = owner(save_dir)
    d: JsonDict = {"run_id": run_id, "run_dir": str(run_dir)}
    if prev and prev.get("run_id") not in (None, run_id):
        d["continued_from"] = prev["run_id"]
    tmp = save_dir / (OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps(d) + "\n")
    os.replace(tmp, save_dir / OWNER_FILE)


def trim_metrics(run_dir: Path, step: int, name: str = "metrics.jsonl") -> int:
    """Move the lines of ``run_dir/name`` (``metrics.jsonl``, ``trained_rows.jsonl``) with
    ``"step" > step`` to ``<stem>.superseded.jsonl`` (appended); returns how many moved. Lines
    that are not JSON objects stay where they are."""
    f = run_dir / name
    stem = name.removesuffix(".jsonl")
    if not f.is_file():
        return 0
    keep: list[str] = []
    moved: list[str] = []
    for line in f.read_text().splitlines(keepends=True):
        try:
            s = json.loads(line).get("step")
        except (ValueError, AttributeError):
            s = None
        (moved if isinstance(s, int) and s > step else keep).append(line)
    if moved:
        with open(run_dir / f"{stem}.superseded.jsonl", "a") as out:
            out.writelines(moved)
        tmp = run_dir / f"{name}.tmp"
        tmp.write_text("".join(keep))
        os.replace(tmp, f)
    return len(moved)
