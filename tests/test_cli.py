"""``moe-async train``: bad user input is one line ``moe-async: <message>`` and exit status 2;
any other exception keeps its traceback.

The subprocess tests run the real command line (``python -m moe_async.cli``) and are
refused at start-up, before Ray or any process starts (a few seconds each, imports only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import load_config
from moe_async.errors import UserInputError, UserInputFileNotFoundError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "cpu_smoke.yaml"


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local run: the start-up affinity check applies
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "moe_async.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_refused(r: subprocess.CompletedProcess, message: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [f"moe-async: {message}"]


def test_train_cpu_affinity_core_missing_here_is_one_line_exit_2(tmp_path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    missing = allowed[-1] + 1  # a core id valid for the schema but not one this process may run on
    runs = tmp_path / "runs"
    r = _train(str(SMOKE), f"trainer.cpu_affinity=[{missing}]", f"logging.output_dir={runs}", cwd=tmp_path)
    _assert_refused(r, f"trainer.cpu_affinity=[{missing}]: cores [{missing}] are not available here (allowed: {allowed})")
    assert not runs.exists()  # refused before the run dir


def test_train_bad_load_path_is_one_line_exit_2(tmp_path) -> None:
    runs, missing = tmp_path / "runs", tmp_path / "no_such_ckpt"
    r = _train(str(SMOKE), f"trainer.load={missing}", f"logging.output_dir={runs}", cwd=tmp_path)
    _assert_refused(r, f"trainer.load={str(missing)!r}: no such directory")
    assert not runs.exists()


def test_train_missing_config_file_is_one_line_exit_2(tmp_path) -> None:
    r = _train(str(tmp_path / "nope.yaml"), cwd=tmp_path)
    _assert_refused(r, f"config file not found: {tmp_path / 'nope.yaml'}")


def test_bad_model_hf_path_is_one_line_exit_2_and_no_run_dir(tmp_path, capsys) -> None:
    """A model.hf_path without weights: refused in the driver before the run dir is made."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "mixtral"}')
    runs = tmp_path / "runs"
    (tmp_path / "c.yaml").write_text(f"model:\n  source: hf\n  hf_path: {hf}\nlogging:\n  output_dir: {runs}\n")
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"moe-async: model.hf_path {hf} has no *.safetensors weight file"]
    assert not runs.exists()


def test_start_up_checks_raise_user_input_error(tmp_path) -> None:
    """The refusals are UserInputError, still ValueError (and FileNotFoundError where they were)."""
    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import prepare_hf_checkpoint
    from moe_async.affinity import check_cpu_affinity
    from moe_async.orchestration.driver import resolve_checkpoint

    with pytest.raises(UserInputError, match=r"engine\.cpu_affinity"):
        check_cpu_affinity([max(os.sched_getaffinity(0)) + 1], "engine.cpu_affinity")
    with pytest.raises(UserInputError, match=r"trainer\.load"):
        resolve_checkpoint(load_config(SMOKE, [f"trainer.load={tmp_path / 'missing'}"]))
    with pytest.raises(UserInputFileNotFoundError) as ei:
        prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(tmp_path / "missing")))
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, ValueError)
    assert str(ei.value) == f"model.hf_path {tmp_path / 'missing'} is not a directory"

    # a checkpoint whose step file is not an int: named, not a bare int() traceback
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "metadata.json").write_text("{}")
    (step / "moe_async_version.txt").write_text("three")
    with pytest.raises(UserInputError, match=r"trainer\.load=.*cannot read the step from .*step_3/moe_async_version\.txt \(ValueError"):
        resolve_checkpoint(load_config(SMOKE, [f"trainer.load={step}"]))


@pytest.mark.parametrize("exc", [RuntimeError("rollout loop died: boom"), ValueError("a bug, not user input")])
def test_internal_errors_keep_their_traceback(monkeypatch, exc) -> None:
    """Only UserInputError/ConfigError become the one-line refusal; a plain ValueError or a crash propagates."""
    import moe_async.orchestration.driver as driver

    def crash(cfg, console=None):
        raise exc

    monkeypatch.setattr(driver, "run_experiment", crash)
    with pytest.raises(type(exc), match=str(exc)):
        main(["train", str(SMOKE)])


def test_user_input_error_from_a_ray_task_prints_the_cause_only(monkeypatch, capsys) -> None:
    """Ray re-raises an actor's UserInputError as RayTaskError(UserInputError) whose str is the
    remote traceback; the CLI prints the original message as its one line."""
    from ray.exceptions import RayTaskError

    import moe_async.orchestration.driver as driver

    cause = UserInputError("engine.cpu_affinity=[9]: cores [9] are not available here (allowed: [0, 1])")

    def remote_refusal(cfg, console=None):
        raise RayTaskError("EngineManager.launch", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()

    monkeypatch.setattr(driver, "run_experiment", remote_refusal)
    assert main(["train", str(SMOKE)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"moe-async: {cause}"]
