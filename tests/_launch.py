"""Launching the multi-process checks of the suite (torchrun over gloo, one-process reference
scripts): a free loopback port, an environment without an outer torchrun's rank variables,
and a run that fails the test with the tail of the child's output.

Imported as ``_launch`` (tests/conftest.py puts tests/ on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from moe_async.net import free_port

_RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``OMP_NUM_THREADS=1`` (2-core machines: one thread per
    rank) and without torchrun's rank variables, plus ``extra``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for k in _RANK_VARS:
        env.pop(k, None)
    return env


def _completed(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``timeout`` the whole group is killed (a
    launcher's rank processes too, not only the launcher) and ``TimeoutExpired`` raised."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=child_env(**env), start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            raise
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    return p


def run(cmd: list[str], timeout: float, **env: str) -> float:
    """Run ``cmd`` to completion (``timeout`` seconds at most; ``subprocess.TimeoutExpired``
    after it); an AssertionError with the tails of stdout and stderr when it exits non-zero.
    Returns its wall time in seconds."""
    t0 = time.perf_counter()
    _completed(cmd, timeout, env)
    return time.perf_counter() - t0


def run_json(script: str, *args: str, timeout: float, **env: str):
    """``python script args`` (this interpreter) run as :func:`run`; returns the JSON document
    on the last line of its stdout that starts with ``{`` or ``[`` (Ray's driver log lines, e.g.
    the autoscaler's "No available node types ..." for a deliberately unfillable request, may
    come after it); json.JSONDecodeError when there is none or it is not JSON."""
    p = _completed([sys.executable, script, *args], timeout, env)
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.lstrip()[:1] in ("{", "[")]
    return json.loads(lines[-1] if lines else "")


def torchrun(n: int, script: str, *args: str, timeout: float = 400, **env: str) -> float:
    """``python -m torch.distributed.run --nproc_per_node=n`` of ``script args`` on a free
    loopback port, as :func:`run`."""
    return run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", script, *args], timeout=timeout, **env)


def merged_json(directory: str, *names: str) -> dict:
    """The JSON objects of ``directory/<name>.json`` for each of ``names``, merged in that
    order into one dict (a later file's keys win)."""
    out: dict = {}
    for name in names:
        with open(os.path.join(directory, f"{name}.json")) as f:
            out.update(json.load(f))
    return out


def cpu_check_json(script: str, tmp: str, timeout: float, **env: str):
    """:func:`run_json` of ``python script tmp``, for the one-process CPU/gloo check scripts:
    skips the calling test (``pytest.skip``) where CUDA is available."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU/gloo checks")
    return run_json(script, tmp, timeout=timeout, **env)


def selected_params(request, name: str) -> set:
    """The values of the parameter ``name`` of this session's selected tests (after ``-m`` /
    ``-k`` deselection) in the module of ``request`` (a module-scoped fixture's): a shared
    launch runs only the cases some selected test reads, so ``pytest -m slow`` cases cost
    nothing in the default run."""
    return {item.callspec.params[name] for item in request.session.items
            if item.path == request.path and name in getattr(getattr(item, "callspec", None), "params", {})}


def slow_marked(values: list, slow: set) -> list:
    """``values`` as pytest parameters, those in ``slow`` marked ``slow`` (the default run's
    ``-m 'not slow'`` deselects them)."""
    import pytest

    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]


def finished_train(out, *overrides: str, timeout: float = 900, cwd=None, env_extra: dict | None = None):
    """``moe-async train configs/cpu_smoke.yaml logging.output_dir=out *overrides`` to completion
    (exit 0 asserted; wandb offline, one thread per process, ``env_extra`` added to the
    environment), run in ``cwd`` (default: the repository; this repository's package first on
    PYTHONPATH either way): ``(process, run dir, summary.json, the metrics.jsonl records)``."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": path,
           **(env_extra or {})}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(root / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=cwd or root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list(Path(out).iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, run_dir, summary, steps
