#!/usr/bin/env python
"""Convert a Hugging Face checkpoint to a Megatron torch_dist checkpoint (model only).

    python tools/convert_hf_to_megatron.py --hf HF_DIR --out MEG_DIR
    torchrun --nproc_per_node 2 tools/convert_hf_to_megatron.py --hf HF_DIR --out MEG_DIR --ep 2
    torchrun --nproc_per_node 4 tools/convert_hf_to_megatron.py --hf HF_DIR --out MEG_DIR --tp 2 --ep 2

Families: mixtral, qwen3_moe, deepseek_v3, glm4_moe, llama (moe_async.models registry). The HF config is checked
against the family spec first (a mismatch is refused naming the field). Safetensors are
read one file at a time (model.safetensors.index.json when present); each rank reads only
the tensors its shards come from. Both HF expert layouts are accepted (per-expert on-disk
keys, transformers' fused experts.gate_up_proj / down_proj). Any unused HF key or unset
Megatron tensor raises, naming it, before anything is written (a DeepSeek-V3 release's MTP layer
is skipped with a WARNING naming its keys, its FP8 weights dequantized with their block scales).
The output is Megatron-LM's container: MEG_DIR/latest_checkpointed_iteration.txt (0) and
MEG_DIR/iter_0000000/ (torch_dist, common.pt with iteration and Megatron-LM's args), tensor keys
under the Transformer Engine layer spec's names, so Megatron-LM's --load MEG_DIR and
Megatron-Bridge's load_megatron_model(MEG_DIR/iter_0000000) find it. The torch_dist output can be
loaded at any other TP/PP/EP layout (see tools/convert_megatron_to_hf.py). World size > 1:
run under torchrun (gloo on CPU, NCCL with CUDA); DP = world / (tp * pp).
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
    ap.add_argument("--hf", required=True, help="HF checkpoint dir (config.json + *.safetensors)")
    ap.add_argument("--out", required=True, help="output Megatron-LM checkpoint root (must be empty or absent)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size")
    ap.add_argument("--num-layers-in-first-pipeline-stage", "--decoder-first-pipeline-num-layers", type=int,
                    default=None, dest="first",
                    help="uneven pipeline stages: layers on the first PP stage (the other stages split the rest "
                         "evenly; Megatron-Core's num_layers_in_first_pipeline_stage)")
    ap.add_argument("--num-layers-in-last-pipeline-stage", "--decoder-last-pipeline-num-layers", type=int,
                    default=None, dest="last", help="uneven pipeline stages: layers on the last PP stage")
    ap.add_argument("--vocab-div", type=int, default=128,
                    help="vocab rows padded to a multiple of this x TP (Megatron's make_vocab_size_divisible_by)")
    ap.add_argument("--fsync", action="store_true",
                    help="fsync every written file (data, .metadata, json) before returning, for durability; "
                         "off by default: the files are complete when the tool returns but may sit in the page "
                         "cache until the OS flushes them")
    ap.add_argument("--save-threads", type=int, default=0,
                    help="0 (default): write each rank's items from the converting process; N >= 1: Megatron's "
                         "own torch_dist writer with N forked writer processes per rank (it always fsyncs)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from moe_async.megatron.convert import hf_to_megatron_checkpoint

    st = hf_to_megatron_checkpoint(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                   progress=not args.no_progress, vocab_div=args.vocab_div,
                                   save_threads=args.save_threads, fsync=args.fsync, first=args.first, last=args.last)
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is gone by now
        print(json.dumps({"out": args.out, **st}))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with a refused input reported as one ``convert_hf_to_megatron: error: ...`` line, exit 2
    (:func:`moe_async.megatron.tool_args.run_tool`)."""
    from moe_async.megatron.tool_args import run_tool

    return run_tool(main, "convert_hf_to_megatron", argv)


if __name__ == "__main__":
    raise SystemExit(cli())
