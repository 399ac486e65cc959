"""``sbatch launch/slurm/train.sbatch configs/cpu_smoke.yaml num_steps=3`` under a real Slurm
(Debian's slurm-wlm + munge; daemons started here with a config written here, see _slurm.py):
the job completes with the run's 3 steps and equal engine/trainer checksums, its steps run in
an image when asked (a stand-in ``apptainer`` on PATH that records and runs the command) and
a proxy in the job's environment does not break it; a job that receives the pre-emption
signal mid-run checkpoints (case C22), requeues itself and, requeued, continues from that
checkpoint to the last step (step count continuous, one run dir); an SGLang config on an
allocation without GPUs is refused before anything starts. After every job no process of it
(Ray head, raylet, workers, engine, driver) is alive.

Without the slurm binaries the module is skipped, except in CI (``CI=true``), where that fails:
``.ci/run`` installs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import _slurm
from _launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
_DEFAULT_PY = ROOT / ".venv" / "bin" / "python"  # what the script runs unless MOE_ASYNC_PYTHON says
JOB_TIMEOUT_S = 420  # each job's wait; its Slurm time limit is 30 minutes (above the script's 600 s --signal lead)

# not marked slow: pyproject deselects slow tests, and this one is part of `make test` (about 2.5 min before the requeue job was added)

_missing = _slurm.missing_binaries()
if _missing:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: slurm binaries missing ({', '.join(_missing)}); .ci/run installs slurm-wlm and munge",
                    pytrace=False)
    pytest.skip(f"slurm-wlm/munge not installed (missing {', '.join(_missing)}); "
                "apt-get install -y slurm-wlm munge, or run .ci/run", allow_module_level=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = _slurm.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _tagged(tag: str) -> dict[int, str]:
    """PID -> command line of every process whose environment has ``MOE_ASYNC_TEST_TAG=tag``
    (the job's shell, its srun steps' tasks, Ray's processes, the engine, the driver)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"MOE_ASYNC_TEST_TAG={tag}".encode() in env and state != "Z":
            out[int(pid)] = cmd
    return out


def _submit(slurm, tmp: Path, *overrides: str, **extra_env: str) -> tuple[str, str, Path, Path]:
    tag = uuid.uuid4().hex
    runs = tmp / "runs"
    env = {**slurm.env, "MOE_ASYNC_TEST_TAG": tag, "MOE_ASYNC_RAY_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           # short (unix socket paths), and not the default /tmp/ray-<id>: job ids restart at 1 here
           "MOE_ASYNC_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"), "MOE_ASYNC_LOG_DIR": str(tmp / "logs"),
           **extra_env}
    if "MOE_ASYNC_PYTHON" not in extra_env:
        env.pop("MOE_ASYNC_PYTHON", None)
    if not _DEFAULT_PY.is_file():  # a checkout without its own .venv (a git worktree): name this python
        env["MOE_ASYNC_PYTHON"] = sys.executable
    log = tmp / "job.out"
    p = slurm.run("sbatch", "--parsable", "--time=30", f"--output={log}", str(SBATCH), "configs/cpu_smoke.yaml",
                  *overrides, f"logging.output_dir={runs}", env=env, cwd=ROOT)
    return p.stdout.strip().split(";")[0], tag, runs, log


class _Watch:
    """Records the job's tagged processes while it runs (to show the final check is not vacuous)."""

    def __init__(self, tag: str):
        self.tag, self.seen = tag, {}

    def __call__(self) -> None:
        self.seen.update(_tagged(self.tag))

    def kinds(self) -> set[str]:
        kinds = set()
        for cmd in self.seen.values():
            for k in ("raylet", "gcs_server", "moe_async.engines.embedded.server", "moe_async.cli train",
                      "ray.scripts.scripts start"):
                if k in cmd:
                    kinds.add(k)
        return kinds


_ALL_KINDS = {"raylet", "gcs_server", "moe_async.engines.embedded.server", "moe_async.cli train",
              "ray.scripts.scripts start"}


def _assert_nothing_left(tag: str, watch: _Watch, log: Path, kinds=_ALL_KINDS) -> None:
    t0 = time.monotonic()
    while _tagged(tag) and time.monotonic() - t0 < 10:  # Slurm's step cleanup is asynchronous
        time.sleep(0.5)
    assert _tagged(tag) == {}, (_tagged(tag), log.read_text()[-3000:])
    assert kinds <= watch.kinds(), watch.seen  # they ran, so their absence means they were stopped


