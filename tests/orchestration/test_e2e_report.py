"""The shared smoke run (conftest.py: 5 steps, router replay R3 so that routing agreement is
logged), then `moe-async report` on it: every plot and the summary exist and hold the run's own
numbers; the run's trace parses and has events of every kind; the console is short and clean."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N = 5  # steps of the shared smoke run (conftest.SMOKE_STEPS)
PLOTS = ["reward.png", "staleness.png", "time_breakdown.png", "routing_agreement.png", "mismatch.png", "utilisation.png",
         "timeline.png"]


@pytest.fixture(scope="module")
def run(smoke_r3_run, tmp_path_factory):
    proc, run_dir, _, steps = smoke_r3_run
    rep = tmp_path_factory.mktemp("report")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "report", str(run_dir), "--out", str(rep)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return proc, run_dir, rep, steps


def _table(md: str) -> dict[str, str]:
    rows = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): cells[1].strip() for cells in rows[1:]}


def _close(cell: str, value: float) -> bool:
    return float(cell) == pytest.approx(value, rel=1e-3, abs=1e-12)


def test_every_plot_and_the_summary_hold_the_run_numbers(run):
    _, run_dir, rep, steps = run
    for p in PLOTS:
        assert (rep / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    t = _table((rep / "summary.md").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(steps) == N and t["steps logged"] == str(N)
    assert _close(t["reward, last step (trained batch)"], steps[-1]["rollout/reward_mean"])
    assert _close(t["accuracy, mean over steps"], sum(m["rollout/accuracy"] for m in steps) / N)
    assert _close(t["tokens/s (trained, loop)"], steps[-1]["perf/tokens_per_s"])
    assert _close(t["trainer idle fraction"], steps[-1]["perf/trainer_idle_frac"])
    assert _close(t["engine idle fraction"], steps[-1]["perf/engine_idle_frac"])
    assert _close(t["wait s, mean"], sum(m["perf/wait_seconds"] for m in steps) / N)
    assert _close(t["train s, mean"], sum(m["train/step_time_s"] for m in steps) / N)
    assert _close(t["sync s, mean"], sum(m["sync/seconds"] for m in steps) / N)
    assert _close(t["held-out accuracy after"], summary["eval_after"]["accuracy"])
    hist = summary["buffer"]["staleness_hist"]  # the buffer's own count over every trained token
    mean = sum(int(k) * n for k, n in hist.items()) / sum(hist.values())
    assert _close(t["staleness mean (tokens)"], mean)
    numbers = json.loads((rep / "report.json").read_text())["runs"][0]
    assert numbers["reward_mean_last"] == steps[-1]["rollout/reward_mean"]
    assert numbers["staleness_max"] == max(int(k) for k in hist)


def test_wait_split_adds_up_every_step(run):
    """C27 in the run: filling + straggler = the trainer's wait, each >= 0."""
    _, _, _, steps = run
    for m in steps:
        assert m["perf/wait_filling_seconds"] >= 0 and m["perf/wait_straggler_seconds"] >= 0
        assert m["perf/wait_filling_seconds"] + m["perf/wait_straggler_seconds"] == pytest.approx(m["perf/wait_seconds"])


def test_trace_parses_and_has_every_kind(run):
    _, run_dir, _, _ = run
    ev = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    x = [e for e in ev if e["ph"] == "X"]
    cats = {e["cat"] for e in x}
    names = {e["name"] for e in x if e["cat"] == "phase"}
    assert {"generate", "reward", "phase"} <= cats
    assert {"start engines", "build trainer", "eval_before", "wait", "filling", "train", "sync", "eval_after"} <= names
    assert {e["args"]["step"] for e in x if e["name"] == "train"} == set(range(1, N + 1))
    assert any(e["ph"] == "C" and e["name"] == "requests in flight/engine 0" for e in ev)
    assert all(e["dur"] >= 0 for e in x)
    # the trainer loop's phases follow one another
    tr = sorted((e["ts"], e["ts"] + e["dur"]) for e in x if e["name"] in ("wait", "train", "sync"))
    assert all(a[1] <= b[0] + 1.0 for a, b in zip(tr, tr[1:]))


def test_console_is_short_and_clean(run):
    proc, run_dir, _, _ = run
    lines = (proc.stdout + proc.stderr).splitlines()
    first = next(i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("step   1/"))
    assert first <= 6, proc.stdout
    assert not [line for line in lines if "UserWarning" in line or "warnings.warn(" in line]
    hidden = next(line for line in proc.stdout.splitlines() if "expected CPU warnings hidden" in line)
    assert "Transformer Engine/Apex fallback" in hidden and str(run_dir / "console.log") in hidden
    log = (run_dir / "console.log").read_text()
    assert "Transformer Engine and Apex are not installed" in log and f"step   {N}/{N}" in log
