"""``logging.output_dir`` that cannot hold a run directory (a file in its place, or under
it) is bad user input: :func:`make_run_dir` raises UserInputError naming the field, and
``moe-async train`` prints one line ``moe-async: <message>`` and exits 2 (was a
FileExistsError / NotADirectoryError traceback, exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_async.errors import UserInputError
from moe_async.logging.config import LoggingConfig
from moe_async.logging.run_logger import make_run_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_make_run_dir_refuses_unusable_output_dir(tmp_path, where) -> None:
    f = tmp_path / "a_file"
    f.write_text("x")
    out = f if where == "file" else f / "runs"
    with pytest.raises(UserInputError) as ei:
        make_run_dir(LoggingConfig(output_dir=str(out)), "n")
    msg = str(ei.value)
    assert msg.startswith(f"logging.output_dir={str(out)!r}: cannot create a run directory there (")
    assert ("FileExistsError" if where == "file" else "NotADirectoryError") in msg
    assert f.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_make_run_dir_still_makes_nested_dirs(tmp_path) -> None:
    d = make_run_dir(LoggingConfig(output_dir=str(tmp_path / "a" / "b")), "n")
    assert d.is_dir() and d.parent == (tmp_path / "a" / "b") and d.name.startswith("n-")


def test_train_with_a_file_as_output_dir_is_one_line_exit_2(tmp_path) -> None:
    f = tmp_path / "a_file"
    f.write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs" / "cpu_smoke.yaml"),
                        f"logging.output_dir={f}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"moe-async: logging.output_dir={str(f)!r}: cannot create a run directory there "
        f"(FileExistsError: [Errno 17] File exists: {str(f)!r})"]