def _fake_apptainer(tmp: Path) -> tuple[dict[str, str], Path]:
    """A stand-in ``apptainer`` on PATH: records its arguments, then runs the command after the image."""
    bin_dir, rec = tmp / "bin", tmp / "apptainer.log"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text("""#!/bin/bash
echo "$*" >> "$FAKE_APPTAINER_LOG"
[[ $1 == exec ]] || exit 64
shift
while [[ $# -gt 0 && $1 != "$MOE_ASYNC_APPTAINER_IMAGE" ]]; do shift; done
shift
exec "$@"
""")
    (bin_dir / "apptainer").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_APPTAINER_LOG": str(rec),
            "MOE_ASYNC_APPTAINER_IMAGE": str(tmp / "moe-async.sif"), "MOE_ASYNC_APPTAINER_ARGS": "--nv --cleanenv",
            "MOE_ASYNC_PYTHON": sys.executable}, rec


_PROXY = {k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy")}


def test_sbatch_train_completes_and_leaves_nothing_running(slurm, tmp_path) -> None:
    """In the stand-in image, with a proxy (a closed port) in the job's environment."""
    img_env, rec = _fake_apptainer(tmp_path)
    job, tag, runs, log = _submit(slurm, tmp_path, "num_steps=3", **img_env, **_PROXY)
    watch = _Watch(tag)
    t0 = time.monotonic()
    info = slurm.wait_job(job, JOB_TIMEOUT_S, poll=watch)
    wall = time.monotonic() - t0
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:], slurm.logs())
    assert wall < JOB_TIMEOUT_S
    (run_dir,) = list(runs.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and summary["num_steps"] == 3
    assert summary["final_weight_version"] == 3 and summary["engine_weight_versions"] == [3]
    assert summary["final_weights_match"] is True
    assert "stopped_at_step" not in summary
    assert "Ray cluster at 127.0.0.1:" in text and "ready after" in text  # the wait, not a sleep
    assert "driver exited with status 0" in text
    sif = img_env["MOE_ASYNC_APPTAINER_IMAGE"]
    assert f"python: apptainer exec --nv --cleanenv {sif} {sys.executable};" in text
    calls = rec.read_text().splitlines()  # preflight, port check, Ray head, the wait, the driver: all in the image
    for what in ("moe_async.orchestration.cluster --preflight", "ray.scripts.scripts start", "--head",
                 "moe_async.orchestration.cluster --nodes", "moe_async.cli train configs/cpu_smoke.yaml trainer.resume=auto"):
        assert any(c.startswith(f"exec --nv --cleanenv {sif} {sys.executable} ") and what in c for c in calls), (what, calls)
    # logs: each node's Ray logs and the head step's output under the log dir, the engine's in the run dir
    assert (tmp_path / "logs" / f"ray-{slurm.node}" / "raylet.out").is_file(), list((tmp_path / "logs").iterdir())
    assert (tmp_path / "logs" / f"ray-head-{slurm.node}.out").is_file()
    assert list((run_dir / "logs").glob("moe_async_embedded_*.log"))
    _assert_nothing_left(tag, watch, log)


@pytest.mark.slow  # pre-emption -> checkpoint -> resume runs by default in tests/orchestration/test_preemption_resume.py; sbatch end to end in the test above
def test_preemption_signal_checkpoints_requeues_and_continues(slurm, tmp_path) -> None:
    """``scancel --batch --signal=TERM`` is what ``#SBATCH --signal=B:TERM@LEAD`` delivers: the
    driver checkpoints after its step and stops, the script requeues the job, and the requeued
    job (same id and run id, trainer.resume=auto) continues from that checkpoint to the end."""
    job, tag, runs, log = _submit(slurm, tmp_path, "num_steps=4", "eval_before=false", "eval_after=false")
    watch = _Watch(tag)
    signalled = []

    def poll() -> None:
        watch()
        metrics = list(runs.glob("*/metrics.jsonl"))
        if not signalled and metrics and metrics[0].read_text().count("\n") >= 1:
            slurm.run("scancel", "--batch", "--signal=TERM", job)
            signalled.append(time.monotonic())

    info = slurm.wait_job(job, 3 * JOB_TIMEOUT_S, poll=poll)  # two lives, and Slurm holds a requeued job a while
    text = log.read_text()
    assert signalled, text[-4000:]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    assert info["Restarts"] == "1", info  # requeued once, by the script
    (run_dir,) = list(runs.iterdir())  # the requeued job found its run dir again
    console = (run_dir / "console.log").read_text()  # both lives, appended
    assert "SIGTERM: stopped after step" in console, console[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    n = summary["start_step"]
    ckpt = run_dir / "checkpoints"
    assert 1 <= n < 4 and summary["resumed_from"] == str(ckpt / f"step_{n}")
    assert f"trainer.resume=auto: run slurm-{slurm.cluster_name}-{job} continues from {ckpt / f'step_{n}'}" in console
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps  # continuous: each step once
    assert summary["final_weight_version"] == 4 and summary["final_weights_match"] is True
    # the signal's checkpoint, the one resumed (no periodic saves: trainer.save_interval=0)
    assert (ckpt / "latest").read_text().strip() == f"step_{n}" and not list(ckpt.glob("*.tmp"))
    assert json.loads((ckpt / f"step_{n}" / "moe_async_state.json").read_text())["extra"]["step"] == n
    assert json.loads((ckpt / "moe_async_owner.json").read_text())["run_id"] == f"slurm-{slurm.cluster_name}-{job}"
    _assert_nothing_left(tag, watch, log)


def test_sglang_config_on_an_allocation_without_gpus_is_refused(slurm, tmp_path) -> None:
    """No --gpus-per-node: Ray would get 0 GPUs; the config's SGLang engines are refused naming
    the field before the Ray head or anything else starts."""
    job, tag, runs, log = _submit(slurm, tmp_path, "engine.backend=sglang")
    info = slurm.wait_job(job, JOB_TIMEOUT_S)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text[-4000:])
    assert "engine.backend='sglang' needs GPUs and the allocation (--gpus-per-node) has 0 GPU" in text, text[-3000:]
    assert "starting the Ray head" not in text and not runs.exists()
    assert _tagged(tag) == {}


@pytest.mark.slow  # the cleanup path of the sbatch test above, failing
def test_failing_driver_still_stops_the_ray_head(slurm, tmp_path) -> None:
    """The driver refuses ``trainer.load`` after the Ray head is up (exit 2): ``set -e`` does
    not skip the cleanup, the job fails with the driver's status and the head is gone."""
    job, tag, runs, log = _submit(slurm, tmp_path, "trainer.load=/nonexistent/ckpt")
    watch = _Watch(tag)
    info = slurm.wait_job(job, JOB_TIMEOUT_S, poll=watch)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text[-4000:])
    assert "trainer.load='/nonexistent/ckpt': no such directory" in text
    assert "driver exited with status 2" in text
    _assert_nothing_left(tag, watch, log, {"raylet", "gcs_server", "ray.scripts.scripts start"})


