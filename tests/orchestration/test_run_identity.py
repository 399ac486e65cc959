"""Run identity at start-up: a save directory's owner (a fresh run pointed at another run's
checkpoints is refused naming the directory and the owning run, and never touches them),
``trainer.resume: auto`` (a requeued run finds its own latest checkpoint and run dir),
``metrics.jsonl`` kept continuous on resume, and a config whose engines need GPUs refused
where there are none (naming the field, before any process or run dir)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_async.config import load_config
from moe_async.errors import UserInputError
from moe_async.orchestration import driver
from moe_async.orchestration.run_identity import OWNER_FILE, claim, owner, plan_start, trim_metrics

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "cpu_smoke.yaml"


def _run_a(save: Path, steps=(1, 2, 3, 4, 5), run_id: str | None = "run-a") -> None:
    """Run A's save dir: step_1..step_5 with files, ``latest`` at step_5, A's owner file."""
    for n in steps:
        (save / f"step_{n}").mkdir(parents=True)
        (save / f"step_{n}" / "moe_async_version.txt").write_text(str(n))
        (save / f"step_{n}" / "__0_0.distcp").write_bytes(bytes([n]) * 64)
    (save / "latest").write_text(f"step_{steps[-1]}\n")
    if run_id:
        claim(save, run_id, save.parent / "run-a-dir")


def _tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _no_processes(monkeypatch):
    def no_process(*a, **k):
        raise AssertionError("a process or Ray was started")

    monkeypatch.setattr(driver, "init_ray", no_process)


@pytest.mark.parametrize("resume", ["never", "auto"])
@pytest.mark.parametrize("a_owner", ["run-a", None])
def test_fresh_run_given_another_runs_save_dir_is_refused_and_touches_nothing(tmp_path, monkeypatch, resume,
                                                                               a_owner) -> None:
    """Run A saved steps 1-5; run B (fresh; also with resume=auto under its own id) is given
    A's save dir: refused at start-up naming the dir and A; every file of A's is unchanged and
    B made no run dir (before this check, B trained and replaced A's step dirs)."""
    save = tmp_path / "a_ckpt"
    _run_a(save, run_id=a_owner)
    before = _tree(save)
    monkeypatch.setenv("MOE_ASYNC_RUN_ID", "run-b")
    _no_processes(monkeypatch)
    cfg = load_config(SMOKE, [f"trainer.save_dir={save}", "trainer.save_interval=1", f"trainer.resume={resume}",
                              f"logging.output_dir={tmp_path / 'runs'}"])
    who = re.escape("run 'run-a'" if a_owner else f"an unknown run (no readable {OWNER_FILE})")
    with pytest.raises(UserInputError, match=rf"trainer\.save_dir='{save}': {save} holds checkpoints of "
                                             rf"{who} \(steps \[1, 2, 3, 4, 5\]\)"):
        driver.run_experiment(cfg)
    assert _tree(save) == before and (save / "latest").read_text() == "step_5\n"
    assert not (tmp_path / "runs").exists()


def test_continuing_the_latest_checkpoint_of_a_save_dir_is_allowed(tmp_path, monkeypatch) -> None:
    """trainer.load into the save dir at its newest step: that line of checkpoints continues
    (nothing above the loaded step to overwrite); at an older step it is refused."""
    save = tmp_path / "a_ckpt"
    _run_a(save)
    monkeypatch.delenv("MOE_ASYNC_RUN_ID", raising=False)

    def resolver(c):
        if c.trainer.load is None:
            return None, 0
        p = Path(c.trainer.load)
        p = p / (p / "latest").read_text().strip() if (p / "latest").is_file() else p
        return str(p), int(p.name.split("_")[1])

    cfg = load_config(SMOKE, [f"trainer.save_dir={save}", f"trainer.load={save}"])
    plan = plan_start(cfg, resolver)
    assert (plan.load_path, plan.start_step, plan.auto_resumed) == (str(save / "step_5"), 5, False)
    cfg = load_config(SMOKE, [f"trainer.save_dir={save}", f"trainer.load={save / 'step_3'}"])
    with pytest.raises(UserInputError, match="holds checkpoints of run 'run-a'"):
        plan_start(cfg, resolver)
    claim(save, "run-c", tmp_path / "c")
    assert owner(save) == {"run_id": "run-c", "run_dir": str(tmp_path / "c"), "continued_from": "run-a"}


def test_resume_auto_finds_the_runs_own_checkpoint_and_run_dir(tmp_path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    cfg_args = [f"logging.output_dir={runs}", "trainer.save_interval=1"]
    monkeypatch.setenv("MOE_ASYNC_RUN_ID", "slurm-c-42")
    run_dir = runs / "cpu_smoke-slurm-c-42"
    seen = []

    def resolver(c):
        seen.append(c.trainer.load)
        return (str(Path(c.trainer.load) / "step_2"), 2) if c.trainer.load else (None, 0)

    cfg = load_config(SMOKE, cfg_args + ["trainer.resume=auto", "name=cpu_smoke"])
    plan = plan_start(cfg, resolver)  # first start: nothing saved yet
    assert (plan.run_dir, plan.save_dir, plan.load_path, plan.start_step) == (run_dir, run_dir / "checkpoints", None, 0)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("x")
    _run_a(run_dir / "checkpoints", steps=(1, 2), run_id="slurm-c-42")  # its own checkpoints
    plan = plan_start(cfg, resolver)  # the requeued job
    assert plan.auto_resumed and (plan.load_path, plan.start_step) == (str(run_dir / "checkpoints" / "step_2"), 2)
    assert seen[-1] == str(run_dir / "checkpoints")
    # resume=never with this id's run dir there: refused (two runs' metrics in one file)
    with pytest.raises(UserInputError, match=rf"run directory {run_dir} exists \(MOE_ASYNC_RUN_ID=slurm-c-42\) "
                                             r"and trainer\.resume='never': set trainer\.resume=auto"):
        plan_start(load_config(SMOKE, cfg_args + ["name=cpu_smoke"]), resolver)
    monkeypatch.setenv("MOE_ASYNC_RUN_ID", "../x")
    with pytest.raises(UserInputError, match=r"MOE_ASYNC_RUN_ID='\.\./x': a run id is"):
        plan_start(cfg, resolver)


def test_trim_metrics_keeps_steps_up_to_the_checkpoint(tmp_path) -> None:
    lines = [json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + "garbage\n")
    assert trim_metrics(tmp_path, 2) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:3]) + "garbage\n"
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == "".join(lines[3:])
    assert trim_metrics(tmp_path, 2) == 0


