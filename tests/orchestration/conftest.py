"""Runs shared by several test modules of this directory (each is one ``moe-async train``, the
costly part of these tests)."""

from __future__ import annotations

import pytest
from _launch import finished_train

SMOKE_STEPS = 5


@pytest.fixture(scope="session")
def smoke_r3_run(tmp_path_factory):
    """``moe-async train configs/cpu_smoke.yaml num_steps=5 trainer.router_replay=R3`` (the smoke
    config otherwise as shipped: fully_async K=1, held-out eval before and after, wandb offline):
    (the finished process, its run dir, summary.json, the metrics.jsonl records). Read by
    test_e2e_smoke.py (the pipeline end to end) and test_e2e_report.py (``moe-async report``
    on it; R3 so that routing agreement is logged)."""
    return finished_train(tmp_path_factory.mktemp("runs"), f"num_steps={SMOKE_STEPS}", "trainer.router_replay=R3")
