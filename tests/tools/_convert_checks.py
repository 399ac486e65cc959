"""Conversion checks of test_convert.py, one function per launch of _convert_launches.py
(which runs them with the GLM-4.5 and uneven-PP checks in the same three launches); the
results are returned as dicts, every path under TMP.

    make_checkpoints(TMP)   (prep, before Megatron is imported)
        the tiny HF checkpoints: ``mix`` (Mixtral, untied)
        and ``qwen`` (Qwen3-MoE, tied, norm_topk_prob=False), each 2 layers, 4 experts top-2,
        fp32, ``llama`` (dense, bf16, tied) and ``ds`` (deepseek_v3: MLA, first layer dense,
        shared expert, non-zero fp32 ``e_score_correction_bias``), re-saved by transformers as 3+ safetensors shards with
        ``model.safetensors.index.json``, plus a fake tokenizer file; ``{name}_fused``: the
        same weights in transformers' in-memory layout (fused ``experts.gate_up_proj`` /
        ``down_proj``), sharded; the HF logits on a fixed prompt.
    prep(TMP)   (1 process) HF ->
        Megatron at EP1 (CLI ``main``), the converted Megatron model's logits vs HF, Megatron
        -> HF from EP1; the error cases (extra / missing HF key, config mismatch, extra /
        missing torch_dist tensor).
    w2(TMP)   (2 ranks, the gloo process group already initialised)
        HF -> Megatron at EP2 and at TP2 (and EP2 from the fused layout; deepseek_v3 at EP2
        and TP2); Megatron -> HF loading the EP1 checkpoint at EP2 and the TP2 checkpoint at
        TP2.
    final(TMP)   (1 process)
        Megatron -> HF at 1 process from the EP2 / TP2 checkpoints; every round-tripped dir
        compared with the original tensors (bit-exact, same names and dtypes) and by the
        logits of the transformers model loaded from it; the Megatron model loaded from the
        EP2 checkpoint vs HF logits; experts saved exactly once at EP2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

NAMES = ("mix", "qwen")  # MoE, fp32: every layout, logits vs Megatron
ALL = (*NAMES, "llama", "ds")  # + dense Llama, bf16: EP1 / TP2; DeepSeek-V3: EP1 / EP2 / TP2
SHARD = {"mix": "300KB", "qwen": "300KB", "llama": "60KB", "ds": "300KB"}  # -> 3+ files each
PROMPT = [[5, 17, 99, 3, 250, 41, 7, 128, 64, 200, 11, 2]]


def p(tmp: str, *a: str) -> str:
    return os.path.join(tmp, *a)


# ---------------------------------------------------------------------------- prep (HF)
def make_checkpoints(tmp: str) -> None:
    from _tiny import make_tiny_mixtral, make_tiny_qwen3_moe
    from transformers import AutoModelForCausalLM

    from moe_async.megatron.export import ShardWriter

    make_tiny_mixtral(p(tmp, "mix_single"), tie=False)
    make_tiny_qwen3_moe(p(tmp, "qwen_single"), tie=True, norm_topk_prob=False)
    make_tiny_llama_bf16(p(tmp, "llama_single"))
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    make_tiny_deepseek_v3(p(tmp, "ds_single"))  # MLA, dense + MoE layers, shared expert, fp32 router bias
    for name in ALL:
        m = AutoModelForCausalLM.from_pretrained(p(tmp, f"{name}_single")).eval()
        m.save_pretrained(p(tmp, name), max_shard_size=SHARD[name])  # transformers' own sharded save
        with open(p(tmp, name, "tokenizer_config.json"), "w") as f:
            json.dump({"fake": name}, f)
        with torch.no_grad():
            logits = m(torch.tensor(PROMPT)).logits.float()
        torch.save(logits, p(tmp, f"hf_logits_{name}.pt"))
        if name == "llama":
            continue
        # transformers' in-memory layout (fused experts), sharded
        fused = p(tmp, f"{name}_fused")
        os.makedirs(fused)
        shutil.copy(p(tmp, name, "config.json"), fused)
        w = ShardWriter(fused, 300_000)
        for k, v in m.state_dict().items():
            w.add(k, v.detach().clone())
        w.close()


def make_tiny_llama_bf16(path: str) -> None:
    """Dense Llama, bf16 on disk, tied (the dtype must survive the round trip)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, initializer_range=0.2,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def hf_tensors(d: str) -> dict:
    from moe_async.megatron.hf_io import iter_hf_tensors

    return dict(iter_hf_tensors(d))


