"""`moe-async train configs/cpu_smoke.yaml` with a multi-rank trainer (one Ray actor per
Megatron rank) and two engines, against the same command at one process (the runs and their
overrides: ``_sync_runs.py``; the shared ones: conftest.py).

- reference (``sync_reference``): 1 process, 1 engine, 4 steps in two runs (pre-empted after
  step 2, then resumed: test_preemption_resume.py's pair); also the runs that show
  ``async.mode=sync`` through the driver loop trains only fresh tokens (staleness 0) and
  reports the loop's metrics;
- TP2 (default run): 2 engines, the pair of ``tp2_crash_resume`` (test_ckpt_crash_resume.py's
  runs): step 1 from scratch, then (its rank 0 killed in the save of step 2) steps 2 and 3
  resumed from the step-1 checkpoint, saving step 3: per-step loss and grad norm equal to the
  reference's within 1e-5, both engines served requests and hold the trainer's weights, sample
  accounting, staleness bound, R3 replayed on every real token;
- EP2 resumed from the TP2 checkpoint (slow): step 4's loss and grad norm equal the
  reference's step 4;
- EP2 and PP2 from scratch (slow): as TP2.
"""

from __future__ import annotations

import json

import pytest

from tests.orchestration._sync_runs import TOL, assert_steps_equal, train
from tests.orchestration.conftest import CRASH_STEPS


@pytest.fixture(scope="module")
def reference(sync_reference):
    return sync_reference


@pytest.fixture(scope="module")
def ckpt_dir(tp2_crash_resume):
    return tp2_crash_resume["ckpt"]


@pytest.fixture(scope="module")
def tp2(tp2_crash_resume):
    """The resumed TP2 run (steps 2..3), its step 1 (run a's, from scratch) in front."""
    b = tp2_crash_resume["b"]
    return {**b, "steps": tp2_crash_resume["steps_a"] + b["steps"], "trained_steps": len(b["steps"])}


def check_multi_rank_run(run: dict, reference: dict, n_steps: int, world: int = 2) -> None:
    s, steps = run["summary"], run["steps"]
    assert s["trainer_world_size"] == world
    assert f"trainer: {world} rank(s)" in run["stdout"]
    assert [m["step"] for m in steps] == list(range(1, n_steps + 1))
    trained = run.get("trained_steps", n_steps)  # a resumed run's buffer counts its own steps
    # both engines served requests and hold the trainer's weights after the last sync
    r = s["rollout"]
    assert r["rollout/engine_busy_s/0"] > 0 and r["rollout/engine_busy_s/1"] > 0
    assert s["engine_weights_match"] == [True, True] and s["final_weights_match"] is True
    assert s["engine_weight_versions"] == [n_steps, n_steps]
    assert all(m["sync/check_tensors"] > 0 for m in steps)  # check mode compared every sync
    # accounting: every sample put is trained, dropped or still buffered
    b = s["buffer"]
    assert b["samples_trained"] == trained * 2 * 4
    assert b["samples_put"] == b["samples_trained"] + b["samples_dropped"] + b["samples_buffered"]
    # every trained token within max_staleness (sync mode: 0)
    assert set(map(int, s["buffer"]["staleness_hist"])) == {0}
    assert all(m["buffer/staleness_max"] <= 0 for m in steps)
    # R3 through the driver: every real token replayed the engine's experts on every rank
    assert all(m["train/replay_agreement"] == 1.0 for m in steps)
    # the same batches as the 1-process run, and the same loss and grad norm
    assert_steps_equal(steps, reference)
    ref = reference["steps"]
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
    steps = reference["steps"]
    assert len(steps) == 4
    for summary in (reference["a"]["summary"], reference["b"]["summary"]):  # the pre-empted run, the resumed one
        hist = summary["buffer"]["staleness_hist"]
        assert set(map(int, hist)) == {0} and sum(hist.values()) > 0  # every trained token: staleness 0
        assert summary["buffer"]["samples_dropped"] == 0
        assert summary["perf"]["perf/samples_per_s"] > 0
    for m in steps:
        assert m["buffer/staleness_max"] == 0
        assert m["buffer/staleness_hist/0"] == m["train/response_tokens"]
        assert not any(k.startswith("buffer/staleness_hist/") and k != "buffer/staleness_hist/0" for k in m)
        assert 0 <= m["perf/trainer_idle_frac"] <= 1 and 0 <= m["perf/engine_idle_frac"] <= 1
        assert m["perf/samples_per_s"] > 0


def test_tp2_two_engines_equal_one_process(tp2, reference):
    check_multi_rank_run(tp2, reference, CRASH_STEPS)


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
