#!/usr/bin/env python
"""Convert a Megatron torch_dist checkpoint back to a Hugging Face checkpoint.

    python tools/convert_megatron_to_hf.py --megatron MEG_DIR --hf-config HF_DIR --out OUT_DIR
    torchrun --nproc_per_node 2 tools/convert_megatron_to_hf.py ... --ep 2   (load sharded)

MEG_DIR: written by tools/convert_hf_to_megatron.py or MegatronTrainer.save_checkpoint
(optimizer state ignored), at ANY saved TP/PP/EP layout: torch_dist reshards on load to
--tp/--pp/--ep in this run's world. HF_DIR supplies config.json and the tokenizer /
generation-config files copied next to the weights. Output: sharded safetensors of at most
--max-shard-size each + model.safetensors.index.json (one model.safetensors when it fits).
Any checkpoint tensor left unused, model tensor missing, or HF tensor left unset raises,
naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron torch_dist checkpoint: a Megatron-LM root (latest_checkpointed_iteration.txt), an iter_* dir or a flat dir")
    ap.add_argument("--hf-config", required=True, help="reference HF dir (config.json, tokenizer files)")
    ap.add_argument("--out", required=True, help="output HF dir (must be empty or absent)")
    ap.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB, 2GiB")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--num-layers-in-first-pipeline-stage", "--decoder-first-pipeline-num-layers", type=int,
                    default=None, dest="first",
                    help="uneven pipeline stages: layers on the first PP stage (the other stages split the rest "
                         "evenly; Megatron-Core's num_layers_in_first_pipeline_stage)")
    ap.add_argument("--num-layers-in-last-pipeline-stage", "--decoder-last-pipeline-num-layers", type=int,
                    default=None, dest="last", help="uneven pipeline stages: layers on the last PP stage")
    ap.add_argument("--fsync", action="store_true",
                    help="fsync every written safetensors file and the index before returning, for durability "
                         "(off by default: complete files, possibly still in the page cache)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from moe_async.megatron.tool_args import parse_size

    try:
        ok = parse_size(args.max_shard_size) > 0
    except ValueError:
        ok = False
    if not ok:  # before torch is imported
        ap.error(f"--max-shard-size {args.max_shard_size!r}: expected a positive size such as 5GB, 500MB, 2GiB")

    from moe_async.megatron.convert import megatron_to_hf_checkpoint

    st = megatron_to_hf_checkpoint(args.megatron, args.hf_config, args.out, max_shard_size=args.max_shard_size,
                                   tp=args.tp, pp=args.pp, ep=args.ep, progress=not args.no_progress,
                                   fsync=args.fsync, first=args.first, last=args.last)
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is gone by now
        print(json.dumps({"out": args.out, **st}))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with a refused input reported as one ``convert_megatron_to_hf: error: ...`` line, exit 2
    (:func:`moe_async.megatron.tool_args.run_tool`)."""
    from moe_async.megatron.tool_args import run_tool

    return run_tool(main, "convert_megatron_to_hf", argv)


if __name__ == "__main__":
    raise SystemExit(cli())