def megatron_logits(meg: str, hf_dir: str, prompt: list = PROMPT) -> torch.Tensor:
    """Logits [1,S,V] on ``prompt`` of the 1-process Megatron model loaded from torch_dist ``meg``."""
    from moe_async.models import hf_config_dict
    from moe_async.megatron.build import build_model
    from moe_async.megatron.dist_ckpt import load_megatron_into_model
    from moe_async.megatron.parallel import parallel_layout

    from moe_async.megatron.container import resolve

    cfg = hf_config_dict(hf_dir)
    meg = resolve(meg)  # the converter's Megatron-LM container -> its iteration dir
    with parallel_layout(1, 1, 1):
        with open(p(meg, "moe_async_convert.json")) as f:
            div = json.load(f)["vocab_div"]
        model, vocab = build_model(cfg, 1, 1, 1, vocab_div=div)
        load_megatron_into_model(model, meg)
        model.eval()
        tok = torch.tensor(prompt)
        S = tok.shape[1]
        pos = torch.arange(S).unsqueeze(0)
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            out = model(tok, pos, mask)
        return out[..., :vocab].float()


def expect_error(fn, *needles) -> dict:
    try:
        fn()
    except (KeyError, ValueError) as e:
        msg = str(e)
        return {"raised": type(e).__name__, "msg": msg[:600], "names_it": all(n in msg for n in needles)}
    return {"raised": None}


def rewrite_hf(src: str, dst: str, edit) -> None:
    """Copy HF dir ``src`` to ``dst`` with its tensors edited by ``edit(dict)`` (re-sharded)."""
    from moe_async.megatron.export import ShardWriter

    os.makedirs(dst)
    shutil.copy(p(src, "config.json"), dst)
    sd = hf_tensors(src)
    edit(sd)
    w = ShardWriter(dst, 300_000)
    for k in sorted(sd):
        w.add(k, sd[k])
    w.close()


