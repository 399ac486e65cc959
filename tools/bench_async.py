"""Benchmark: ``fully_async`` (K = max_staleness) against ``sync`` on the CPU pipeline.

Runs the same config and seed twice in this invocation, once per mode (each a fresh
``moe-async train`` process, one after the other), over the same number of trained
samples, and prints for each: samples/s and tokens/s (trained, over the loop's wall time),
trainer idle fraction (time the trainer waited for a batch / loop time), engine idle
fraction, dropped groups, the reward curve (mean reward of each step's batch) and per-step
timings (trainer wait, train step, weight sync); then the async/sync ratios. Absolute
numbers on a shared CPU mean little; the ratio measured in the same run is the result.

Reward per sample: each mode's curve of ``rollout/reward_mean_generated_step`` (the mean
reward of every sample generated since the previous step, dynamic-filtered and stale-dropped
ones included, so the filter does not bias it) against the number of generated samples,
its mean with a binomial standard error, and the async - sync difference of the means.

Placement (both modes): like a cluster where engines and trainer own disjoint devices, the
trainer is pinned to one set of cores and the engine server to a disjoint set
(``trainer.cpu_affinity`` / ``engine.cpu_affinity``), each with as many torch threads as
cores. Default: the cores this process may use, split in two halves (2 cores: trainer on
core 0, engine on core 1). In ``sync`` one side then idles while the other works, the
situation asynchronous training removes. ``--no-pin`` leaves placement to the OS (and the
config's thread counts).

Stage balance: the speed-up of overlapping generation with training is largest when a
batch's generation time is close to the train step + weight sync time; ``--set`` overrides
(e.g. ``rollout.max_new_tokens``, ``rollout.prompts_per_step``) apply to both modes. The
``sync`` run's timings print as ``gen/(train+sync)`` to guide that choice; ``BALANCE`` below
holds the overrides chosen per config (``--no-balance`` drops them).

    .venv/bin/python tools/bench_async.py                       # cpu_smoke, 8 steps, K=2
    .venv/bin/python tools/bench_async.py --config configs/cpu_demo.yaml --steps 12
    .venv/bin/python tools/bench_async.py --set rollout.max_new_tokens=16 --json out.json
    .venv/bin/python tools/bench_async.py --tool-seconds 1      # multi-turn, a 1 s tool per turn

``--tool-seconds S``: every sample a multi-turn trajectory (``rollout.agent``, the
``answer_retry`` environment, 2 turns) whose environment step takes ``S`` seconds, as a
tool or sandbox call would; trajectories waiting on it hold no engine request.

Overlap bound: with the sync run's per-step stage times (generation ``gen`` = its trainer
wait, ``train``, ``sync``), a pipeline that overlaps generation with training at best runs
a step in ``max(gen, train + sync)`` instead of ``gen + train + sync``; the bound on the
async/sync samples/s ratio is their quotient, and the steady-state ratio is printed as a
fraction of it.

``--json`` output: ``ratios`` and ``rows`` (one list per mode: mode, samples/s, tokens/s,
trainer idle frac, engine idle frac, dropped samples, trained samples, reward curve, mean
reward, mean train step s), kept stable; plus ``modes`` (per mode: ``perf``, and ``steps``,
one dict per step with ``wait_s``, ``train_s``, ``sync_s``, ``pause_s``, ``step_s``,
``engine_busy_s``, ``samples``, ``reward_mean``, ``reward_generated``, ``samples_generated``,
``staleness_mean``, ``response_len_mean``), ``reward`` (see ``reward_per_sample``),
``placement`` and ``overrides``.

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

# Stage balance per config (applied to both modes, before --set, printed): cpu_smoke's
# 8-token responses make a batch's generation ~7x shorter than its train step on 1 core
# each; 96 tokens bring gen / (train + sync) to ~0.75 (measured: sync 1.63 s gen, 2.12 s
# train, 0.04 s sync per step).
# cpu_demo: as configured (4 prompts x 4 samples per step, dynamic filtering); the filter's
# regenerated groups bring gen / (train + sync) to ~1.1 (measured: sync 44.6 s gen, 38.0 s
# train, 2.7 s sync per step on 1 core each), so no override; 12 steps of both modes take
# ~30 minutes and give each mode's reward per generated sample over ~500 samples.
BALANCE = {"cpu_smoke.yaml": ["rollout.max_new_tokens=96"]}


def run_mode(config: str, mode: str, k: int, steps: int, extra: list[str], out: Path) -> dict:
    """One ``moe-async train`` run; returns its summary plus the per-step metrics.

    A run that fails after its loop logged all ``steps`` steps (e.g. the final checksum
    comparison killed for memory) still counts: its loop figures are rebuilt from the last
    step's cumulative metrics in ``metrics.jsonl`` (``summary["from_metrics"] = True``).
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "moe_async.cli", "train", config, f"logging.output_dir={out}",
           f"num_steps={steps}", f"async.mode={mode}", f"async.max_staleness={k}",
           "eval_before=false", "eval_after=false", "weight_sync.check=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    run_dirs = list(out.iterdir())
    metrics = run_dirs[0] / "metrics.jsonl" if len(run_dirs) == 1 else None
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics and metrics.exists() else []
    if proc.returncode != 0 and len(rows) < steps:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{mode} run failed (exit {proc.returncode})")
    summary_path = run_dirs[0] / "summary.json"
    if proc.returncode == 0 and summary_path.exists():
        summary = json.loads(summary_path.read_text())
    else:
        print(f"[bench] {mode} run failed after its loop (exit {proc.returncode}; tail: "
              f"{proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else ''}); "
              f"loop figures from metrics.jsonl", flush=True)
        last = rows[-1]
        n = sum(m["train/samples"] for m in rows)
        summary = {
            "from_metrics": True,
            "perf": {key: last.get(key) for key in ("perf/samples_per_s", "perf/tokens_per_s",
                                                     "perf/trainer_idle_frac", "perf/engine_idle_frac")},
            "buffer": {"samples_dropped": int(last.get("buffer/samples_dropped", 0)), "samples_trained": int(n),
                       "drop_reasons": {kk.split("/", 2)[2]: int(v) for kk, v in last.items()
                                        if kk.startswith("buffer/dropped/")}},
            "rollout": {"rollout/aborts": last.get("rollout/aborts", 0.0)},
        }
        summary["perf"]["loop_seconds"] = n / last["perf/samples_per_s"]
    summary["steps"] = rows
    return summary


