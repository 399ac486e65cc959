"""Checkpoints and resume of `moe-async train`: trainer.save_interval writes step_<N> plus
`latest` (at the interval and the last step); trainer.load continues the run (weights,
version, prompts, the buffered groups) at another launch. The saved run is conftest.py's
shared smoke run; this module adds one resumed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from moe_async.config import load_config

from tests.orchestration.conftest import SMOKE_SAVE_INTERVAL, SMOKE_STEPS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs/cpu_smoke.yaml"
LAST = SMOKE_STEPS  # the saved run's last step: its latest checkpoint
SAVED = (SMOKE_SAVE_INTERVAL, LAST)  # the steps it saved (its interval, its last step)


def _procs_with_tag(tag: str) -> list[int]:
    """Pids whose environment carries ``MOE_ASYNC_TEST_TAG=tag`` (the run and every child)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"MOE_ASYNC_TEST_TAG={tag}".encode() in env.split(b"\0"):
            out.append(int(pid))
    return out


def _train(out: Path, *overrides: str, cwd: Path = ROOT) -> tuple[dict, list[dict]]:
    tag = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MOE_ASYNC_TEST_TAG": tag}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), f"logging.output_dir={out}",
           "eval_before=false", "eval_after=false", "logging.wandb_mode=disabled", *overrides]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _procs_with_tag(tag) == []  # engines, Ray workers and raylet all gone
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, steps


@pytest.fixture(scope="module")
def save_resume(smoke_r3_run, tmp_path_factory) -> dict:
    """The saved run is conftest.py's shared smoke run (fully_async, K=1, R3, 5 steps, saving at
    steps 3 and 5 into ``ckpt``, given relative to its driver's cwd); ``ckpt``'s listing and
    tracker files are read, then a run resumed from that save_dir (its ``latest``: step 5) up to
    num_steps=6 (R3 as saved) saving into ``ckpt2``."""
    _, run_dir, s1, _ = smoke_r3_run
    ckpt = run_dir.parent.parent.resolve() / "ckpt"  # <the run's cwd>/ckpt
    after_1 = {"names": sorted(p.name for p in ckpt.iterdir()), "latest": (ckpt / "latest").read_text(),
               "tracker": (ckpt / "latest_checkpointed_iteration.txt").read_text(),
               "links": [os.readlink(ckpt / f"iter_{n:07d}") for n in SAVED]}
    # resume from the save_dir (its `latest`) up to one step beyond the saved run
    ckpt2 = tmp_path_factory.mktemp("resume") / "ckpt2"
    s2, steps2 = _train(ckpt2.parent / "b", f"num_steps={LAST + 1}", "trainer.router_replay=R3",
                        f"trainer.load={ckpt}", "trainer.save_interval=10",
                        f"trainer.save_dir={ckpt2}")  # saves at its last step only
    return {"ckpt": ckpt, "ckpt2": ckpt2, "s1": s1, "s2": s2, "steps2": steps2, "after_1": after_1}


