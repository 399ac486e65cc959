"""`moe-async train configs/cpu_smoke.yaml` on prompt files written by datasets/pyarrow: a verl
Parquet and a slime JSONL train in one run (prompt ids = the chat-templated rows, rewards from
each row's data_source); a run killed mid-epoch and resumed trains every row of a 40-row file
exactly once (`pytest -m slow`); a reward that never returns a number, or always times out, fails
a 3-step run (exit status != 0; `pytest -m slow`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.data._fixtures import slime_rows, verl_rows, write_jsonl, write_parquet
from tests.orchestration._train_proc import launch_train, left_running
from tests.orchestration.test_resume import SMOKE, _procs_with_tag

ROOT = Path(__file__).resolve().parents[2]
VERL_FILE = ROOT / "tests/rollout/_verl_reward.py"
SYSTEM = "Reply with the number only."


def _train(out: Path, *overrides: str) -> tuple[dict, list[dict]]:
    """One smoke run to completion: (summary.json, metrics.jsonl records); none of its processes
    left running (waited for up to 30 s: a loaded machine takes a while to reap them)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MOE_ASYNC_TEST_TAG": tag,
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), f"logging.output_dir={out}",
           "eval_before=false", "eval_after=false", "logging.wandb_mode=disabled", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert left_running(tag) == []
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trained_rows.jsonl").read_text().splitlines()]