@pytest.mark.slow  # the wait's timeout is unit-tested in tests/launch/test_cluster_wait.py
def test_cluster_wait_times_out_naming_need_and_have(slurm, tmp_path) -> None:
    """C23 under Slurm: the config needs 2 nodes (trainer.nodes=2), the allocation has 1: the
    wait gives up after MOE_ASYNC_CLUSTER_TIMEOUT saying what it needs and has; no driver runs."""
    with socket.socket() as taken:  # the configured port is taken: the script moves on to the next one
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job, tag, runs, log = _submit(slurm, tmp_path, "trainer.nodes=2", MOE_ASYNC_CLUSTER_TIMEOUT="3",
                                      MOE_ASYNC_RAY_PORT=str(port))
        watch = _Watch(tag)
        info = slurm.wait_job(job, JOB_TIMEOUT_S, poll=watch)
    text = log.read_text()
    assert f"port {port} on {slurm.node} is taken: trying {port + 1}" in text, text[-3000:]
    assert f"at 127.0.0.1:{port + 1} (attempt 2 of 3)" in text
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", (info, text[-4000:])
    assert "the Ray cluster is not ready: need 2 nodes; have 1 node" in text, text[-3000:]
    assert "driver PID" not in text and not runs.exists()
    _assert_nothing_left(tag, watch, log, {"raylet", "gcs_server", "ray.scripts.scripts start"})
