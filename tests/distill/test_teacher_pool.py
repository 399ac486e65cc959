"""The teacher's own engine pool at start and while running: a teacher engine that needs GPUs
(teacher.engine.device=cuda, teacher.engine.backend=sglang) is refused before Ray on a host
without one, as the student's engines are; teacher.engine.cpu_affinity is checked against this
host's cores before any process starts; a teacher engine whose server died is restarted (same
URL: it is never weight-synced) up to teacher.engine.max_restarts, then the run stops naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_async.config import load_config
from moe_async.errors import UserInputError
from moe_async.orchestration.cluster import refuse_without_gpus, required_resources
from moe_async.orchestration.teacher_pool import TeacherRecovery

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "cpu_smoke.yaml"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="refusals of a host without CUDA")
TEACHER = ["teacher.enabled=true", "rollout.n_samples_per_prompt=2"]


def test_teacher_engine_needing_gpus_is_refused_naming_the_field():
    for over, field, fix in (("teacher.engine.device=cuda", r"teacher\.engine\.device='cuda'", r"teacher\.engine\.device=cpu"),
                             ("teacher.engine.backend=sglang", r"teacher\.engine\.backend='sglang'",
                              r"teacher\.engine\.backend=embedded")):
        cfg = load_config(SMOKE, TEACHER + [over])
        with pytest.raises(UserInputError, match=rf"^{field} needs GPUs and the allocation \(--gpus-per-node\) has "
                           rf"0 GPU \(.*on CPU: {fix}\)$"):
            refuse_without_gpus(cfg, 0.0, "the allocation (--gpus-per-node)")
        refuse_without_gpus(cfg, 8.0, "the allocation (--gpus-per-node)")
    # servers already running (teacher.urls) start nothing here: no GPU needed
    refuse_without_gpus(load_config(SMOKE, TEACHER + ["teacher.engine.device=cuda", "teacher.urls=[http://t:1]"]), 0.0)
    # the cluster wait counts the teacher's GPUs: 1 trainer rank + 1 engine + 2 teacher engines x 2 devices
    cfg = load_config(SMOKE, TEACHER + ["teacher.engine.device=cuda", "teacher.engine.num_engines=2",
                                        "teacher.engine.devices_per_engine=2"])
    base = required_resources(load_config(SMOKE, TEACHER), 1, 8.0)["GPU"]
    assert required_resources(cfg, 1, 8.0)["GPU"] == base + 4


@no_cuda
@pytest.mark.parametrize("over, match", [
    ("teacher.engine.device=cuda", r"^teacher\.engine\.device='cuda' needs GPUs and this host has 0 GPU"),
    ("teacher.engine.cpu_affinity=[4093]", r"^teacher\.engine\.cpu_affinity=\[4093\]: cores \[4093\] are not available"),
])
def test_local_run_refuses_before_ray(tmp_path, monkeypatch, over, match):
    from moe_async.orchestration import driver

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MOE_ASYNC_RUN_ID", raising=False)

    def no_process(*a, **k):
        raise AssertionError("a process or Ray was started")

    monkeypatch.setattr(driver, "init_ray", no_process)
    cfg = load_config(SMOKE, TEACHER + [over, f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=match):
        driver.run_experiment(cfg)
    assert not (tmp_path / "runs").exists()


class Pool:
    """EnginePool's two calls: engine 1's server exits ``deaths`` times."""

    def __init__(self, deaths):
        self.deaths, self.restarted = deaths, []

    def dead_engines(self):
        if self.deaths:
            return ["engine 1 at http://127.0.0.1:7001 exited with code -9; log: t1.log"]
        return []

    def restart(self, i, timeout_s):
        self.deaths -= 1
        self.restarted.append((i, timeout_s))
        return "http://127.0.0.1:7001"


def test_dead_teacher_engine_is_restarted_then_the_run_stops_naming_it():
    pool = Pool(deaths=1)
    rec = TeacherRecovery(pool, max_restarts=2, startup_timeout_s=30.0, interval_s=5.0)
    assert rec.check(now=100.0) == [1] and pool.restarted == [(1, 150.0)]
    assert rec.check(now=101.0) == [] and rec.check(now=106.0) == []  # at most every interval_s; healthy
    assert rec.events == ["teacher engine 1 at http://127.0.0.1:7001 exited with code -9; log: t1.log: restarted (1/2)"]
    pool.deaths = 5
    assert rec.check(now=200.0) == [1]
    with pytest.raises(RuntimeError, match=r"^teacher engine 1 at http://127.0.0.1:7001 exited with code -9; log: "
                       r"t1.log; it was restarted 2 times already \(teacher.engine.max_restarts=2\)$"):
        rec.check(now=300.0)
    assert len(pool.restarted) == 2
