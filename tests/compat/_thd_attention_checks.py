"""THD core attention (moe_async/compat/thd_attention.py) against one causal attention per
sequence, run as ``python _thd_attention_checks.py OUT.json`` (1 process, gloo, CPU).

Random q, k, v of 3 sequences (lengths 5, 9, 7) packed back to back plus 3 tail-padding tokens
(T = 24; ``cu_seqlens_q`` = real ends, ``cu_seqlens_q_padded`` = the last one ending at T, as
the trainer packs): the packed outputs and the q/k/v gradients of ``sum(out * w)`` on the real
tokens must equal Megatron's local ``DotProductAttention`` / the MLA mend's
``MLADotProductAttention`` run on each sequence alone with a causal mask (GQA and MLA shapes).
Also: Megatron's ``apply_rotary_pos_emb`` with ``cu_seqlens`` (``_apply_rotary_pos_emb_thd``)
restarts positions per sequence (equal to the unpacked RoPE of each sequence), the plain class
still refuses ``packed_seq_params`` (mend still needed), the spec substitution.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys

import torch


def main(out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed
    from moe_async.compat.mla_local_attention import MLADotProductAttention
    from moe_async.compat.thd_attention import thd_core_attention, thd_layer_spec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    apply_cpu_compat()
    model_parallel_manual_seed(1)
    res: dict = {}
    gqa = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            attention_softmax_in_fp32=True, use_cpu_initialization=True, attention_dropout=0.0,
                            hidden_dropout=0.0, masked_softmax_fusion=False)
    mla = copy.copy(gqa)
    mla.num_query_groups = 4
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    lens, T = [5, 9, 7], 24
    total = sum(lens)
    cu = torch.tensor([0, 5, 14, 21], dtype=torch.int32)
    cu_pad = torch.tensor([0, 5, 14, T], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                          cu_seqlens_kv_padded=cu_pad, max_seqlen_q=10, max_seqlen_kv=10)
    try:  # still needed: Megatron's local attention refuses packed sequences
        q = torch.randn(T, 4, 8)
        with cpu_device_scope():
            DotProductAttention(gqa, **kw)(q, q[:, :2], q[:, :2], None, packed_seq_params=psp)
        res["plain_refuses_thd"] = None
    except AssertionError as e:
        res["plain_refuses_thd"] = str(e)
    cases = {
        "gqa": (gqa, DotProductAttention, {}, (4, 8), (2, 8), (2, 8)),
        "mla": (mla, MLADotProductAttention, dict(softmax_scale=0.25, k_channels=12, v_channels=8),
                (4, 12), (4, 12), (4, 8)),
    }
    with cpu_device_scope():
        for name, (cfg, base, extra, qs, ks, vs) in cases.items():
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(T, *shape, generator=g) for shape in (qs, ks, vs))
            w = torch.randn(T, qs[0] * vs[1], generator=g)
            packed_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
            got = thd_core_attention(base)(cfg, **kw, **extra)(*packed_in, None, packed_seq_params=psp)
            res[f"{name}_out_shape"] = list(got.shape)
            (got[:total, 0] * w[:total]).sum().backward()
            ref_attn = base(cfg, **kw, **extra)
            outs, grads = [], [torch.zeros_like(t) for t in (q, k, v)]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                n = b - a
                seg = [t[a:b].unsqueeze(1).clone().requires_grad_(True) for t in (q, k, v)]
                causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1).view(1, 1, n, n)
                o = ref_attn(*seg, causal)
                (o[:, 0] * w[a:b]).sum().backward()
                outs.append(o[:, 0].detach())
                for gacc, s in zip(grads, seg):
                    gacc[a:b] = s.grad[:, 0]
            ref = torch.cat(outs)
            res[name] = {
                "out": float((got[:total, 0] - ref).abs().max()),
                "out_scale": float(ref.abs().max()),
                **{f"grad_{n}": float((p.grad[:total] - r[:total]).abs().max()) for n, p, r in zip("qkv", packed_in, grads)},
                # tail padding never reaches a real token's output (its key/value gradients are 0)
                "pad_kv_grad": float(max(packed_in[1].grad[total:].abs().max(), packed_in[2].grad[total:].abs().max())),
            }
        # RoPE with cu_seqlens (Megatron's _apply_rotary_pos_emb_thd, unfused on CPU): positions
        # restart at 0 in every segment of the padded cu_seqlens
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
        freqs = rope(10, packed_seq=True)  # [max_seqlen, 1, 1, 8]
        x = torch.randn(T, 4, 8, generator=torch.Generator().manual_seed(3))
        packed = apply_rotary_pos_emb(x, freqs, config=gqa, cu_seqlens=cu_pad)
        ref = torch.cat([apply_rotary_pos_emb(x[a:b].unsqueeze(1), freqs[: b - a], config=gqa)[:, 0]
                         for a, b in zip(cu_pad[:-1].tolist(), cu_pad[1:].tolist())])
        res["rope_thd_vs_per_sequence"] = float((packed - ref).abs().max())
        res["rope_thd_vs_unpacked_positions"] = float(
            (packed - apply_rotary_pos_emb(x.unsqueeze(1), rope(T), config=gqa)[:, 0]).abs().max())
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    new, n = thd_layer_spec(spec)
    res["spec_replaced"] = n
    res["spec_original_kept"] = spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    res["spec_new_class"] = new.submodules.self_attention.submodules.core_attention.__name__
    with open(out, "w") as f:
        json.dump(res, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    main(sys.argv[1])
