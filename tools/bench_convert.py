#!/usr/bin/env python
"""Conversion throughput (GB/s) against a plain safetensors read + write of the same bytes.

    python tools/bench_convert.py [--hf DIR] [--family F [F ...] | --family all]
                                  [--layers 4 --hidden 512 --ffn 1024 --experts 8 ...] [--repeats 7]
                                  [--fsync] [--save-threads 0] [--work DIR]
                                  [--warm-pages-mb N | --no-warm-pages]

Families: mixtral, qwen3_moe, llama, deepseek_v3 (several, or ``all``, are benchmarked one
after the other in ONE process: one JSON line each, then a table of all on stderr). Without --hf a
random fp32 model of each family and the given sizes is made with transformers and saved
sharded (--shard-size). In one process, on the same files (page cache warm for all), after
one untimed warm-up round (its times are printed as ``*_first_call_s``: the one-off costs a
single CLI run pays, e.g. Megatron's lazy imports), --repeats rounds of:

* baseline: every HF safetensors file read (``safetensors.torch.load_file``) and written
  back (``save_file``) to a scratch dir, one file at a time (with ``--fsync``: and each
  written file fsynced);
* HF -> Megatron: ``tools/convert_hf_to_megatron.py``'s function at 1 process (model build,
  shard-at-a-time read, mapping, torch_dist save: in-process writer, ``--save-threads N``
  for Megatron's forking writer; fsync only with ``--fsync``), wall time around the call;
* the baseline again;
* Megatron -> HF: ``tools/convert_megatron_to_hf.py``'s function (model build, torch_dist
  load, gather, mapping, sharded safetensors + index; fsync only with ``--fsync``).

Each direction's ratio in a round is ``baseline seconds / conversion seconds`` (= conversion
GB/s / baseline GB/s, goal >= 0.5) with the baseline run just before it, so that load from
other jobs on a shared machine hits both sides of a pair alike; the JSON line gives the
median of those per-round ratios (``ratio_*``), every round's ratio, the median seconds and
GB/s of HF tensor bytes of each side, and the conversion's phase times of its median round
(checks, process-group setup, model build, HF read + map + copy, torch_dist save / load,
gather + map + write, teardown). The first round's round trip is checked bit-exact
(``round_trip_bit_exact``). Importing Megatron-Core / transformers happens before any
timing (``imports_s``). Every timed call starts after a ``gc.collect()`` (untimed; garbage
collection stays on during the calls): otherwise a collection inside one call may free objects
left by earlier calls, e.g. a Megatron -> HF model whose parameters map ``.distcp`` files the
round has deleted since (one such ``gc.collect()`` took 0.24 s here), on that call's clock.

Every timed call (baselines and conversions alike) also starts right after an untimed page
warm-up: a scratch file of ``--warm-pages-mb`` MiB (default: 3x the HF bytes) written into
``--work`` and deleted; and (glibc) the process keeps its heap (``mallopt``: no mmap'd
allocations, no trimming), so tensors of later calls reuse pages earlier calls wrote. Reason:
on a VM whose balloon device does free page reporting (virtio_balloon
``VIRTIO_BALLOON_F_REPORTING``; this project's CPU machines are such guests), free guest pages
are handed back to the host after about 2 s, and the first write to such a page later costs a
host fault. Measured here: 345 MB written into fresh memory took 0.71 s after 3 s idle and
0.045 s right after the same amount was freed; of two 345 MB files written one after the
other after 3 s idle, the first took 0.07-0.09 s and the second 0.45-1.1 s whichever source
(anonymous memory or a mapped file) it was written from; after writing and deleting a 690 MB
scratch file, both took 0.07-0.09 s. So which side of a pair drew handed-back pages decided its
time (the Megatron -> HF rounds at 0.2-0.3 that earlier runs called bimodal: a slow round's
extra ~0.6 s was all kernel time in ``copy_folio_from_iter_atomic``, the copy into new page
cache), not the code timed. The warm-up gives both sides of every pair the same supply of
recently freed, host-backed pages; ``--no-warm-pages`` turns both measures off to see the
effect; the JSON says what was used (``warm_pages_mb``, ``heap_kept``).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = ["mixtral", "qwen3_moe", "llama", "deepseek_v3"]


def make_model(path: str, a) -> None:
    """A random fp32 model of family ``a.family`` saved sharded (``a.shard_size``). MoE
    families: ``a.experts`` experts of width ``a.ffn``; llama: dense, width ``a.ffn * a.experts``
    (about the same bytes); deepseek_v3: MLA, first layer dense, 1 shared expert, groups of 2."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=8,
                  max_position_embeddings=512, tie_word_embeddings=False,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    if a.family == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=a.ffn, num_local_experts=a.experts, num_experts_per_tok=2,
                              num_key_value_heads=4, **common)
        cls = T.MixtralForCausalLM
    elif a.family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=a.ffn, moe_intermediate_size=a.ffn, num_experts=a.experts,
                               num_experts_per_tok=2, head_dim=a.hidden // 8, num_key_value_heads=4, **common)
        cls = T.Qwen3MoeForCausalLM
    elif a.family == "deepseek_v3":
        cfg = T.DeepseekV3Config(intermediate_size=a.ffn * 2, moe_intermediate_size=a.ffn, n_routed_experts=a.experts,
                                 n_shared_experts=1, num_experts_per_tok=2, n_group=max(1, a.experts // 2),
                                 topk_group=1, first_k_dense_replace=1, num_key_value_heads=8,
                                 q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 4, qk_nope_head_dim=32,
                                 qk_rope_head_dim=16, v_head_dim=32, **common)
        cls = T.DeepseekV3ForCausalLM
    else:
        cfg = T.LlamaConfig(intermediate_size=a.ffn * a.experts, num_key_value_heads=4, **common)
        cls = T.LlamaForCausalLM
    with torch.device("cpu"):
        m = cls(cfg)
    m.save_pretrained(path, max_shard_size=a.shard_size)


def baseline(hf: str, scratch: str, fsync: bool = False) -> float:
    """Seconds for load_file + save_file of every safetensors file of ``hf`` (+ ``os.fsync``
    of each written file when ``fsync``)."""
    from safetensors.torch import load_file, save_file

    from moe_async.megatron.hf_io import read_hf_index

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


def warm_pages(nbytes: int, work: str) -> None:
    """Write a scratch file of ``nbytes`` zero bytes in ``work`` (16 MiB per write) and delete
    it (untimed; see the module docstring: afterwards the page allocator's free lists start
    with that many recently freed, host-backed pages, which the next call's page cache and
    tensors are taken from). The file is unlinked right after it is opened, so nothing is
    left behind even if the process is killed. SystemExit naming ``--warm-pages-mb`` and
    ``--work`` when the write fails (e.g. no space left)."""
    if nbytes <= 0:
        return
    path = os.path.join(work, ".warm_pages")
    chunk = bytes(16 << 20)
    try:
        with open(path, "wb") as f:
            os.remove(path)  # the open file keeps its pages until close
            for off in range(0, nbytes, len(chunk)):
                f.write(chunk[:min(len(chunk), nbytes - off)])
    except OSError as e:
        raise SystemExit(f"bench_convert: the page warm-up could not write {nbytes >> 20} MiB into --work {work}: "
                         f"{e}; use a smaller --warm-pages-mb, another --work, or --no-warm-pages") from None


def keep_heap() -> bool:
    """glibc only: serve every allocation from the heap (``M_MMAP_MAX`` 0) and never give
    freed heap memory back (``M_TRIM_THRESHOLD`` max), so that tensors of later calls reuse
    pages earlier calls already wrote instead of new ones (see the module docstring). True
    when both ``mallopt(3)`` calls succeeded."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def bench_family(hf: str, work: str, label: str, args) -> dict:
    """One family's rounds on the HF checkpoint ``hf`` (scratch under ``work``): the JSON dict
    described in the module docstring."""
    import torch

    from moe_async.megatron.convert import hf_to_megatron_checkpoint, megatron_to_hf_checkpoint
    from moe_async.megatron.hf_io import iter_hf_tensors, read_hf_index

    idx = read_hf_index(hf)
    nbytes = sum(os.path.getsize(f) for f in set(idx.values()))
    warm = 0 if args.no_warm_pages else (
        3 * nbytes if args.warm_pages_mb is None else args.warm_pages_mb * 2**20)

    def ready() -> None:  # untimed, before every timed call (see the module docstring)
        gc.collect()
        warm_pages(warm, work)

    rounds = []
    exact = None
    for i in range(args.repeats + 1):  # round 0: warm-up, not in the medians
        meg, back = os.path.join(work, f"meg{i}"), os.path.join(work, f"back{i}")
        for d in (meg, back, os.path.join(work, f"plain{i}"), os.path.join(work, f"plain{i}b")):
            shutil.rmtree(d, ignore_errors=True)  # this bench's own scratch, left by an interrupted run
        ready()  # every timed call: garbage of earlier calls freed, warm free pages (see docstring)
        r = {"baseline_h2m_s": baseline(hf, os.path.join(work, f"plain{i}"), fsync=args.fsync)}
        ready()
        t0 = time.perf_counter()
        st = hf_to_megatron_checkpoint(hf, meg, progress=False, save_threads=args.save_threads, fsync=args.fsync)
        r["h2m_s"] = time.perf_counter() - t0
        r["h2m_phases"] = st["phases"]
        ready()
        r["baseline_m2h_s"] = baseline(hf, os.path.join(work, f"plain{i}b"), fsync=args.fsync)
        ready()
        t0 = time.perf_counter()
        st = megatron_to_hf_checkpoint(meg, hf, back, max_shard_size=args.shard_size, progress=False,
                                       fsync=args.fsync)
        r["m2h_s"] = time.perf_counter() - t0
        r["m2h_phases"] = st["phases"]
        if i == 0:
            a = dict(iter_hf_tensors(hf))
            exact = all(torch.equal(a[k], t) and a[k].dtype == t.dtype for k, t in iter_hf_tensors(back)) \
                and set(a) == set(read_hf_index(back))
            del a
        shutil.rmtree(meg)
        shutil.rmtree(back)
        rounds.append(r)
    first, timed = rounds[0], rounds[1:]
    gb = nbytes / 1e9
    med = statistics.median

    def median_round(key: str) -> dict:
        ordered = sorted(timed, key=lambda r: r[key])
        return ordered[(len(ordered) - 1) // 2]

    base_s = med([r["baseline_h2m_s"] for r in timed] + [r["baseline_m2h_s"] for r in timed])
    h2m_s = med(r["h2m_s"] for r in timed)
    m2h_s = med(r["m2h_s"] for r in timed)
    r_h2m = [r["baseline_h2m_s"] / r["h2m_s"] for r in timed]
    r_m2h = [r["baseline_m2h_s"] / r["m2h_s"] for r in timed]
    return {
        "family": label,
        "hf_gb": round(gb, 4),
        "files": len(set(idx.values())),
        "repeats": args.repeats,
        "fsync": args.fsync,
        "warm_pages_mb": round(warm / 2**20),
        "save_threads": args.save_threads,
        "ratio_hf_to_megatron": round(med(r_h2m), 3),
        "ratio_megatron_to_hf": round(med(r_m2h), 3),
        "ratios_hf_to_megatron": [round(x, 3) for x in r_h2m],
        "ratios_megatron_to_hf": [round(x, 3) for x in r_m2h],
        "baseline_read_write_s": round(base_s, 3),
        "baseline_gbps": round(gb / base_s, 3),
        "hf_to_megatron_s": round(h2m_s, 3),
        "hf_to_megatron_gbps": round(gb / h2m_s, 3),
        "megatron_to_hf_s": round(m2h_s, 3),
        "megatron_to_hf_gbps": round(gb / m2h_s, 3),
        "phases_hf_to_megatron_s": {k: round(v, 3) for k, v in median_round("h2m_s")["h2m_phases"].items()},
        "phases_megatron_to_hf_s": {k: round(v, 3) for k, v in median_round("m2h_s")["m2h_phases"].items()},
        "hf_to_megatron_first_call_s": round(first["h2m_s"], 3),
        "megatron_to_hf_first_call_s": round(first["m2h_s"], 3),
        "round_trip_bit_exact": bool(exact),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=None, help="existing HF checkpoint dir (default: make a random model)")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir, removed)")
    size = "of the random model (default %(default)s; the defaults make ~345 MB of fp32 in 4 files)"
    ap.add_argument("--layers", type=int, default=4, help="decoder layers " + size)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size " + size)
    ap.add_argument("--ffn", type=int, default=1024, help="expert FFN width " + size)
    ap.add_argument("--experts", type=int, default=8, help="routed experts " + size)
    ap.add_argument("--vocab", type=int, default=32000, help="vocab size " + size)
    ap.add_argument("--shard-size", default="100MB", help="max safetensors file size (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="timed rounds (after one warm-up round; default %(default)s)")
    ap.add_argument("--family", nargs="+", default=["mixtral"], choices=FAMILIES + ["all"],
                    help="family (or families, or all) of the random model, benchmarked one after the other "
                         "in this process (llama: dense, ffn = --ffn x --experts)")
    ap.add_argument("--save-threads", type=int, default=0,
                    help="0: in-process torch_dist writer (default); N >= 1: Megatron's writer, N processes")
    ap.add_argument("--fsync", action="store_true",
                    help="fsync every written file, in the conversions and in the baseline alike")
    warm = ap.add_mutually_exclusive_group()
    warm.add_argument("--warm-pages-mb", type=int, default=None,
                      help="MiB of scratch file written into --work and deleted (untimed) before every timed "
                           "call; default 3x the HF checkpoint's bytes (see the docstring: VM free page reporting)")
    warm.add_argument("--no-warm-pages", action="store_true",
                      help="no page warm-up before the timed calls and no kept heap")
    args = ap.parse_args(argv)
    if args.warm_pages_mb is not None and args.warm_pages_mb < 0:
        ap.error("--warm-pages-mb must be >= 0")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    heap_kept = False if args.no_warm_pages else keep_heap()
    families = FAMILIES if "all" in args.family else list(dict.fromkeys(args.family))
    if args.hf is not None and len(families) > 1:
        ap.error("--hf takes one checkpoint: give at most one --family with it")

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = args.work or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(work, exist_ok=True)
    try:
        t0 = time.perf_counter()  # imports are not conversion: done before any timing
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401

        import moe_async.megatron.convert  # noqa: F401
        import moe_async.trainer.megatron_trainer  # noqa: F401

        imports_s = time.perf_counter() - t0
        results = []
        for fam in families:
            hf = args.hf
            if hf is None:
                args.family = fam
                hf = os.path.join(work, "hf" if len(families) == 1 else f"hf_{fam}")
                cfg_p = os.path.join(hf, "config.json")
                if os.path.exists(cfg_p) and not glob.glob(os.path.join(hf, "*.safetensors")):
                    print(f"{hf}: config.json without safetensors files (an interrupted run): made again",
                          file=sys.stderr)
                    shutil.rmtree(hf)
                if os.path.exists(cfg_p):  # a --work dir of an earlier run: reuse its model
                    with open(cfg_p) as f:
                        if json.load(f).get("model_type") != fam:
                            ap.error(f"{hf} holds another family than --family {fam}; use another --work")
                else:
                    t0 = time.perf_counter()
                    make_model(hf, args)
                    print(f"made random {fam} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            out = bench_family(hf, work, fam if args.hf is None else "from --hf", args)
            out["imports_s"] = round(imports_s, 3)
            out["heap_kept"] = heap_kept
            print(json.dumps(out), flush=True)
            results.append(out)
        if results:
            print("family        HF->Megatron  Megatron->HF  median s (baseline / h2m / m2h)", file=sys.stderr)
            for o in results:
                print(f"{o['family']:<13} {o['ratio_hf_to_megatron']:>12.3f}  {o['ratio_megatron_to_hf']:>12.3f}  "
                      f"{o['baseline_read_write_s']:.3f} / {o['hf_to_megatron_s']:.3f} / {o['megatron_to_hf_s']:.3f}",
                      file=sys.stderr)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
