"""CP core attention (moe_async/compat/cp_attention.py) at CP2 against 1-process attention,
run as ``torchrun --nproc_per_node 2 _cp_attention_checks.py OUT.json`` (gloo, CPU).

Per rank: random q, k, v for the WHOLE sequence (same seed on both ranks), the 1-process
reference (Megatron's local ``DotProductAttention`` / the MLA mend's ``MLADotProductAttention``
at CP1 with the causal mask) on it, then this rank's positions (chunks r and 3 - r of 4)
through the CP class at CP2; outputs and the q/k/v gradients of ``sum(out * w)`` must equal the
reference's rows of this rank (K/V gradients summed over both ranks' queries by the gather's
backward). Rank 0 writes the max differences and the "still needed" probe to OUT.json.
"""

from __future__ import annotations

import copy
import json
import sys

import torch


def main(out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed
    from moe_async.compat.cp_attention import cp_core_attention, cp_layer_spec
    from moe_async.compat.mla_local_attention import MLADotProductAttention
    from moe_async.layout import cp_positions

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(context_parallel_size=2)
    apply_cpu_compat()
    model_parallel_manual_seed(1)  # dropout runs under Megatron's RNG tracker (p = 0)
    res: dict = {}
    cfg2 = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                             context_parallel_size=2, attention_softmax_in_fp32=True, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)
    mla2 = copy.copy(cfg2)
    mla2.num_query_groups = 4  # MLA: one key/value head per query head
    cfgs = {}
    for name, c2 in (("gqa", cfg2), ("mla", mla2)):
        c1 = copy.copy(c2)
        c1.context_parallel_size = 1
        cfgs[name] = (c1, c2)
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    try:  # still needed: Megatron's local attention refuses CP
        DotProductAttention(cfg2, **kw)
        res["plain_refuses_cp"] = None
    except AssertionError as e:
        res["plain_refuses_cp"] = str(e)
    r, S, B = ps.get_context_parallel_rank(), 24, 2
    pos = cp_positions(S, 2, r)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    cases = {
        # GQA: 4 query heads, 2 key/value groups
        "gqa": (DotProductAttention, {}, (4, 8), (2, 8), (2, 8)),
        # MLA: key/query head dim 12 (nope + rope), value head dim 8, MLA's softmax scale
        "mla": (MLADotProductAttention, dict(softmax_scale=0.25, k_channels=12, v_channels=8), (4, 12), (4, 12), (4, 8)),
    }
    with cpu_device_scope():
        for name, (base, extra, qs, ks, vs) in cases.items():
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(S, B, *shape, generator=g) for shape in (qs, ks, vs))
            w = torch.randn(S, B, qs[0] * vs[1], generator=g)
            ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
            cfg1, cfg2 = cfgs[name]
            ref = base(cfg1, **kw, **extra)(*ref_in, causal)
            (ref * w).sum().backward()
            cp_in = [t[pos].clone().requires_grad_(True) for t in (q, k, v)]
            got = cp_core_attention(base)(cfg2, **kw, **extra)(*cp_in, None)
            (got * w[pos]).sum().backward()
            res[name] = {
                "out": float((got - ref[pos]).abs().max()),
                "out_scale": float(ref.abs().max()),
                **{f"grad_{n}": float((a.grad - b.grad[pos]).abs().max()) for n, a, b in zip("qkv", cp_in, ref_in)},
            }
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    new, n = cp_layer_spec(spec)
    res["spec_replaced"] = n
    res["spec_original_kept"] = spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    res["spec_new_class"] = new.submodules.self_attention.submodules.core_attention.__name__
    box: list = [None, None]
    dist.all_gather_object(box, res)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(box, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
