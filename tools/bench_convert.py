#!/usr/bin/env python
"""Conversion throughput (GB/s) against a plain safetensors read + write of the same bytes.

    python tools/bench_convert.py [--hf DIR] [--family mixtral|qwen3_moe|llama]
                                  [--layers 4 --hidden 512 --experts 8 ...] [--work DIR]

Without --hf a random fp32 model of the given family and sizes is made with transformers
and saved sharded (--shard-size). In ONE run, on the same files (page cache warm for all):

* baseline: every HF safetensors file read (``safetensors.torch.load_file``) and written
  back (``save_file``) to a scratch dir, one file at a time; best of --repeats; the same
  with an ``os.fsync`` of each written file is measured too (``baseline_fsync_s``), since
  Megatron's torch_dist writer fsyncs every file it writes (not configurable in
  megatron-core 0.16);
* HF -> Megatron: ``tools/convert_hf_to_megatron.py``'s function (model build, shard-at-a-time
  read, mapping, torch_dist save) at 1 process, wall time from the call;
* Megatron -> HF: ``tools/convert_megatron_to_hf.py``'s function (model build, torch_dist
  load, gather, mapping, sharded safetensors + index), wall time from the call;

and prints each as GB/s of HF tensor bytes (best of --repeats; the first call of the
process is printed too), with ``ratio = conversion GB/s / baseline GB/s`` (goal >= 0.5)
and the same against the fsync baseline, plus the conversion's own phase times (setup,
model build, HF read + map + copy, torch_dist save / load, gather + map + write), as one
JSON line. Importing Megatron-Core / transformers (seconds) happens before any timing and
is printed as ``imports_s``. The round trip is checked bit-exact. Conversions are timed end
to end, including Megatron's model build and dist_checkpointing's writer processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_model(path: str, a) -> None:
    """A random fp32 model of family ``a.family`` (mixtral / qwen3_moe / llama) saved sharded."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    if a.family == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=a.ffn, num_local_experts=a.experts, num_experts_per_tok=2, **common)
        cls = T.MixtralForCausalLM
    elif a.family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=a.ffn, moe_intermediate_size=a.ffn, num_experts=a.experts,
                               num_experts_per_tok=2, head_dim=a.hidden // 8, **common)
        cls = T.Qwen3MoeForCausalLM
    else:
        cfg = T.LlamaConfig(intermediate_size=a.ffn * a.experts, **common)
        cls = T.LlamaForCausalLM
    with torch.device("cpu"):
        m = cls(cfg)
    m.save_pretrained(path, max_shard_size=a.shard_size)


def baseline(hf: str, scratch: str, fsync: bool = False) -> float:
    """Seconds for load_file + save_file of every safetensors file of ``hf`` (+ ``os.fsync``
    of each written file when ``fsync``: Megatron's torch_dist writer always fsyncs)."""
    from safetensors.torch import load_file, save_file

    from moe_async.models.convert import read_hf_index

    files = sorted(set(read_hf_index(hf).values()))
    os.makedirs(scratch, exist_ok=True)
    t0 = time.perf_counter()
    for f in files:
        sd = load_file(f)
        out = os.path.join(scratch, os.path.basename(f))
        save_file(sd, out, metadata={"format": "pt"})
        if fsync:
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        del sd
    dt = time.perf_counter() - t0
    shutil.rmtree(scratch)
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=None, help="existing HF checkpoint dir (default: make a random Mixtral)")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-size", default="100MB")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--family", default="mixtral", choices=["mixtral", "qwen3_moe", "llama"],
                    help="family of the random model (llama: dense, ffn = --ffn x --experts)")
    ap.add_argument("--save-threads", type=int, default=2,
                    help="torch_dist writer processes per rank (Megatron's thread_count, default 2)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = args.work or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(work, exist_ok=True)
    try:
        hf = args.hf
        if hf is None:
            hf = os.path.join(work, "hf")
            t0 = time.perf_counter()
            make_model(hf, args)
            print(f"made random {args.family} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        from moe_async.models.convert import (
            hf_to_megatron_checkpoint,
            iter_hf_tensors,
            megatron_to_hf_checkpoint,
            read_hf_index,
        )

        t0 = time.perf_counter()  # imports are not conversion: done before any timing
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401

        import moe_async.trainer.megatron_trainer  # noqa: F401

        imports_s = time.perf_counter() - t0
        idx = read_hf_index(hf)
        nbytes = sum(os.path.getsize(f) for f in set(idx.values()))
        base = min(baseline(hf, os.path.join(work, f"plain{i}")) for i in range(args.repeats))
        base_sync = min(baseline(hf, os.path.join(work, f"sync{i}"), fsync=True) for i in range(args.repeats))
        h2m, m2h, ph_h2m, ph_m2h = [], [], [], []
        for i in range(args.repeats):
            meg, back = os.path.join(work, f"meg{i}"), os.path.join(work, f"back{i}")
            t0 = time.perf_counter()
            st = hf_to_megatron_checkpoint(hf, meg, progress=False, save_threads=args.save_threads)
            h2m.append(time.perf_counter() - t0)
            ph_h2m.append(st["phases"])
            t0 = time.perf_counter()
            st = megatron_to_hf_checkpoint(meg, hf, back, max_shard_size=args.shard_size, progress=False)
            m2h.append(time.perf_counter() - t0)
            ph_m2h.append(st["phases"])
            if i == 0:
                a = dict(iter_hf_tensors(hf))
                exact = all(torch.equal(a[k], t) for k, t in iter_hf_tensors(back)) and \
                    set(a) == set(read_hf_index(back))
                del a
            shutil.rmtree(meg)
            shutil.rmtree(back)
        base2 = min(baseline(hf, os.path.join(work, f"plain_again{i}")) for i in range(args.repeats))
        base = min(base, base2)
        gb = nbytes / 1e9
        h2m_s, m2h_s = min(h2m), min(m2h)
        out = {
            "family": args.family if args.hf is None else "from --hf",
            "imports_s": round(imports_s, 3),
            "hf_to_megatron_first_call_s": round(h2m[0], 3),
            "megatron_to_hf_first_call_s": round(m2h[0], 3),
            "hf_gb": round(gb, 4),
            "files": len(set(idx.values())),
            "baseline_read_write_s": round(base, 3),
            "baseline_gbps": round(gb / base, 3),
            "hf_to_megatron_s": round(h2m_s, 3),
            "hf_to_megatron_gbps": round(gb / h2m_s, 3),
            "megatron_to_hf_s": round(m2h_s, 3),
            "megatron_to_hf_gbps": round(gb / m2h_s, 3),
            "ratio_hf_to_megatron": round(base / h2m_s, 3),
            "ratio_megatron_to_hf": round(base / m2h_s, 3),
            "baseline_fsync_s": round(base_sync, 3),
            "ratio_hf_to_megatron_vs_fsync_baseline": round(base_sync / h2m_s, 3),
            "ratio_megatron_to_hf_vs_fsync_baseline": round(base_sync / m2h_s, 3),
            "phases_hf_to_megatron_s": {k: round(v, 3) for k, v in ph_h2m[h2m.index(h2m_s)].items()},
            "phases_megatron_to_hf_s": {k: round(v, 3) for k, v in ph_m2h[m2h.index(m2h_s)].items()},
            "save_threads": args.save_threads,
            "round_trip_bit_exact": bool(exact),
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(out))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