def step_timings(steps: list[dict]) -> list[dict]:
    """Per-step timings and batch statistics from the run's metrics.jsonl rows."""
    out = []
    for i, m in enumerate(steps, 1):
        out.append({
            "step": i,
            "wait_s": m.get("perf/wait_seconds"),
            "train_s": m.get("train/step_time_s"),
            "sync_s": m.get("sync/seconds", 0.0),
            "pause_s": m.get("sync/pause_seconds", 0.0),
            "step_s": m.get("perf/step_seconds"),
            "engine_busy_s": m.get("perf/engine_busy_seconds"),
            "samples": m.get("train/samples"),
            "reward_mean": m.get("rollout/reward_mean"),
            # every sample generated since the previous step (filtered / stale-dropped included)
            "reward_generated": m.get("rollout/reward_mean_generated_step"),
            "samples_generated": m.get("rollout/samples_generated"),
            "staleness_mean": m.get("buffer/staleness_mean"),
            "response_len_mean": m.get("rollout/response_len_mean"),
        })
    return out


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def reward_per_sample(per_mode: dict[str, dict]) -> dict[str, dict]:
    """Reward per generated sample, per mode: the curve (one value per step: the mean reward of
    the samples generated since the previous step, dynamic-filtered and stale-dropped ones
    included, so filtering does not bias it), the curve against the cumulative number of
    generated samples, and the mean over all generated samples with its binomial standard
    error ``sqrt(p (1 - p) / n)`` (exact for 0/1 rewards, an approximation otherwise).

    Printed as a table; returns ``{mode: {"curve", "samples", "mean", "se", "n"}}`` (empty
    when the runs did not record ``rollout/reward_mean_generated_step``)."""
    out: dict[str, dict] = {}
    for mode, pm in per_mode.items():
        st = [x for x in pm["steps"] if x.get("reward_generated") is not None]
        if not st:
            continue
        n_cum = [x["samples_generated"] for x in st]
        counts = [b - a for a, b in zip([0.0, *n_cum[:-1]], n_cum)]
        n = sum(counts)
        mean = sum(c * x["reward_generated"] for c, x in zip(counts, st)) / n if n else float("nan")
        out[mode] = {"curve": [round(x["reward_generated"], 3) for x in st], "samples": n_cum,
                     "mean": mean, "se": (mean * (1 - mean) / n) ** 0.5 if n and 0 <= mean <= 1 else float("nan"),
                     "n": n}
    if out:
        print("\nreward per generated sample (each step: samples generated since the previous step)")
        for mode, r in out.items():
            half = len(r["curve"]) // 2
            print(f"{mode:<12} mean {r['mean']:.3f} +- {r['se']:.3f} over {r['n']:.0f} samples; "
                  f"steps 1..{half} {_mean(r['curve'][:half]):.3f}, steps {half + 1}..{len(r['curve'])} "
                  f"{_mean(r['curve'][half:]):.3f}; curve {r['curve']} at samples {[int(x) for x in r['samples']]}")
    return out


