"""Benchmark: does fully asynchronous training hide a slow distillation teacher?

A teacher that takes ``--delay`` seconds (0.5) per scoring request, however many are in flight:
an embedded engine serving the student's starting checkpoint behind a proxy that sleeps before
forwarding each ``/generate``. The same config and seed run four times in this invocation
(``moe-async train`` with ``teacher.urls`` pointing at a proxy): ``async.mode=sync`` and
``fully_async`` (``--staleness``), each once with the slow teacher and once with the same
teacher and no sleep. Printed per run: the trainer idle fraction (``perf/trainer_idle_frac``),
the trainer's mean wait for a batch per step (``perf/wait_seconds``, steps after the first),
samples/s, teacher requests/failures/seconds; then the result, measured in the same run:
the wait per step the sleep adds in each mode and the share of it fully_async hides
(``1 - added_async / added_sync``), and fully_async's idle fraction over sync's with the slow
teacher. Both modes run with ``rollout.max_concurrent_groups`` = (K + 1) x prompts_per_step
unless ``--set`` names it: fully_async can hide the teacher's latency only with the groups of
the steps ahead in flight (sync admits one step's groups whatever the setting). Absolute
numbers on a shared CPU mean little.

    .venv/bin/python tools/bench_teacher.py                     # cpu_smoke, 10 steps, 0.5 s
    .venv/bin/python tools/bench_teacher.py --steps 8 --delay 1.0 --json out.json

Exit status 1 when a run fails (its output tail is printed) or the teacher failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_delay_proxy(target: str, delay_s: float) -> tuple[str, object]:
    """A loopback HTTP server forwarding every request to ``target`` (the teacher engine), each
    ``/generate`` after sleeping ``delay_s`` (concurrent requests sleep concurrently). Returns
    its URL and the uvicorn server (``server.should_exit = True`` stops it)."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response
    from starlette.routing import Route

    from moe_async.engines.base import free_port

    client = httpx.AsyncClient(base_url=target, timeout=600, trust_env=False)

    async def forward(request):  # every path, as the engine answers it
        path = request.url.path
        try:
            body = await request.body()
        except ClientDisconnect:  # a run that stopped with requests in flight (groups cut off)
            return Response(status_code=499)
        if path == "/generate":
            await asyncio.sleep(delay_s)
        r = await client.request(request.method, path, params=request.query_params, content=body,
                                 headers={"content-type": request.headers.get("content-type", "application/json")})
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def run_mode(config: str, mode: str, staleness: int, steps: int, url: str, sets: list[str], out: Path) -> dict:
    """One ``moe-async train`` run; its summary and per-step metrics."""
    k = 0 if mode == "sync" else staleness
    cmd = [sys.executable, "-m", "moe_async.cli", "train", config, f"logging.output_dir={out}",
           f"num_steps={steps}", f"async.mode={mode}", f"async.max_staleness={k}", "teacher.enabled=true",
           f"teacher.urls=[{url}]", "eval_before=false", "eval_after=false", "weight_sync.check=false", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-3000:] + p.stderr[-3000:], file=sys.stderr)
        raise SystemExit(1)
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "steps": steps_m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/cpu_smoke.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds the teacher sleeps per request")
    ap.add_argument("--staleness", type=int, default=2, help="fully_async's max_staleness")
    ap.add_argument("--set", action="append", default=[], help="a.b=value override for both runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from moe_async.config import load_config
    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig
    from moe_async.models.prepare import prepare_hf_checkpoint

    cfg = load_config(args.config, args.set)
    if not any(x.startswith("rollout.max_concurrent_groups=") for x in args.set):
        # fully_async hides the teacher only with more groups in flight than one step's; sync admits one step's
        args.set.append(f"rollout.max_concurrent_groups={(args.staleness + 1) * cfg.rollout.prompts_per_step}")
    path = str(prepare_hf_checkpoint(cfg.model))  # the student's starting checkpoint (cached)
    eng = make_engine(EngineConfig(num_threads=1, max_running_requests=32), path, 0)
    eng.launch()
    proxies = {d: start_delay_proxy(eng.url, d) for d in (0.0, args.delay)}
    res: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for delay in (0.0, args.delay):
                for mode in ("sync", "fully_async"):
                    key = f"{mode}@{delay:g}s"
                    out = Path(tmp) / key
                    out.mkdir()
                    r = run_mode(args.config, mode, args.staleness, args.steps, proxies[delay][0], args.set, out)
                    res[key] = row(r)
                    print_row(key, res[key])
    finally:
        for _, server in proxies.values():
            server.should_exit = True
        eng.shutdown()
    if any(r["teacher_failures"] for r in res.values()):
        print("the teacher failed requests: the comparison is void (see the runs' console.log)", file=sys.stderr)
        raise SystemExit(1)
    d = f"{args.delay:g}s"
    added = {m: res[f"{m}@{d}"]["wait_per_step"] - res[f"{m}@0s"]["wait_per_step"] for m in ("sync", "fully_async")}
    hidden = 1.0 - added["fully_async"] / added["sync"] if added["sync"] > 0 else None
    slow_a, slow_s = res[f"fully_async@{d}"], res[f"sync@{d}"]
    ratios = {"trainer_idle_frac": slow_a["trainer_idle_frac"] / slow_s["trainer_idle_frac"]
              if slow_s["trainer_idle_frac"] else None,
              "samples_per_s": slow_a["samples_per_s"] / slow_s["samples_per_s"]}
    print(f"the teacher's {args.delay:g} s per request adds to the trainer's wait per step: sync "
          f"{added['sync']:+.2f} s, fully_async {added['fully_async']:+.2f} s"
          + (f" (fully_async hides {hidden:.0%} of it)" if hidden is not None else ""))
    print(f"with the slow teacher, fully_async / sync: trainer idle fraction x{ratios['trainer_idle_frac']:.3f}, "
          f"samples/s x{ratios['samples_per_s']:.3f} (K={args.staleness}, {args.steps} steps)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": res, "added_wait_per_step_s": added, "hidden": hidden,
                                               "ratios": ratios, "delay_s": args.delay, "steps": args.steps,
                                               "staleness": args.staleness}, indent=1))


def row(r: dict) -> dict:
    """One run's numbers: summary perf and teacher counters; the mean wait per step leaves out
    step 1 (it waits for the first generation in both modes)."""
    s = r["summary"]
    ro = s["rollout"]
    waits = [m["perf/wait_seconds"] for m in r["steps"][1:] if "perf/wait_seconds" in m]
    return {
        "trainer_idle_frac": s["perf"]["perf/trainer_idle_frac"],
        "samples_per_s": s["perf"]["perf/samples_per_s"],
        "loop_seconds": s["perf"]["loop_seconds"],
        "wait_per_step": sum(waits) / len(waits) if waits else 0.0,
        "teacher_requests": ro.get("teacher/requests", 0.0),
        "teacher_failures": ro.get("teacher/failures", 0.0),
        "teacher_seconds": ro.get("teacher/seconds", 0.0),
        "kl_per_token_last": r["steps"][-1].get("teacher/batch_kl_per_token"),
    }


def print_row(key: str, r: dict) -> None:
    print(f"{key:16s} trainer idle {r['trainer_idle_frac']:.3f}  wait/step {r['wait_per_step']:.2f} s  samples/s "
          f"{r['samples_per_s']:.2f}  loop {r['loop_seconds']:.1f} s  teacher {r['teacher_requests']:.0f} requests, "
          f"{r['teacher_failures']:.0f} failed, {r['teacher_seconds']:.1f} s summed", flush=True)


if __name__ == "__main__":
    main()