def test_rows_of_steps_that_run_again_leave_trained_rows(tmp_path) -> None:
    """A resume that redoes steps (from a checkpoint, or from step 0 in the run's own dir without
    one) used to append their trained rows a second time to ``trained_rows.jsonl``: the file
    named rows as trained twice. They move to ``trained_rows.superseded.jsonl`` as the metrics do."""
    from types import SimpleNamespace

    from moe_async.orchestration.driver import _keep_superseded_metrics

    rows = [json.dumps({"step": s, "draw": s}) + "\n" for s in (1, 1, 2, 2, 3, 3)]
    (tmp_path / "trained_rows.jsonl").write_text("".join(rows))
    plan = SimpleNamespace(auto_resumed=True, start_step=2, run_id="r", load_path="ck/step_2")
    _keep_superseded_metrics(plan, tmp_path, fresh_run_dir=False)
    assert (tmp_path / "trained_rows.jsonl").read_text() == "".join(rows[:4])
    assert (tmp_path / "trained_rows.superseded.jsonl").read_text() == "".join(rows[4:])
    plan = SimpleNamespace(auto_resumed=False, start_step=0, run_id="r", load_path=None)  # no checkpoint: from 0
    _keep_superseded_metrics(plan, tmp_path, fresh_run_dir=False)
    assert (tmp_path / "trained_rows.jsonl").read_text() == ""
    assert (tmp_path / "trained_rows.superseded.jsonl").read_text() == "".join(rows[4:] + rows[:4])


def test_sglang_engines_without_gpus_are_refused_naming_the_field(tmp_path, monkeypatch) -> None:
    """On a host (or an allocation) with 0 GPUs an SGLang config is refused at start, before
    any process or run dir; before, it went on with CPU-only bundles for its engines."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MOE_ASYNC_RUN_ID", raising=False)
    _no_processes(monkeypatch)
    cfg = load_config(SMOKE, ["engine.backend=sglang", f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=r"engine\.backend='sglang' needs GPUs and this host has 0 GPU"):
        driver.run_experiment(cfg)
    assert not (tmp_path / "runs").exists()
    p = subprocess.run([sys.executable, "-m", "moe_async.orchestration.cluster", "--preflight", "--gpus-per-node", "0",
                        str(SMOKE), "engine.backend=sglang"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "engine.backend='sglang' needs GPUs and the allocation (--gpus-per-node) has 0 GPU" \
        in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "moe_async.orchestration.cluster", "--preflight", "--gpus-per-node", "8",
                        str(SMOKE), "engine.backend=sglang"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_a_save_dir_claimed_by_a_run_that_has_not_saved_yet_or_inside_a_step_is_refused(tmp_path, monkeypatch) -> None:
    """Run A has claimed its save dir but not saved yet (it may still be running): run B given
    that dir is refused naming A, instead of both writing step_N there; a save dir inside A's
    step_3 (or any folder under A's save dir) is refused naming A; A's own id still continues."""
    save = tmp_path / "a_ckpt"
    claim(save, "run-a", tmp_path / "run-a-dir")
    monkeypatch.setenv("MOE_ASYNC_RUN_ID", "run-b")

    def resolver(c):
        return None, 0

    cfg = load_config(SMOKE, [f"trainer.save_dir={save}", f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=r"belongs to run 'run-a', which has saved no checkpoint yet"):
        plan_start(cfg, resolver)
    _run_a(tmp_path / "b_ckpt")
    inside = tmp_path / "b_ckpt" / "step_3"
    cfg = load_config(SMOKE, [f"trainer.save_dir={inside}", f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=rf"is inside {re.escape(str(tmp_path / 'b_ckpt'))}, the checkpoint "
                                             r"directory of run 'run-a'"):
        plan_start(cfg, resolver)
    monkeypatch.setenv("MOE_ASYNC_RUN_ID", "run-a")
    cfg = load_config(SMOKE, [f"trainer.save_dir={save}", f"logging.output_dir={tmp_path / 'runs'}"])
    assert plan_start(cfg, resolver).save_dir == save.resolve()
