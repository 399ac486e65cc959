"""Benchmark: start-up cost of a 1,000,000-row prompt file (moe_async/data).

Generates a slime-format JSONL of ``--rows`` rows (a math question, a label, metadata with a
data_source; about 120 bytes a row) and measures, each in a fresh process:

* ``moe-async`` path: what a run does before its first engine request -- the driver's start-up
  check (:func:`moe_async.data.check.check_data`: every row's keys and prompt type, the data
  sources' rewards) and the rollout side's :class:`~moe_async.data.dataset.FileDataset` (the
  memory-mapped table, the epoch permutation) up to the first row's chat-templated prompt ids;
  cold (datasets builds its Arrow cache) and warm (a second start, e.g. a resume). Printed:
  seconds to the first prompt ids and the process's extra resident memory (RSS after minus
  before, psutil), plus the bytes of the config that travels to the Ray actors (rows do not).
  Imports and the tokenizer's load (paid by any run) are done first and printed apart; the
  seconds and the extra RSS are measured from there.
* reference, same run: the file parsed into Python dicts with ``json.loads`` per line (what a
  loader that holds the rows in memory costs every process that has it).

Goals (issue): under 30 s to the first request, under 1 GB extra driver memory.

    python tools/bench_data.py --rows 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, os, pickle, sys, time
import psutil
mode, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
proc = psutil.Process()
t00 = time.perf_counter()
from moe_async.data.check import check_data
from moe_async.data.config import DataConfig
from moe_async.data.dataset import FileDataset
from moe_async.models.prepare import load_smollm2_tokenizer
tok = load_smollm2_tokenizer()  # a run loads its tokenizer anyway: outside the measured span
t_base = time.perf_counter() - t00
rss0 = proc.memory_info().rss
t0 = time.perf_counter()
if mode == "reference":
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    first = rows[0]["prompt"]
    out = {"rows": len(rows)}
else:
    data = DataConfig(train=path, default_reward="math_verify", cache_dir=cache)
    t_imp = time.perf_counter()
    info = check_data(data)
    t_check = time.perf_counter()
    ds = FileDataset(data, tok, system_prompt="Solve it.")
    ids = ds.build_prompt_ids(ds.next_train())
    out = {"rows": info["train_rows"], "check_s": t_check - t_imp, "dataset_s": time.perf_counter() - t_check,
           "config_bytes_to_actors": len(pickle.dumps(data)), "prompt_tokens": len(ids)}
out["seconds"] = time.perf_counter() - t0
out["imports_and_tokenizer_s"] = t_base
out["extra_rss_mb"] = (proc.memory_info().rss - rss0) / 2**20
print(json.dumps(out))
"""


def generate(path: Path, n: int, seed: int = 0) -> None:
    """``n`` slime rows: ``{"prompt", "label", "metadata": {"data_source", "id"}}``."""
    import random

    rnd = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b = rnd.randint(1, 9999), rnd.randint(1, 9999)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? Put the answer in \\boxed{{}}.", "label": str(a + b),
                                "metadata": {"data_source": "math", "id": i}}) + "\n")


def measure(mode: str, path: Path, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    p = subprocess.run([sys.executable, "-c", _CHILD, mode, str(path), str(cache)], capture_output=True, text=True,
                       env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = work / "prompts.jsonl"
        t = time.perf_counter()
        generate(path, a.rows)
        print(f"[bench_data] {a.rows} rows, {path.stat().st_size / 2**20:.0f} MiB written in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        cache = work / "cache"
        cold = measure("moe_async", path, cache)
        warm = measure("moe_async", path, cache)
        ref = measure("reference", path, cache)
    print(f"[bench_data] imports and tokenizer load (before the measured span, any run): "
          f"{cold['imports_and_tokenizer_s']:.1f} s", flush=True)
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"[bench_data] moe-async {name}: {r['seconds']:.1f} s to the first prompt ids (check {r['check_s']:.1f} s, dataset {r['dataset_s']:.1f} s), extra RSS "
              f"{r['extra_rss_mb']:.0f} MiB; config sent to actors {r['config_bytes_to_actors']} bytes", flush=True)
    print(f"[bench_data] reference (json.loads every line into dicts): {ref['seconds']:.1f} s, extra RSS "
          f"{ref['extra_rss_mb']:.0f} MiB", flush=True)
    print(f"[bench_data] ratio moe-async cold / reference: time {cold['seconds'] / ref['seconds']:.2f}x, "
          f"RSS {cold['extra_rss_mb'] / max(ref['extra_rss_mb'], 1e-9):.2f}x; warm: time "
          f"{warm['seconds'] / ref['seconds']:.2f}x, RSS {warm['extra_rss_mb'] / max(ref['extra_rss_mb'], 1e-9):.2f}x")
    ok = cold["seconds"] < 30 and cold["extra_rss_mb"] < 1024
    print(f"[bench_data] goals (< 30 s to the first request, < 1 GiB extra RSS): {'met' if ok else 'NOT met'}")
    print(json.dumps({"rows": a.rows, "cold": cold, "warm": warm, "reference": ref}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