def _template(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_verl_parquet_and_slime_jsonl_train_with_rewards_per_data_source(tmp_path) -> None:
    from moe_async.models.prepare import load_smollm2_tokenizer

    verl = verl_rows(6, source="const_quarter") + verl_rows(2, source="openai/gsm8k")
    pq = write_parquet(tmp_path / "train.parquet", verl)
    slime = slime_rows(8, source="const_three_quarters")
    js = write_jsonl(tmp_path / "train.jsonl", slime)
    held = write_jsonl(tmp_path / "held.jsonl", slime_rows(3, source="exact"))
    summary, steps = _train(
        tmp_path / "runs", "num_steps=3", f"data.train=[{pq},{js}]", f"data.system_prompt={SYSTEM}",
        f"data.rewards={{const_quarter: 'verl:{VERL_FILE}', const_three_quarters: 'verl:{VERL_FILE}', "
        "exact: exact_match}", f"data.eval={{held: {{path: {held}, n_samples: 2}}}}", "rollout.eval_interval=3")
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert summary["data"] == {"train_rows": 16, "eval_rows": {"held": 3}, "data_sources": {
        "const_quarter": f"verl:{VERL_FILE}", "openai/gsm8k": "gsm8k", "const_three_quarters": f"verl:{VERL_FILE}",
        "exact": "exact_match"}}
    tok = load_smollm2_tokenizer()
    rows = _lines(run_dir)
    assert len(rows) == 3 * 2 and len({r["row"] for r in rows}) == 6  # 3 steps x 2 groups, no row twice
    for r in rows:  # the engines got the tokenizer's own chat template of the file row
        i = r["row"]
        msgs = verl[i]["prompt"] if i < len(verl) else [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": slime[i - len(verl)]["prompt"]}]
        assert r["prompt_ids"] == _template(tok, msgs), i
        assert r["data_source"] == (verl[i]["data_source"] if i < len(verl) else "const_three_quarters")
        f, fr = (pq, i) if i < len(verl) else (js, i - len(verl))  # row counts over both files; file_row within one
        assert (Path(r["file"]).resolve(), r["file_row"]) == (f.resolve(), fr), r
    trained = [m for m in steps if "rollout/reward_mean" in m]  # not the step-0 held-out record
    assert [m["step"] for m in trained] == [1, 2, 3]
    for m in trained:  # the verl file's compute_score for its sources; gsm8k's built-in scores 0 or 1
        assert m.get("rollout/reward_mean/const_quarter", 0.25) == 0.25
        assert m.get("rollout/reward_mean/const_three_quarters", 0.75) == 0.75
        assert m.get("rollout/reward_mean/openai/gsm8k", 0.0) in (0.0, 0.5, 1.0)
        assert m["rollout/reward_errors"] == 0.0
    assert {k for m in trained for k in m if k.startswith("rollout/reward_mean/")} >= {
        "rollout/reward_mean/const_quarter", "rollout/reward_mean/const_three_quarters"}
    last = steps[-1]
    assert last["eval/held/n"] == 3.0 and last["eval/held/k"] == 2.0 and "eval/held/mean_at_k" in last


# `pytest -m slow` only (two 10-step runs): the default run proves its parts one by one: prompt
# files training end to end (above), a killed run resumed with no draw trained twice
# (tests/orchestration/test_ckpt_crash_resume.py, test_resume.py) and the file's position
# restored to the same rows (test_data_files.py::test_epochs_are_seeded_permutations_and_seek_resumes_the_same_rows)
@pytest.mark.slow
def test_resume_mid_epoch_trains_every_row_of_the_file_exactly_once(tmp_path) -> None:
    data = write_jsonl(tmp_path / "forty.jsonl", slime_rows(40, source="exact"))
    common = [f"data.train={data}", "data.default_reward=exact_match", "rollout.prompts_per_step=4",
              "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "num_steps=10",
              "rollout.reward_timeout_s=120"]  # a loaded machine: no timeouts (a lost row's reward)
    ckpt = tmp_path / "ckpt"
    tag = uuid.uuid4().hex
    proc, watchdog = launch_train(tmp_path / "a", tag, *common, "trainer.save_interval=2",
                                  f"trainer.save_dir={ckpt}", PYTHONUNBUFFERED="1")
    out, killed = [], False
    for line in proc.stdout:
        out.append(line)
        if not killed and re.match(r"step\s+5/10", line):  # mid-epoch: kill the run and all its processes
            for pid in _procs_with_tag(tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = True
    proc.wait(timeout=120)
    watchdog.cancel()
    assert killed, "".join(out)[-3000:]
    assert left_running(tag) == []
    (run_a,) = list((tmp_path / "a").iterdir())
    summary, steps = _train(tmp_path / "b", *common, f"trainer.load={ckpt}", "trainer.save_interval=100")
    start = summary["start_step"]
    assert 2 <= start < 10 and [m["step"] for m in steps] == list(range(start + 1, 11))
    (run_b,) = list((tmp_path / "b").iterdir())
    a_rows = [r["row"] for r in _lines(run_a) if r["step"] <= start]  # later steps died with the kill
    b_rows = [r["row"] for r in _lines(run_b)]
    assert len(a_rows) == 4 * start and len(b_rows) == 4 * (10 - start)
    assert sorted(a_rows + b_rows) == list(range(40)), (a_rows, b_rows)  # none twice, none lost
    assert summary["draws"]["counts"] == {"trained": 40}


@pytest.mark.slow  # the stop rule is unit-tested in tests/rollout/test_reward_failure.py
def test_rewards_that_always_fail_stop_a_short_run(tmp_path) -> None:
    """A 3-step run whose rewards raise (a verl file) or return a string (a function) on every
    sample stops with a non-zero exit naming the rewards and errors; it never trains on zeros."""
    rows = slime_rows(4, source="raises") + slime_rows(4, source="text")
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path / 'runs'}", "num_steps=3", "eval_before=false", "eval_after=false",
           f"data.train={data}", f"data.rewards={{raises: 'verl:{VERL_FILE}', "
           "text: 'function:tests.rollout._user_rewards:returns_text'}"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "RewardFailureError" in out and "every sample of the run so far" in out, out[-3000:]
    assert "data.rewards=" in out and ("on purpose" in out or "returned 'high'" in out), out[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    steps = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert steps == [], steps  # stopped within the first step's samples: nothing trained on zeros
    assert time.monotonic() - t0 < 600


# `pytest -m slow` only: the stop on timeouts is proven by default at the manager in
# tests/rollout/test_reward_failure.py::test_reward_that_always_times_out_stops_before_the_first_step
# (a reward sleeping past rollout.reward_timeout_s); the run ending non-zero on RewardFailureError
# is the same path as test_rewards_that_always_fail_stop_a_short_run above
@pytest.mark.slow
def test_reward_that_always_times_out_stops_a_short_run(tmp_path) -> None:
    """Every reward call sleeps past rollout.reward_timeout_s=2: zero successes over the first
    step's 8 samples stop the run (exit != 0) naming the reward, the kind and the timeout."""
    data = write_jsonl(tmp_path / "d.jsonl", slime_rows(8, source="slow"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path / 'runs'}", "num_steps=3", "eval_before=false", "eval_after=false",
           f"data.train={data}", "data.rewards={slow: 'function:tests.rollout._user_rewards:sleeps_past_timeout'}",
           "rollout.reward_timeout_s=2"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "RewardFailureError" in out and "zero successes over the first step's 8 samples): 8 timed out" in out, \
        out[-3000:]
    assert "sleeps_past_timeout" in out and "rollout.reward_timeout_s=2 s" in out, out[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    steps = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert steps == [], steps  # nothing trained on zeros