def error_cases(tmp: str) -> dict:
    import convert_hf_to_megatron as h2m_cli

    from moe_async.megatron.build import build_model
    from moe_async.megatron.convert import megatron_to_hf_checkpoint
    from moe_async.megatron.parallel import parallel_layout

    res = {}
    extra = "model.layers.1.mlp.extra_bias"
    rewrite_hf(p(tmp, "mix"), p(tmp, "err_extra"), lambda sd: sd.__setitem__(extra, torch.zeros(3)))
    res["extra_hf_key"] = expect_error(
        lambda: h2m_cli.main(["--hf", p(tmp, "err_extra"), "--out", p(tmp, "err_extra_meg"), "--no-progress"]),
        extra, "unused")
    res["extra_hf_key"]["nothing_written"] = not os.path.exists(p(tmp, "err_extra_meg"))
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    rewrite_hf(p(tmp, "mix"), p(tmp, "err_missing"), lambda sd: sd.pop(gone))
    res["missing_hf_key"] = expect_error(
        lambda: h2m_cli.main(["--hf", p(tmp, "err_missing"), "--out", p(tmp, "err_missing_meg"), "--no-progress"]),
        gone, "missing")
    # fused layout with a stray key next to it
    stray = "model.layers.0.mlp.experts.gate_up_bias"
    rewrite_hf(p(tmp, "qwen_fused"), p(tmp, "err_fused_extra"), lambda sd: sd.__setitem__(stray, torch.zeros(4, 2)))
    res["extra_hf_key_fused"] = expect_error(
        lambda: h2m_cli.main(["--hf", p(tmp, "err_fused_extra"), "--out", p(tmp, "x"), "--no-progress"]), stray)
    # config mismatch: the family spec refuses the field by name
    shutil.copytree(p(tmp, "mix"), p(tmp, "err_cfg"))
    with open(p(tmp, "err_cfg", "config.json")) as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 16
    with open(p(tmp, "err_cfg", "config.json"), "w") as f:
        json.dump(cfg, f)
    res["config_mismatch"] = expect_error(
        lambda: h2m_cli.main(["--hf", p(tmp, "err_cfg"), "--out", p(tmp, "err_cfg_meg"), "--no-progress"]),
        "sliding_window")
    # Megatron side: a torch_dist checkpoint with an extra tensor / without one
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from moe_async.models import hf_config_dict

    cfg = hf_config_dict(p(tmp, "mix"))
    for kind in ("extra", "missing"):
        d = p(tmp, f"err_meg_{kind}")
        os.makedirs(d)
        with parallel_layout(1, 1, 1):
            model, _ = build_model(cfg, 1, 1, 1)
            sd = model.sharded_state_dict()
            if kind == "extra":
                sd["stray"] = ShardedTensor.from_rank_offsets("decoder.stray_tensor.weight", torch.zeros(4))
            else:
                sd.pop("decoder.final_layernorm.weight")
            dist_checkpointing.save({"model": sd}, d)
    res["extra_meg_tensor"] = expect_error(
        lambda: megatron_to_hf_checkpoint(p(tmp, "err_meg_extra"), p(tmp, "mix"), p(tmp, "y"), progress=False),
        "decoder.stray_tensor.weight", "unused")
    res["missing_meg_tensor"] = expect_error(
        lambda: megatron_to_hf_checkpoint(p(tmp, "err_meg_missing"), p(tmp, "mix"), p(tmp, "z"), progress=False),
        "decoder.final_layernorm.weight", "missing")
    # the mapping itself: a Megatron name it does not know / an HF tensor left unset
    from moe_async.models import megatron_to_hf

    sd = dict(hf_tensors(p(tmp, "mix")))
    from moe_async.models import hf_to_megatron

    meg = hf_to_meg = hf_to_megatron(sd, cfg)
    meg_missing = {k: v for k, v in hf_to_meg.items() if k != "decoder.layers.0.mlp.router.weight"}
    res["unset_hf_target"] = expect_error(lambda: list(megatron_to_hf(meg_missing.items(), cfg)),
                                          "model.layers.0.block_sparse_moe.gate.weight", "not set")
    meg_extra = dict(meg, **{"decoder.layers.0.mlp.shared_experts.linear_fc1.weight": torch.zeros(2)})
    res["unused_meg_source"] = expect_error(lambda: list(megatron_to_hf(meg_extra.items(), cfg)),
                                            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight")
    return res


def prep(tmp: str) -> dict:
    import convert_hf_to_megatron as h2m_cli
    import convert_megatron_to_hf as m2h_cli

    res: dict = {}
    for name in ALL:
        h2m_cli.main(["--hf", p(tmp, name), "--out", p(tmp, f"meg_ep1_{name}"), "--no-progress"])
        m2h_cli.main(["--megatron", p(tmp, f"meg_ep1_{name}"), "--hf-config", p(tmp, name),
                      "--out", p(tmp, f"back_ep1_{name}"), "--max-shard-size", SHARD[name], "--no-progress"])
        if name == "llama":
            continue
        ml = megatron_logits(p(tmp, f"meg_ep1_{name}"), p(tmp, name))
        hl = torch.load(p(tmp, f"hf_logits_{name}.pt"))
        res[f"meg_logits_ep1_{name}"] = {"maxdiff": float((ml - hl).abs().max()), "shape_ok": ml.shape == hl.shape,
                                         "hf_logit_std": float(hl.std())}
    # vocab padded to 96 x TP: 288 rows at TP1, which TP2 must load as 288 (not 384)
    h2m_cli.main(["--hf", p(tmp, "mix"), "--out", p(tmp, "meg_v96_mix"), "--vocab-div", "96", "--no-progress"])
    res["errors"] = error_cases(tmp)
    res["n_hf_files"] = {n: len(set(json.load(open(p(tmp, n, "model.safetensors.index.json")))["weight_map"].values()))
                         for n in ALL}
    return res


def w2(tmp: str) -> None:
    import convert_hf_to_megatron as h2m_cli
    import convert_megatron_to_hf as m2h_cli

    for name in NAMES:
        h2m_cli.main(["--hf", p(tmp, name), "--out", p(tmp, f"meg_ep2_{name}"), "--ep", "2", "--no-progress"])
        h2m_cli.main(["--hf", p(tmp, name), "--out", p(tmp, f"meg_tp2_{name}"), "--tp", "2", "--no-progress"])
        h2m_cli.main(["--hf", p(tmp, f"{name}_fused"), "--out", p(tmp, f"meg_fused_ep2_{name}"), "--ep", "2",
                      "--no-progress"])
        # torch_dist reshards on load: saved at EP1 (1 process) -> loaded at EP2; TP2 -> TP2
        m2h_cli.main(["--megatron", p(tmp, f"meg_ep1_{name}"), "--hf-config", p(tmp, name),
                      "--out", p(tmp, f"back_ep1at2_{name}"), "--ep", "2", "--max-shard-size", "300KB",
                      "--no-progress"])
        m2h_cli.main(["--megatron", p(tmp, f"meg_tp2_{name}"), "--hf-config", p(tmp, name),
                      "--out", p(tmp, f"back_tp2at2_{name}"), "--tp", "2", "--max-shard-size", "300KB",
                      "--no-progress"])
    h2m_cli.main(["--hf", p(tmp, "llama"), "--out", p(tmp, "meg_tp2_llama"), "--tp", "2", "--no-progress"])
    h2m_cli.main(["--hf", p(tmp, "ds"), "--out", p(tmp, "meg_ep2_ds"), "--ep", "2", "--no-progress"])
    h2m_cli.main(["--hf", p(tmp, "ds"), "--out", p(tmp, "meg_tp2_ds"), "--tp", "2", "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_tp2_ds"), "--hf-config", p(tmp, "ds"),
                  "--out", p(tmp, "back_tp2at2_ds"), "--tp", "2", "--max-shard-size", "300KB", "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_ep1_ds"), "--hf-config", p(tmp, "ds"),
                  "--out", p(tmp, "back_ep1at2_ds"), "--ep", "2", "--max-shard-size", "300KB", "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_v96_mix"), "--hf-config", p(tmp, "mix"),
                  "--out", p(tmp, "back_v96at2_mix"), "--tp", "2", "--max-shard-size", "300KB", "--no-progress"])


