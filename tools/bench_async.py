"""Benchmark: ``fully_async`` (K = max_staleness) against ``sync`` on the CPU pipeline.

Runs the same config and seed twice in this invocation, once per mode (each a fresh
``moe-async train`` process, one after the other), over the same number of trained
samples, and prints for each: samples/s and tokens/s (trained, over the loop's wall time),
trainer idle fraction (time the trainer waited for a batch / loop time), engine idle
fraction, dropped groups, and the reward curve (mean reward of each step's batch); then the
async/sync ratios. Absolute numbers on a shared CPU mean little; the ratio measured in the
same run is the result.

    .venv/bin/python tools/bench_async.py                       # cpu_smoke, 8 steps, K=2
    .venv/bin/python tools/bench_async.py --config configs/cpu_demo.yaml --steps 12
    .venv/bin/python tools/bench_async.py --set rollout.max_concurrent_groups=4

Exit status 1 when a run fails (its output tail is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_mode(config: str, mode: str, k: int, steps: int, extra: list[str], out: Path) -> dict:
    """One ``moe-async train`` run; returns its summary plus the per-step metrics."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "moe_async.cli", "train", config, f"logging.output_dir={out}",
           f"num_steps={steps}", f"async.mode={mode}", f"async.max_staleness={k}",
           "eval_before=false", "eval_after=false", "weight_sync.check=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{mode} run failed (exit {proc.returncode})")
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["steps"] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/cpu_smoke.yaml"))
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per mode")
    ap.add_argument("--staleness", type=int, default=2, help="K of the fully_async run")
    ap.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override for both runs")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    res = {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for mode, k in (("sync", 0), ("fully_async", args.staleness)):
            print(f"[bench] {mode} (K={k}), {args.steps} steps ...", flush=True)
            res[mode] = run_mode(args.config, mode, k, args.steps, args.set, Path(tmp) / mode)

    rows = []
    for mode, s in res.items():
        p = s["perf"]
        curve = [round(m["rollout/reward_mean"], 3) for m in s["steps"]]
        rows.append((mode, p["perf/samples_per_s"], p["perf/tokens_per_s"], p["perf/trainer_idle_frac"],
                     p.get("perf/engine_idle_frac"), s["buffer"]["samples_dropped"], s["buffer"]["samples_trained"],
                     curve, sum(curve) / len(curve),
                     sum(m.get("train/step_time_s", 0.0) for m in s["steps"]) / len(s["steps"])))
    print(f"\n{'mode':<12} {'samples/s':>9} {'tokens/s':>9} {'trainer_idle':>12} {'engine_idle':>11} "
          f"{'dropped':>7} {'trained':>7} {'train_step_s':>12}  reward/step (mean)")
    for mode, sps, tps, ti, ei, dr, tr, curve, rm, st in rows:
        ei_s = f"{ei:11.3f}" if ei is not None else f"{'n/a':>11}"
        print(f"{mode:<12} {sps:9.3f} {tps:9.2f} {ti:12.3f} {ei_s} {dr:7d} {tr:7d} {st:12.3f}  {curve} ({rm:.3f})")
    s, a = res["sync"]["perf"], res["fully_async"]["perf"]
    ratios = {
        "samples_per_s_async_over_sync": a["perf/samples_per_s"] / s["perf/samples_per_s"],
        "trainer_idle_async_over_sync": a["perf/trainer_idle_frac"] / max(s["perf/trainer_idle_frac"], 1e-9),
    }
    print(f"\nsamples/s   fully_async / sync = {ratios['samples_per_s_async_over_sync']:.2f}x")
    print(f"trainer idle fully_async / sync = {ratios['trainer_idle_async_over_sync']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratios": ratios, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