def test_save_then_resume_continues_weights_version_and_prompts(save_resume) -> None:
    r = save_resume
    ckpt, ckpt2, s1, s2, steps2, after_1 = r["ckpt"], r["ckpt2"], r["s1"], r["s2"], r["steps2"], r["after_1"]
    assert after_1["names"] == [*(f"iter_{n:07d}" for n in SAVED), "latest", "latest_checkpointed_iteration.txt",
                                "moe_async_owner.json", *(f"step_{n}" for n in SAVED)]  # no *.tmp
    assert after_1["latest"].strip() == f"step_{LAST}"
    # Megatron-LM's container (its --load reads the tracker, then iter_<N:07d>): links to the step dirs
    assert after_1["tracker"].strip() == str(LAST)
    assert after_1["links"] == [f"step_{n}" for n in SAVED]
    for n in SAVED:
        assert (ckpt / f"step_{n}" / "moe_async_version.txt").read_text() == str(n)
        state = json.loads((ckpt / f"step_{n}" / "moe_async_state.json").read_text())
        assert state["version"] == n and state["extra"]["step"] == n
        assert (ckpt / f"step_{n}" / "moe_async_rng" / "rank_0.pt").is_file()
    assert s1["last_checkpoint"] == str(ckpt / f"step_{LAST}")  # the relative save_dir, under the run's cwd
    pos = json.loads((ckpt / f"step_{LAST}" / "moe_async_state.json").read_text())["extra"]["dataset"]
    assert pos["epoch"] * 200 + pos["pos"] >= LAST * 2  # at least the steps x 2 prompts trained

    # the resumed run (one more step)
    assert s2["resumed_from"] == str(ckpt / f"step_{LAST}") and s2["start_step"] == LAST
    # the trainer right after the load holds the saved run's final weights, bit for bit
    assert s2["loaded_weights_digest"] == s1["final_weights_digest"]
    assert s2["resume_sync"]["sync/bytes"] > 0
    assert [m["step"] for m in steps2] == [LAST + 1]
    assert steps2[0]["train/weight_version"] == LAST + 1.0  # continues from the saved version, not 0
    # every trained group was made by the engines at the loaded version (buffer v0 = LAST), except
    # the groups restored from the checkpoint's buffer (made before the save, at most K=1 behind)
    restored = s2["buffer_restored"]["restored"] - s2["buffer_restored"]["dropped_stale"]
    assert steps2[0]["buffer/staleness_max"] <= (1.0 if restored else 0.0)
    assert sorted(p.name for p in ckpt2.iterdir()) == [f"iter_{LAST + 1:07d}", "latest",
                                                      "latest_checkpointed_iteration.txt", "moe_async_owner.json",
                                                      f"step_{LAST + 1}"]
    extra3 = json.loads((ckpt2 / f"step_{LAST + 1}" / "moe_async_state.json").read_text())["extra"]
    pos3, rs2, rs3 = extra3["dataset"], s1["draws"], extra3["run_state"]
    # prompts continue from the saved trained frontier (run_state.py), not the loader cursor:
    # at least the 2 trained in the resumed step beyond it, and no draw trained twice (the ledger refuses)
    saved = json.loads((ckpt / f"step_{LAST}" / "moe_async_state.json").read_text())["extra"]["run_state"]
    assert saved["step"] == LAST and saved["weight_version"] == LAST and saved["counts"]["trained"] == LAST * 2
    assert pos3["epoch"] * 200 + pos3["pos"] >= saved["frontier"] + 2
    assert rs3["counts"]["trained"] == (LAST + 1) * 2 and rs3["frontier"] >= saved["frontier"]
    assert rs2["counts"]["trained"] == LAST * 2
    assert s2["final_weight_version"] == LAST + 1 and s2["engine_weight_versions"] == [LAST + 1]
    assert s2["final_weights_match"] is True
    assert s2["buffer"]["samples_trained"] == 1 * 2 * 4  # 1 step x 2 groups x G


@pytest.mark.parametrize("bad", ["does/not/exist", "EMPTY_DIR"])
def test_bad_trainer_load_refused_before_any_process(tmp_path, bad) -> None:
    from moe_async.orchestration.driver import run_experiment

    if bad == "EMPTY_DIR":
        (tmp_path / "empty").mkdir()
        bad = str(tmp_path / "empty")
    out = tmp_path / "runs"
    cfg = load_config(SMOKE, [f"trainer.load={bad}", f"logging.output_dir={out}"])
    with pytest.raises(ValueError, match="trainer.load"):
        run_experiment(cfg)
    assert not out.exists()  # refused before the run dir, the model, Ray or any engine


def test_num_steps_not_above_checkpoint_step_refused(tmp_path) -> None:
    from moe_async.orchestration.driver import resolve_checkpoint

    step = tmp_path / "step_4"
    step.mkdir()
    (step / "metadata.json").write_text("{}")
    (step / "moe_async_version.txt").write_text("4")
    (tmp_path / "latest").write_text("step_4\n")
    cfg = load_config(SMOKE, [f"trainer.load={tmp_path}", "num_steps=4"])
    with pytest.raises(ValueError, match="num_steps=4"):
        resolve_checkpoint(cfg)
    cfg = load_config(SMOKE, [f"trainer.load={tmp_path}", "num_steps=6"])
    assert resolve_checkpoint(cfg) == (str(step), 4)


_RNG_SCRIPT = r"""
import json, logging, os, random, sys
import numpy as np, torch
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "models"))
from _tiny import make_tiny_mixtral
from megatron.core.tensor_parallel import random as mrandom
from moe_async.trainer.config import TrainerConfig
from moe_async.trainer.megatron_trainer import MegatronTrainer

def draw():
    with mrandom.get_cuda_rng_tracker().fork():
        tr_ = torch.rand(3).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist(), tr_]

if __name__ == "__main__":
    tmp = sys.argv[1]
    logs = []
    logging.getLogger("moe_async.trainer.megatron_trainer").addHandler(
        type("H", (logging.Handler,), {"emit": lambda self, r: logs.append(r.getMessage())})())
    logging.getLogger("moe_async.trainer.megatron_trainer").setLevel(logging.INFO)
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2), make_tiny_mixtral(os.path.join(tmp, "m")))
    ck = os.path.join(tmp, "ck")
    random.seed(7); np.random.seed(7); torch.manual_seed(7)
    tr.save_checkpoint(ck, extra={"step": 5})
    after_save = draw()
    random.seed(99); np.random.seed(99); torch.manual_seed(99); draw()
    extra = tr.load_checkpoint(ck)
    after_load = draw()
    # the same checkpoint claimed by another layout: RNG left alone (the generators keep the
    # seed 99 streams), a log line says so
    p = os.path.join(ck, "moe_async_rng", "rank_0.pt")
    st = torch.load(p, weights_only=False); st["layout"]["tp"] = 2; torch.save(st, p)
    random.seed(99); np.random.seed(99); torch.manual_seed(99)
    tr.load_checkpoint(ck)
    other = draw()
    random.seed(99); np.random.seed(99); torch.manual_seed(99)
    print(json.dumps({"extra": extra, "equal": after_load == after_save, "other_untouched": other[:3] == draw()[:3],
                      "other_differs": other != after_save, "logs": logs}))
"""


