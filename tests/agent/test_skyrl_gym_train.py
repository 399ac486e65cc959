"""A SkyRL-gym environment, installed from PyPI and used unchanged, trains through
``moe-async train``: cpu_smoke's tiny MoE with every sample a trajectory of
``skyrl_gym``'s ``gsm8k_multi_turn`` environment (its turn-level rewards, its "provide your
answer" follow-ups as observations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_skyrl_gym_env_unchanged_in_our_loop():
    """SkyRL-gym's own environment object, made through our selection, stepped by our loop's
    step adapter: its dict result, its observations and its reward are what we read."""
    pytest.importorskip("skyrl_gym")
    from types import SimpleNamespace

    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    from moe_async.agent.env import as_step, env_class_of, make_env

    row = SimpleNamespace(answer="42", extra_info={"max_turns": 2}, metadata={"env_class": "skyrl_gym:gsm8k_multi_turn"})
    name = env_class_of(row, None)
    env = make_env(name, row)
    assert type(env) is GSM8kMultiTurnEnv and env.max_turns == 2
    first = as_step(env.step("I think it is 41.\n#### 41"), name)
    assert not first.done and first.reward == pytest.approx(0.2 / 2)  # format score, wrong answer
    assert first.observations[0]["role"] == "user" and "####" in first.observations[0]["content"]
    last = as_step(env.step("#### 42"), name)
    assert last.done and last.reward == 1.0 and last.observations == []
    with pytest.raises(ValueError, match="unknown env_class 'nope'.*skyrl_gym:gsm8k_multi_turn"):
        make_env("nope", row)


@pytest.mark.slow
def test_skyrl_gym_env_trains_through_moe_async_train(tmp_path):
    pytest.importorskip("skyrl_gym")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=2", "rollout.agent.enabled=true",
           "rollout.agent.env_class=skyrl_gym:gsm8k_multi_turn", "rollout.agent.max_turns=2",
           "rollout.agent.max_trajectory_tokens=96"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    r = summary["rollout"]
    assert r["rollout/agent/trajectories"] >= 2 * 2 * 4  # steps x groups x G, at least
    # the random model never writes "#### <answer>" right: the environment asks again, 2 turns each
    assert r["rollout/agent/turns_per_trajectory"] > 1.0
    assert r["rollout/agent/observation_tokens"] > 0 and r["rollout/agent/template_mismatches"] == 0
    assert summary["buffer"]["samples_trained"] == 2 * 2 * 4


def test_config_names_a_missing_or_unknown_environment():
    from moe_async.config import ExperimentConfig

    with pytest.raises(ValueError, match="rollout.agent.enabled: set rollout.agent.env_class"):
        ExperimentConfig(rollout={"agent": {"enabled": True}})
    with pytest.raises(ValueError, match="unknown env_class 'nope'.*answer_retry"):
        ExperimentConfig(rollout={"agent": {"enabled": True, "env_class": "nope"}})
    assert ExperimentConfig(rollout={"agent": {"enabled": True, "env_class": "answer_retry"}}).rollout.agent.enabled


def test_env_class_column_selects_the_rows_environment(tmp_path):
    """A verl Parquet file with SkyRL's ``env_class`` column (written with ``datasets``): each
    row's environment is its own; rows without one fall back to rollout.agent.env_class."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from _fixtures import verl_rows, write_parquet

    from moe_async.agent.env import env_class_of
    from moe_async.data.config import DataConfig
    from moe_async.data.dataset import FileDataset

    rows = verl_rows(3)
    for i, r in enumerate(rows):
        r["env_class"] = "skyrl_gym:gsm8k_multi_turn" if i == 1 else None
    ds = FileDataset(DataConfig(train=str(write_parquet(tmp_path / "t.parquet", rows)), default_reward="exact_match"))
    assert [env_class_of(ds.row(i), "answer_retry") for i in range(3)] == [
        "answer_retry", "skyrl_gym:gsm8k_multi_turn", "answer_retry"]