def compare_dirs(orig: str, back: str) -> dict:
    a, b = hf_tensors(orig), hf_tensors(back)
    bad = sorted(k for k in a if k in b and (a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])))
    return {"same_names": set(a) == set(b), "extra": sorted(set(b) - set(a))[:5],
            "missing": sorted(set(a) - set(b))[:5], "unequal": bad[:5], "n": len(a),
            "has_index": os.path.exists(p(back, "model.safetensors.index.json")),
            "tokenizer_copied": open(p(orig, "tokenizer_config.json")).read()
            == open(p(back, "tokenizer_config.json")).read() if os.path.exists(p(orig, "tokenizer_config.json")) else None}


def experts_saved_once(meg: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    from moe_async.megatron.container import resolve

    md = FileSystemReader(resolve(meg)).read_metadata().state_dict_metadata
    keys = [k for k in md if k.startswith("decoder.layers.mlp.experts.") and k.endswith(".weight")]
    ok = bool(keys)
    for k in keys:
        cover = torch.zeros(tuple(md[k].size), dtype=torch.int32)
        for c in md[k].chunks:
            cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
        ok = ok and bool((cover == 1).all()) and cover.shape[1] == 4
    return ok


def final(tmp: str) -> dict:
    import convert_megatron_to_hf as m2h_cli
    from transformers import AutoModelForCausalLM

    res: dict = {}
    m2h_cli.main(["--megatron", p(tmp, "meg_tp2_llama"), "--hf-config", p(tmp, "llama"),
                  "--out", p(tmp, "back_tp2_llama"), "--max-shard-size", SHARD["llama"], "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_ep2_ds"), "--hf-config", p(tmp, "ds"),
                  "--out", p(tmp, "back_ep2_ds"), "--max-shard-size", "300KB", "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_tp2_ds"), "--hf-config", p(tmp, "ds"),
                  "--out", p(tmp, "back_tp2_ds"), "--max-shard-size", "300KB", "--no-progress"])
    for name, srcs in (("llama", ("ep1", "tp2")), ("ds", ("ep1", "ep2", "ep1at2", "tp2", "tp2at2"))):
        hl = torch.load(p(tmp, f"hf_logits_{name}.pt"))
        for src in srcs:
            back = p(tmp, f"back_{src}_{name}")
            r = compare_dirs(p(tmp, name), back)
            m = AutoModelForCausalLM.from_pretrained(back).eval()
            with torch.no_grad():
                r["hf_logits_equal"] = bool(torch.equal(m(torch.tensor(PROMPT)).logits.float(), hl))
            r["dtypes"] = sorted({str(t.dtype) for t in hf_tensors(back).values()})
            res[f"{src}_{name}"] = r
    res["ds_bias_absmax"] = [float(t.abs().max()) for k, t in hf_tensors(p(tmp, "ds")).items()
                             if k.endswith("e_score_correction_bias")]
    ml = megatron_logits(p(tmp, "meg_ep2_ds"), p(tmp, "ds"))
    res["meg_logits_ep2_ds"] = {"maxdiff": float((ml - torch.load(p(tmp, "hf_logits_ds.pt"))).abs().max())}
    ml = megatron_logits(p(tmp, "meg_tp2_ds"), p(tmp, "ds"))
    res["meg_logits_tp2_ds"] = {"maxdiff": float((ml - torch.load(p(tmp, "hf_logits_ds.pt"))).abs().max())}
    for name in NAMES:
        for src in ("ep2", "tp2", "fused_ep2"):
            m2h_cli.main(["--megatron", p(tmp, f"meg_{src}_{name}"), "--hf-config", p(tmp, name),
                          "--out", p(tmp, f"back_{src}_{name}"), "--max-shard-size", "300KB", "--no-progress"])
        hl = torch.load(p(tmp, f"hf_logits_{name}.pt"))
        for src in ("ep1", "ep2", "tp2", "fused_ep2", "ep1at2", "tp2at2", "v96at2"):
            back = p(tmp, f"back_{src}_{name}")
            if not os.path.exists(back):  # v96at2: mixtral only
                continue
            r = compare_dirs(p(tmp, name), back)
            m = AutoModelForCausalLM.from_pretrained(back).eval()
            with torch.no_grad():
                lg = m(torch.tensor(PROMPT)).logits.float()
            r["hf_logits_equal"] = bool(torch.equal(lg, hl))
            res[f"{src}_{name}"] = r
        ml = megatron_logits(p(tmp, f"meg_ep2_{name}"), p(tmp, name))
        res[f"meg_logits_ep2_{name}"] = {"maxdiff": float((ml - hl).abs().max())}
        res[f"experts_once_ep2_{name}"] = experts_saved_once(p(tmp, f"meg_ep2_{name}"))
    return res