def test_rng_restored_at_same_layout_only(tmp_path) -> None:
    script = tmp_path / "rng_checks.py"
    script.write_text(_RNG_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(script), str(tmp_path), str(ROOT)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["extra"] == {"step": 5}
    assert res["equal"] is True  # random, numpy, torch and the Megatron tracker stream continue
    assert res["other_untouched"] is True and res["other_differs"] is True
    assert any("RNG state not restored, the layout changed" in m for m in res["logs"])


def test_restored_buffered_groups_are_trained_after_resume_not_redrawn(save_resume) -> None:
    """The buffer's contents in the whole-run checkpoint, end to end: the fully_async run (K=1)
    saves at its last step with groups buffered (generated ahead under the saved version or the
    one before); the run resumed from it puts them back (stale ones at the loaded version
    dropped, reason ``stale``), trains the oldest fresh ones in its first step (their rewards and
    per-token staleness are that batch's) and never draws them again
    (``rollout/skipped_restored``; the draw ledger refuses a draw settled twice): over both runs
    every prompt is trained once, dropped with a reason, or pending."""
    ckpt, s2, steps2 = save_resume["ckpt"], save_resume["s2"], save_resume["steps2"]
    extra = json.loads((ckpt / f"step_{LAST}" / "moe_async_state.json").read_text())["extra"]
    snap, rs = extra["buffer"], extra["run_state"]
    groups = snap["groups"]
    assert groups, f"the checkpoint's buffer held no group (generation did not run ahead): {snap['counters']}"
    assert snap["counters"]["buffered_groups"] == len(groups)
    seqs = [g["samples"][0]["metadata"]["draw_seq"] for g in groups]
    assert all(s >= rs["frontier"] and str(s) not in rs["settled"] for s in seqs)  # pending in the ledger
    stale = [g for g in groups if LAST - min(v for s in g["samples"] for v in s["weight_versions"]) > 1]
    fresh = [g for g in groups if g not in stale]
    assert fresh, groups  # at K=1 a group generated under version >= LAST - 1 is fresh at version LAST

    assert s2["start_step"] == LAST and [m["step"] for m in steps2] == [LAST + 1]
    assert s2["buffer_restored"] == {"restored": len(groups), "dropped_stale": len(stale)}
    # the resumed step's batch (B=2, FIFO) begins with the restored fresh groups: their tokens are
    # the only ones at staleness >= 1 (the resumed engines generate at the loaded version)
    first = fresh[:2]
    want = Counter(LAST - v for g in first for s in g["samples"] for v in s["weight_versions"])
    got = {int(k.rsplit("/", 1)[1]): v for k, v in steps2[0].items() if k.startswith("buffer/staleness_hist/")}
    assert {k: v for k, v in got.items() if k >= 1} == {k: float(v) for k, v in want.items() if k >= 1}
    if len(first) == 2:  # the whole batch restored: its rewards are the saved ones
        rewards = [s["reward"] for g in first for s in g["samples"]]
        assert steps2[0]["rollout/reward_mean"] == sum(rewards) / len(rewards)
        assert got == {k: float(v) for k, v in want.items()}
    # not drawn again: each restored draw passed over by the resumed prompts at most once, and the
    # ledger (which refuses a second settle) counts every step's 2 prompts trained, the stale ones dropped
    assert s2["rollout"].get("rollout/skipped_restored", 0.0) <= len(groups)
    d = s2["draws"]
    assert d["counts"]["trained"] == (LAST + 1) * 2 and d["counts"].get("stale", 0) >= len(stale)
    for g in first:
        seq = g["samples"][0]["metadata"]["draw_seq"]
        assert seq < d["frontier"] or d["settled"].get(str(seq)) == "trained", (seq, d)
    acc = s2["accounting"]
    assert acc["balanced"] and acc["drawn"] >= len(groups), acc
