"""glm4_moe conversion checks of test_convert_glm4_moe.py, one function per launch of
_convert_launches.py; the helpers are _convert_checks.py's; the results are returned as dicts,
every path under TMP.

    make_hf(TMP)   (prep, before Megatron is imported)
        the tiny GLM-4.5 checkpoint ``glm`` (tests/models/_tiny_glm4_moe.py, with its MTP
        block ``model.layers.2``) and transformers' logits on a fixed prompt.
    prep(TMP)   (1 process)
        HF -> Megatron at EP1, Megatron -> HF from it; the Megatron model's logits.
    w2(TMP)   (2 ranks, the gloo process group already initialised)
        HF -> Megatron at EP2 and at TP2; Megatron -> HF reading the TP2 checkpoint at TP2 and
        the EP1 checkpoint at EP2.
    final(TMP)   (1 process)
        Megatron -> HF at 1 process from the EP2 / TP2 checkpoints; every round-tripped dir
        against the original tensors minus the MTP block (bit-exact, same names and dtypes)
        and by the logits of transformers loaded from it; the Megatron model loaded from
        each checkpoint against transformers' logits.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _convert_checks as cc  # noqa: E402  (puts tests/models, tools/ and the root on sys.path)
import torch  # noqa: E402

PROMPT = [[5, 17, 99, 3, 120, 41, 7, 127, 64, 100, 11, 2]]  # vocab 128
p = cc.p


def make_hf(tmp: str) -> None:
    from _tiny_glm4_moe import make_tiny_glm4_moe
    from transformers import AutoModelForCausalLM

    make_tiny_glm4_moe(p(tmp, "glm"))
    with open(p(tmp, "glm", "tokenizer_config.json"), "w") as f:
        json.dump({"fake": "glm"}, f)
    m = AutoModelForCausalLM.from_pretrained(p(tmp, "glm")).eval()
    with torch.no_grad():
        torch.save(m(torch.tensor(PROMPT)).logits.float(), p(tmp, "hf_logits.pt"))


def prep(tmp: str) -> dict:
    import convert_hf_to_megatron as h2m_cli
    import convert_megatron_to_hf as m2h_cli

    h2m_cli.main(["--hf", p(tmp, "glm"), "--out", p(tmp, "meg_ep1"), "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_ep1"), "--hf-config", p(tmp, "glm"), "--out", p(tmp, "back_ep1"),
                  "--no-progress"])
    ml = cc.megatron_logits(p(tmp, "meg_ep1"), p(tmp, "glm"), PROMPT)
    hl = torch.load(p(tmp, "hf_logits.pt"))
    return {"meg_logits_ep1": {"maxdiff": float((ml - hl).abs().max()), "hf_logit_std": float(hl.std())}}


def w2(tmp: str) -> None:
    import convert_hf_to_megatron as h2m_cli
    import convert_megatron_to_hf as m2h_cli

    g = p(tmp, "glm")
    h2m_cli.main(["--hf", g, "--out", p(tmp, "meg_ep2"), "--ep", "2", "--no-progress"])
    h2m_cli.main(["--hf", g, "--out", p(tmp, "meg_tp2"), "--tp", "2", "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_tp2"), "--hf-config", g, "--out", p(tmp, "back_tp2at2"), "--tp", "2",
                  "--no-progress"])
    m2h_cli.main(["--megatron", p(tmp, "meg_ep1"), "--hf-config", g, "--out", p(tmp, "back_ep1at2"), "--ep", "2",
                  "--no-progress"])


def final(tmp: str) -> dict:
    import convert_megatron_to_hf as m2h_cli
    from transformers import AutoModelForCausalLM

    from moe_async.models import get_family

    g = p(tmp, "glm")
    for src in ("ep2", "tp2"):
        m2h_cli.main(["--megatron", p(tmp, f"meg_{src}"), "--hf-config", g, "--out", p(tmp, f"back_{src}"),
                      "--no-progress"])
    fam = get_family("glm4_moe")
    mtp = set(fam.mtp_hf_keys(fam.arch_args(g)))
    orig = cc.hf_tensors(g)
    hl = torch.load(p(tmp, "hf_logits.pt"))
    res: dict = {"n_mtp_on_disk": len(mtp & set(orig))}
    for src in ("ep1", "ep2", "tp2", "ep1at2", "tp2at2"):
        back = cc.hf_tensors(p(tmp, f"back_{src}"))
        m = AutoModelForCausalLM.from_pretrained(p(tmp, f"back_{src}")).eval()
        with torch.no_grad():
            logits_equal = bool(torch.equal(m(torch.tensor(PROMPT)).logits.float(), hl))
        res[f"back_{src}"] = {
            "names_are_orig_minus_mtp": set(back) == set(orig) - mtp,
            "unequal": sorted(k for k in back if back[k].dtype != orig[k].dtype or not torch.equal(back[k], orig[k])),
            "n": len(back), "hf_logits_equal": logits_equal,
            "bias_dtype": str(back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype),
            "tokenizer_copied": os.path.exists(p(tmp, f"back_{src}", "tokenizer_config.json")),
        }
    for src in ("ep2", "tp2"):
        ml = cc.megatron_logits(p(tmp, f"meg_{src}"), g, PROMPT)
        res[f"meg_logits_{src}"] = {"maxdiff": float((ml - hl).abs().max())}
    return res
