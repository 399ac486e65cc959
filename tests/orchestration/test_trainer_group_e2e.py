"""`moe-async train configs/cpu_smoke.yaml` with a multi-rank trainer (one Ray actor per
Megatron rank) and two engines, against the same command at one process.

Every run: ``async.mode=sync``, seeded sampling (``rollout.sampling_seed``: the same batches
whatever the layout, engine count or timing), a reward that is not constant on a random
model's text (so GRPO advantages are not all 0), router replay R3, check mode on.

- reference: 1 process, 1 engine, 4 steps; also the run that shows ``async.mode=sync`` through
  the driver loop trains only fresh tokens (staleness 0) and reports the loop's metrics;
- TP2 (default run): 2 engines, 3 steps, a checkpoint at step 3: per-step loss and grad norm
  equal to the reference's within 1e-5, both engines served requests and hold the trainer's
  weights, sample accounting, staleness bound, R3 replayed on every real token;
- EP2 resumed from the TP2 checkpoint (slow): step 4's loss and grad norm equal the
  reference's step 4;
- EP2 and PP2 from scratch (slow): as TP2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["async.mode=sync", "async.max_staleness=0", "eval_before=false", "eval_after=false",
          "rollout.sampling_seed=7", "rollout.reward=function",
          "rollout.reward_function=tests.orchestration._rewards:char_parity",
          "trainer.router_replay=R3", "rollout.return_routed_experts=true", "weight_sync.check=true"]
TOL = 1e-5


def train(out: Path, *overrides: str, timeout: float = 600) -> dict:
    """Run the CLI; returns summary, per-step metrics, stdout and wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={out}", *COMMON, *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    (run_dir,) = list(out.iterdir())
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "steps": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
            "stdout": proc.stdout, "wall": wall}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "num_steps=4")


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, ckpt_dir):
    return train(tmp_path_factory.mktemp("tp2"), "num_steps=3", "engine.num_engines=2",
                 "trainer.tensor_model_parallel_size=2", "trainer.save_interval=3", f"trainer.save_dir={ckpt_dir}")


def check_multi_rank_run(run: dict, reference: dict, n_steps: int, world: int = 2) -> None:
    s, steps = run["summary"], run["steps"]
    assert s["trainer_world_size"] == world
    assert f"trainer: {world} rank(s)" in run["stdout"]
    assert len(steps) == n_steps
    # both engines served requests and hold the trainer's weights after the last sync
    r = s["rollout"]
    assert r["rollout/engine_busy_s/0"] > 0 and r["rollout/engine_busy_s/1"] > 0
    assert s["engine_weights_match"] == [True, True] and s["final_weights_match"] is True
    assert s["engine_weight_versions"] == [n_steps, n_steps]
    assert all(m["sync/check_tensors"] > 0 for m in steps)  # check mode compared every sync
    # accounting: every sample put is trained, dropped or still buffered
    b = s["buffer"]
    assert b["samples_trained"] == n_steps * 2 * 4
    assert b["samples_put"] == b["samples_trained"] + b["samples_dropped"] + b["samples_buffered"]
    # every trained token within max_staleness (sync mode: 0)
    assert set(map(int, s["buffer"]["staleness_hist"])) == {0}
    assert all(m["buffer/staleness_max"] <= 0 for m in steps)
    # R3 through the driver: every real token replayed the engine's experts on every rank
    assert all(m["train/replay_agreement"] == 1.0 for m in steps)
    # the same batches as the 1-process run, and the same loss and grad norm
    ref = reference["steps"]
    for a, m in zip(ref, steps):
        assert m["train/response_tokens"] == a["train/response_tokens"]
        assert m["rollout/reward_mean"] == a["rollout/reward_mean"]
        assert abs(m["train/loss"] - a["train/loss"]) <= TOL, (m["train/loss"], a["train/loss"])
        assert abs(m["train/grad_norm"] - a["train/grad_norm"]) <= TOL, (m["train/grad_norm"], a["train/grad_norm"])
    print(f"\nwall {run['wall']:.1f} s; max |loss diff| "
          f"{max(abs(m['train/loss'] - a['train/loss']) for a, m in zip(ref, steps)):.2e}, max |grad norm diff| "
          f"{max(abs(m['train/grad_norm'] - a['train/grad_norm']) for a, m in zip(ref, steps)):.2e}")


def test_reference_is_informative(reference):
    """The reward varies within groups (non-zero advantages: the loss is not the aux loss alone)."""
    steps = reference["steps"]
    assert len(steps) == 4
    assert any(0 < m["rollout/reward_mean"] < 1 for m in steps)
    assert all(m["train/replay_agreement"] == 1.0 for m in steps)


def test_sync_mode_trains_only_fresh_tokens(reference):
    """`async.mode=sync` through the same driver loop: every trained token is on-policy
    (staleness 0), and the loop's metrics (staleness histogram, idle fractions, samples/s) are
    reported."""
    summary, steps = reference["summary"], reference["steps"]
    assert len(steps) == 4
    hist = summary["buffer"]["staleness_hist"]
    assert set(map(int, hist)) == {0} and sum(hist.values()) > 0  # every trained token: staleness 0
    for m in steps:
        assert m["buffer/staleness_max"] == 0
        assert m["buffer/staleness_hist/0"] == m["train/response_tokens"]
        assert not any(k.startswith("buffer/staleness_hist/") and k != "buffer/staleness_hist/0" for k in m)
        assert 0 <= m["perf/trainer_idle_frac"] <= 1 and 0 <= m["perf/engine_idle_frac"] <= 1
        assert m["perf/samples_per_s"] > 0
    assert summary["buffer"]["samples_dropped"] == 0
    assert summary["perf"]["perf/samples_per_s"] > 0


def test_tp2_two_engines_equal_one_process(tp2, reference):
    check_multi_rank_run(tp2, reference, 3)


def test_tp2_checkpoint_saved_by_every_rank(tp2, ckpt_dir):
    assert (ckpt_dir / "latest").read_text().strip() == "step_3"
    st = json.loads((ckpt_dir / "step_3" / "moe_async_state.json").read_text())
    assert (st["layout"]["world_size"], st["layout"]["tp"]) == (2, 2) and st["extra"]["step"] == 3
    assert sorted(p.name for p in (ckpt_dir / "step_3" / "moe_async_rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]


@pytest.mark.slow
def test_resume_at_ep2_from_tp2_checkpoint(tp2, reference, ckpt_dir, tmp_path):
    """Saved at TP2 from the CLI, resumed at EP2 from the CLI: step 4 continues the run."""
    run = train(tmp_path, "num_steps=4", "engine.num_engines=2", "trainer.expert_model_parallel_size=2",
                f"trainer.load={ckpt_dir}")
    assert run["summary"]["start_step"] == 3 and len(run["steps"]) == 1
    m, a = run["steps"][0], reference["steps"][3]
    assert m["train/response_tokens"] == a["train/response_tokens"]
    assert abs(m["train/loss"] - a["train/loss"]) <= TOL, (m["train/loss"], a["train/loss"])
    assert abs(m["train/grad_norm"] - a["train/grad_norm"]) <= TOL
    assert m["train/replay_agreement"] == 1.0
    assert run["summary"]["engine_weights_match"] == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["trainer.expert_model_parallel_size=2", "trainer.pipeline_model_parallel_size=2"])
def test_other_layouts_two_engines_equal_one_process(layout, reference, tmp_path):
    check_multi_rank_run(train(tmp_path, "num_steps=3", "engine.num_engines=2", layout), reference, 3)