def placement(trainer_cores: str | None, engine_cores: str | None) -> tuple[list[int], list[int]]:
    """Disjoint core lists for trainer and engine (default: this process's cores, halved).

    Raises:
        SystemExit: fewer than 2 usable cores, or the two lists overlap.
    """
    avail = sorted(os.sched_getaffinity(0))
    if trainer_cores is None and engine_cores is None:
        if len(avail) < 2:
            raise SystemExit(f"pinning needs >= 2 cores, this process may use {avail}; pass --no-pin")
        half = len(avail) // 2
        return avail[:half], avail[half:]
    if trainer_cores is None or engine_cores is None:
        raise SystemExit("give both --trainer-cores and --engine-cores (or neither)")
    t = [int(c) for c in trainer_cores.split(",")]
    e = [int(c) for c in engine_cores.split(",")]
    if set(t) & set(e):
        raise SystemExit(f"--trainer-cores {t} and --engine-cores {e} overlap")
    return t, e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/cpu_smoke.yaml"))
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per mode")
    ap.add_argument("--staleness", type=int, default=2, help="K of the fully_async run")
    ap.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override for both runs")
    ap.add_argument("--trainer-cores", default=None, help="comma-separated core ids (default: first half)")
    ap.add_argument("--engine-cores", default=None, help="comma-separated core ids (default: second half)")
    ap.add_argument("--no-pin", action="store_true", help="no CPU pinning (OS placement, config thread counts)")
    ap.add_argument("--no-balance", action="store_true", help="do not apply the per-config BALANCE overrides")
    ap.add_argument("--tool-seconds", type=float, default=None, metavar="S",
                    help="multi-turn trajectories whose environment step (a tool) takes S seconds")
    ap.add_argument("--modes", default="sync,fully_async", help="comma-separated subset (debugging)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each mode's run dir (metrics.jsonl, summary.json) under DIR/<mode> "
                         "(default: a temporary dir, removed); a mode that fails leaves the others' files")
    args = ap.parse_args(argv)

    balance = BALANCE.get(Path(args.config).name, []) if not args.no_balance else []
    if balance:
        print(f"[bench] stage balance for {Path(args.config).name}: {' '.join(balance)} (--no-balance: off)", flush=True)
    agent = [] if args.tool_seconds is None else [
        "rollout.agent.enabled=true", "rollout.agent.env_class=answer_retry", "rollout.agent.max_turns=2",
        f"rollout.agent.env_config.step_delay_s={args.tool_seconds}"]
    overrides = [*balance, *agent, *args.set]
    place = None
    if not args.no_pin:
        t, e = placement(args.trainer_cores, args.engine_cores)
        place = {"trainer_cores": t, "engine_cores": e}
        fmt = lambda cs: "[" + ",".join(map(str, cs)) + "]"  # noqa: E731
        overrides = [f"trainer.cpu_affinity={fmt(t)}", f"trainer.num_threads={len(t)}",
                     f"engine.cpu_affinity={fmt(e)}", f"engine.num_threads={len(e)}", *overrides]
        print(f"[bench] trainer on cores {t}, engine on cores {e} (both modes)", flush=True)

    res = {}
    modes = [m for m in (("sync", 0), ("fully_async", args.staleness)) if m[0] in args.modes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        runs_root = Path(args.keep_runs) if args.keep_runs else Path(tmp)
        for mode, k in modes:
            print(f"[bench] {mode} (K={k}), {args.steps} steps ... (run dir under {runs_root / mode})", flush=True)
            res[mode] = run_mode(args.config, mode, k, args.steps, overrides, runs_root / mode)
            p = res[mode]["perf"]
            print(f"[bench] {mode}: {p['perf/samples_per_s']:.3f} samples/s over {p['loop_seconds']:.1f} s, "
                  f"trainer idle {p['perf/trainer_idle_frac']:.3f}", flush=True)

    rows, per_mode = [], {}
    for mode, s in res.items():
        p = s["perf"]
        curve = [round(m["rollout/reward_mean"], 3) for m in s["steps"]]
        st = step_timings(s["steps"])
        rows.append((mode, p["perf/samples_per_s"], p["perf/tokens_per_s"], p["perf/trainer_idle_frac"],
                     p.get("perf/engine_idle_frac"), s["buffer"]["samples_dropped"], s["buffer"]["samples_trained"],
                     curve, sum(curve) / len(curve), _mean([x["train_s"] for x in st])))
        loop_s = p.get("loop_seconds") or sum(x["step_s"] for x in st)
        # steady state: steps 2..N over their own time (the first step includes the pipeline fill)
        tail = st[1:]
        steady = (sum(x["samples"] for x in tail) / sum(x["step_s"] for x in tail)) if tail else float("nan")
        per_mode[mode] = {"perf": {**p, "loop_seconds": loop_s, "steady_samples_per_s": steady},
                          "steps": st, "dropped": s["buffer"]["samples_dropped"],
                          "drop_reasons": s["buffer"].get("drop_reasons", {}),
                          "aborts": s.get("rollout", {}).get("rollout/aborts", 0.0)}

    print(f"\n{'mode':<12} {'samples/s':>9} {'steady':>7} {'tokens/s':>9} {'trainer_idle':>12} {'engine_idle':>11} "
          f"{'dropped':>7} {'trained':>7} {'wait_s':>7} {'train_s':>7} {'sync_s':>7}  reward/step (mean)")
    for (mode, sps, tps, ti, ei, dr, tr, curve, rm, _), pm in zip(rows, per_mode.values()):
        ei_s = f"{ei:11.3f}" if ei is not None else f"{'n/a':>11}"
        st = pm["steps"]
        print(f"{mode:<12} {sps:9.3f} {pm['perf']['steady_samples_per_s']:7.3f} {tps:9.2f} {ti:12.3f} {ei_s} "
              f"{dr:7d} {tr:7d} {_mean([x['wait_s'] for x in st]):7.2f} {_mean([x['train_s'] for x in st]):7.2f} "
              f"{_mean([x['sync_s'] for x in st]):7.2f}  {curve} ({rm:.3f})")
    if "sync" in per_mode:
        st = per_mode["sync"]["steps"]
        gen, tr, sy = _mean([x["wait_s"] for x in st]), _mean([x["train_s"] for x in st]), _mean([x["sync_s"] for x in st])
        print(f"\nsync stage balance: gen {gen:.2f} s / (train {tr:.2f} s + sync {sy:.2f} s) = {gen / (tr + sy):.2f}")
    reward = reward_per_sample(per_mode)
    ratios = {}
    if len(res) == 2:
        s, a = res["sync"]["perf"], res["fully_async"]["perf"]
        ratios = {
            "samples_per_s_async_over_sync": a["perf/samples_per_s"] / s["perf/samples_per_s"],
            "trainer_idle_async_over_sync": a["perf/trainer_idle_frac"] / max(s["perf/trainer_idle_frac"], 1e-9),
            "steady_samples_per_s_async_over_sync": (per_mode["fully_async"]["perf"]["steady_samples_per_s"]
                                                     / per_mode["sync"]["perf"]["steady_samples_per_s"]),
        }
        print(f"samples/s   fully_async / sync = {ratios['samples_per_s_async_over_sync']:.2f}x "
              f"(steady state, steps 2..N: {ratios['steady_samples_per_s_async_over_sync']:.2f}x)")
        print(f"trainer idle fully_async / sync = {ratios['trainer_idle_async_over_sync']:.2f}")
        st = per_mode["sync"]["steps"]
        gen, tr, sy = _mean([x["wait_s"] for x in st]), _mean([x["train_s"] for x in st]), _mean([x["sync_s"] for x in st])
        bound = (gen + tr + sy) / max(gen, tr + sy)
        ratios["overlap_bound"] = bound
        ratios["steady_ratio_over_bound"] = ratios["steady_samples_per_s_async_over_sync"] / bound
        print(f"overlap bound (gen + train + sync) / max(gen, train + sync) = {bound:.2f}x; steady-state "
              f"fully_async / sync reaches {ratios['steady_ratio_over_bound']:.2f} of it")
        if reward:
            ratios["reward_per_sample_async_minus_sync"] = reward["fully_async"]["mean"] - reward["sync"]["mean"]
            ratios["reward_per_sample_async_minus_sync_se"] = (reward["fully_async"]["se"] ** 2 + reward["sync"]["se"] ** 2) ** 0.5
            print(f"reward per generated sample fully_async - sync = {ratios['reward_per_sample_async_minus_sync']:+.3f} "
                  f"(standard error {ratios['reward_per_sample_async_minus_sync_se']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratios": ratios, "rows": rows, "modes": per_mode, "reward": reward,
                                               "placement": place, "overrides": overrides,
                                               "config": args.config, "staleness": args.staleness}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
