#!/usr/bin/env python
"""Conversion throughput (GB/s) against a plain safetensors read + write of the same bytes.

    python tools/bench_convert.py [--hf DIR] [--layers 4 --hidden 512 --experts 8 ...] [--work DIR]

Without --hf a random fp32 Mixtral of the given sizes is made with transformers and saved
sharded (--shard-size). In ONE run, on the same files (page cache warm for all):

* baseline: every HF safetensors file read (``safetensors.torch.load_file``) and written
  back (``save_file``) to a scratch dir, one file at a time; best of --repeats;
* HF -> Megatron: ``tools/convert_hf_to_megatron.py``'s function (model build, shard-at-a-time
  read, mapping, torch_dist save) at 1 process, wall time from the call;
* Megatron -> HF: ``tools/convert_megatron_to_hf.py``'s function (model build, torch_dist
  load, gather, mapping, sharded safetensors + index), wall time from the call;

and prints each as GB/s of HF tensor bytes (best of --repeats; the first call of the
process, which also starts Megatron's writer processes, is printed too), with ``ratio = conversion GB/s / baseline GB/s``
(goal >= 0.5), as one JSON line. Importing Megatron-Core / transformers (seconds) happens
before any timing and is printed as ``imports_s``. The round trip is checked bit-exact. Conversions are timed
end to end, including Megatron's model build and dist_checkpointing's process start-up.
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
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=a.experts, num_experts_per_tok=2, max_position_embeddings=512,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    with torch.device("cpu"):
        m = MixtralForCausalLM(cfg)
    m.save_pretrained(path, max_shard_size=a.shard_size)


def baseline(hf: str, scratch: str) -> float:
    """Seconds for load_file + save_file of every safetensors file of ``hf``."""
    from safetensors.torch import load_file, save_file

    from moe_async.models.convert import read_hf_index

    files = sorted(set(read_hf_index(hf).values()))
    os.makedirs(scratch, exist_ok=True)
    t0 = time.perf_counter()
    for f in files:
        sd = load_file(f)
        save_file(sd, os.path.join(scratch, os.path.basename(f)), metadata={"format": "pt"})
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
            print(f"made random Mixtral in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
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
        h2m, m2h = [], []
        for i in range(args.repeats):
            meg, back = os.path.join(work, f"meg{i}"), os.path.join(work, f"back{i}")
            t0 = time.perf_counter()
            hf_to_megatron_checkpoint(hf, meg, progress=False)
            h2m.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            megatron_to_hf_checkpoint(meg, hf, back, max_shard_size=args.shard_size, progress=False)
            m2h.append(time.perf_counter() - t0)
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
